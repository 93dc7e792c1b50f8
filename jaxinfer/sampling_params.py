"""Per-request sampling parameters, with vLLM's names and defaults, and their validation.

`validate` runs before anything is scheduled (the engine calls it on add), so a bad value is an
`InvalidRequestError` naming the field and value, never a failure inside the jitted step.
"""

from __future__ import annotations

import dataclasses
import math

from jaxinfer.errors import InvalidRequestError
from jaxinfer.structured.params import StructuredOutputsParams

# Most alternatives per token `logprobs` may ask for (OpenAI's top_logprobs limit). The sampler
# always computes this many, so one compiled variant serves every request.
MAX_LOGPROBS = 20
# Most distinct stop token ids (stop_token_ids plus the EOS ids) a request may have: the jitted step
# checks them from a fixed-width array.
MAX_STOP_TOKEN_IDS = 32
# Most choices per request (each one is a sequence holding KV blocks).
MAX_N = 64
POOLING_METHODS = ("last", "mean", "cls")  # SamplingParams.pooling (worker/hidden_reads.py)
# Every numeric field reaches the jitted step as an int32 or float32: values are bounded to what those
# hold exactly (a JSON integer may have 400 digits; float32 overflows to inf past FLOAT32_MAX).
INT32_MAX = 2**31 - 1
FLOAT32_MAX = 3.4028234663852886e38
# Temperatures below this sample greedily (vLLM's _SAMPLING_EPS): dividing logits by a denormal
# float32 would overflow to inf.
GREEDY_EPS = 1e-5
# repetition_penalty divides or multiplies logits: bounded so float32 stays finite.
MAX_REPETITION_PENALTY = 1e4


def short_repr(value, limit: int = 60) -> str:
    """repr() for error messages, cut to `limit` characters (a value may be a 400-digit integer
    or a list of 10,000 strings)."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > 10**limit:
        return f"<an integer of about {len(str(abs(value)))} digits>" if abs(value) < 10**4000 \
            else "<an integer of over 4000 digits>"
    if isinstance(value, (list, dict, str)) and len(value) > limit:
        value = value[:limit] if not isinstance(value, dict) else dict(list(value.items())[:3])
        return repr(value)[:limit] + "..."
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


@dataclasses.dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: until the context (max_model_len) is full
    min_tokens: int = 0
    stop: list[str] = dataclasses.field(default_factory=list)
    stop_token_ids: list[int] = dataclasses.field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None  # alternatives per token; 0 = only the sampled token's logprob
    # Logprob of every prompt token given the ones before it (the first is None), with this many
    # alternatives each; computed in the prefill step. Such a request takes no prefix-cache hit.
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # Constrain the output to a JSON schema, regex, choice list or grammar (vLLM's field; its
    # older `guided_decoding` is the same thing). The engine compiles it when the request is added.
    structured_outputs: StructuredOutputsParams | None = None
    # False opts this request out of speculative decoding (a jaxinfer field; vLLM ignores it).
    speculative_decoding: bool = True
    # An embedding request: pool the prompt's final hidden states ("last", "mean" or "cls") and
    # generate nothing (n 1, max_tokens 1, whose token is not reported).
    pooling: str | None = None

    def __post_init__(self):
        # Accept a single stop string (OpenAI allows `stop: "###"`).
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is None:
            self.stop = []
        if self.stop_token_ids is None:
            self.stop_token_ids = []

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    @property
    def uses_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    @property
    def uses_truncation(self) -> bool:
        """top-k / top-p / min-p filtering (needs the sorted vocabulary in the sampler)."""
        return not self.greedy and (self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0)

    def validate(self, vocab_size: int) -> None:
        """Raise InvalidRequestError(param=<field>) for the first invalid field."""

        def bad(field: str, why: str):
            raise InvalidRequestError(f"{field}={short_repr(getattr(self, field))}: {why}", param=field)

        def is_int(x) -> bool:
            return isinstance(x, int) and not isinstance(x, bool)

        def is_num(x) -> bool:
            """A number that float32 holds without overflowing (so also finite, and an int of
            any size is refused without converting it)."""
            if isinstance(x, bool) or not isinstance(x, (int, float)):
                return False
            if isinstance(x, int):
                return -FLOAT32_MAX <= x <= FLOAT32_MAX
            return math.isfinite(x) and abs(x) <= FLOAT32_MAX

        def is_i32(x, lo: int = -INT32_MAX - 1) -> bool:
            return is_int(x) and lo <= x <= INT32_MAX

        if not is_int(self.n) or not 1 <= self.n <= MAX_N:
            bad("n", f"must be an integer from 1 to {MAX_N}")
        if not is_num(self.temperature) or self.temperature < 0:
            bad("temperature", f"must be a number from 0 to {FLOAT32_MAX:.4g} (0 = greedy)")
        if not is_num(self.top_p) or not 0 < self.top_p <= 1:
            bad("top_p", "must be in (0, 1]")
        if not is_i32(self.top_k, -1):
            bad("top_k", f"must be an integer from -1 to {INT32_MAX} (0 or -1 disable it)")
        if not is_num(self.min_p) or not 0 <= self.min_p <= 1:
            bad("min_p", "must be in [0, 1]")
        if (not is_num(self.repetition_penalty)
                or not 1 / MAX_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY):
            bad("repetition_penalty", f"must be in [{1 / MAX_REPETITION_PENALTY:g}, "
                                      f"{MAX_REPETITION_PENALTY:g}] (1 = off)")
        for field in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, field)
            if not is_num(value) or not -2 <= value <= 2:
                bad(field, "must be in [-2, 2]")
        if self.seed is not None and (not is_int(self.seed) or not -2**63 <= self.seed < 2**63):
            bad("seed", "must be a 64-bit integer or None")
        if self.max_tokens is not None and not is_i32(self.max_tokens, 1):
            bad("max_tokens", f"must be an integer from 1 to {INT32_MAX} (or None: until the "
                              f"context is full)")
        if not is_i32(self.min_tokens, 0):
            bad("min_tokens", f"must be an integer from 0 to {INT32_MAX}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"must not exceed max_tokens={self.max_tokens}")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            bad("stop", "must be a list of non-empty strings")
        if (not isinstance(self.stop_token_ids, list)
                or not all(is_int(t) and 0 <= t < vocab_size for t in self.stop_token_ids)):
            bad("stop_token_ids", f"must be a list of token ids in [0, {vocab_size})")
        if len(set(self.stop_token_ids)) > MAX_STOP_TOKEN_IDS - 4:
            bad("stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS - 4} distinct ids are supported")
        for field in ("logprobs", "prompt_logprobs"):
            value = getattr(self, field)
            if value is not None and (not is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                bad(field, f"must be an integer from 0 to {MAX_LOGPROBS} (or None)")
        for field in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens",
                      "speculative_decoding"):
            if not isinstance(getattr(self, field), bool):
                bad(field, "must be true or false")
        if self.pooling is not None:
            if self.pooling not in POOLING_METHODS:
                bad("pooling", f"must be one of {', '.join(POOLING_METHODS)} (or None)")
            if self.n != 1 or self.max_tokens != 1 or self.structured_outputs is not None:
                bad("pooling", "an embedding request has n=1, max_tokens=1 and no structured output")
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                bad("structured_outputs", "must be a StructuredOutputsParams")
            self.structured_outputs.validate()
            if any(t >= vocab_size for t in self.structured_outputs.reasoning_end_token_ids or ()):
                bad("structured_outputs", f"reasoning_end_token_ids must be token ids in [0, {vocab_size})")
