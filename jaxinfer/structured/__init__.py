"""Structured output: requests constrained to a JSON schema, a regex, a list of choices or a grammar.

`params.StructuredOutputsParams` is the request side (vLLM's names); `grammar.GrammarCompiler` turns
it into a compiled grammar (llguidance, cached by grammar) and a per-sequence `GrammarMatcher` on
the host; `bitmask.apply_token_bitmask` applies the matcher's packed token bitmask to the logits
inside the jitted sampler.
"""

from jaxinfer.structured.params import GuidedDecodingParams, StructuredOutputsParams

__all__ = ["StructuredOutputsParams", "GuidedDecodingParams"]
