"""Every field of vLLM's CompletionRequest and ChatCompletionRequest
(vllm/entrypoints/openai/protocol.py), sorted into those this server honours (parsed in protocol.py)
and those it cannot honour, which are refused with a 400 naming the field whenever the value would
ask for something (a null, or the value that changes nothing, passes). Names outside vLLM's lists
are ignored with a log line, as vLLM does."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

from jaxinfer.sampling_params import short_repr
from serve.errors import bad_request

logger = logging.getLogger("serve.protocol")

# Fields passed straight to SamplingParams (its `validate` names the field in any error). A JSON null
# means "the default", as in vLLM.
SAMPLING_FIELDS = ("n", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                   "frequency_penalty", "seed", "min_tokens", "stop", "stop_token_ids",
                   "include_stop_str_in_output", "ignore_eos", "skip_special_tokens")
# Structured output (serve/structured.py).
STRUCTURED_FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                     "guided_whitespace_pattern", "structured_outputs")
# jaxinfer's own request fields beyond vLLM's (vLLM ignores them), passed to SamplingParams too.
EXTENSION_FIELDS = ("speculative_decoding",)
HONOURED_COMMON = frozenset(SAMPLING_FIELDS) | frozenset(STRUCTURED_FIELDS) | {
    "model", "max_tokens", "stream", "stream_options", "user", "logprobs", "echo", "prompt_logprobs",
    "add_special_tokens", "priority", "request_id", "truncate_prompt_tokens", "best_of"}
HONOURED_COMPLETION = HONOURED_COMMON | {"prompt"}
HONOURED_CHAT = HONOURED_COMMON | {"messages", "max_completion_tokens", "top_logprobs",
                                   "add_generation_prompt", "chat_template_kwargs", "documents",
                                   "tools", "tool_choice", "parallel_tool_calls"}  # serve/tools.py


def _null(v: Any) -> bool:
    return v is None


def _empty(v: Any) -> bool:
    return v is None or v in ("", [], {})


def _not_true(v: Any) -> bool:
    return v is None or v is False


def _not_false(v: Any) -> bool:
    return v is None or v is True


# name -> (accepts(value): the value asks for nothing this server lacks, why the field is refused)
REFUSED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "prompt_embeds": (_null, "prompt embeddings are not supported; send text or token ids"),
    "suffix": (_empty, "suffix (fill in the middle) is not supported"),
    "logit_bias": (_empty, "logit_bias is not supported by this server"),
    "allowed_token_ids": (_null, "allowed_token_ids is not supported by this server"),
    "bad_words": (_empty, "bad_words is not supported by this server"),
    "structural_tag": (_null, "structural tags are not supported; use response_format or guided_*"),
    "guided_decoding_backend": (lambda v: v in (None, "auto", "guidance", "llguidance"),
                                "this server's one structured-output backend is llguidance "
                                "('auto' or 'guidance')"),
    "use_beam_search": (_not_true, "beam search is not supported"),
    "length_penalty": (lambda v: v is None or (type(v) in (int, float) and v == 1),
                       "length_penalty applies to beam search, which is not supported"),
    "spaces_between_special_tokens": (_not_false, "spaces_between_special_tokens=false is not supported"),
    "continue_final_message": (_not_true, "continue_final_message is not supported; send the partial "
                                          "answer as a completions prompt"),
    "chat_template": (_null, "per-request chat templates are not accepted; the server's template "
                             "(--chat-template) applies"),
    "mm_processor_kwargs": (_empty, "this server serves text-only models"),
    "logits_processors": (_empty, "logits processors are not supported by this server"),
    "return_tokens_as_token_ids": (_not_true, "return_tokens_as_token_ids is not supported"),
    "cache_salt": (_null, "cache_salt (prefix cache salting) is not supported"),
    "kv_transfer_params": (_null, "KV transfer (disaggregated serving) is not supported"),
    "vllm_xargs": (_empty, "no extension of this server reads vllm_xargs"),
    "reasoning_effort": (_null, "reasoning_effort is not supported by this server"),
    "include_reasoning": (_not_false, "include_reasoning=false needs a reasoning parser, which this server "
                                      "lacks: reasoning stays in the content"),
}
REFUSED_COMPLETION = frozenset(REFUSED) - {"bad_words", "structural_tag", "continue_final_message",
                                           "chat_template", "mm_processor_kwargs", "reasoning_effort",
                                           "include_reasoning"}
REFUSED_CHAT = frozenset(REFUSED) - {"prompt_embeds", "suffix"}
COMPLETION_FIELDS = HONOURED_COMPLETION | REFUSED_COMPLETION
CHAT_FIELDS = HONOURED_CHAT | REFUSED_CHAT


def log_unknown_fields(body: dict, known: frozenset[str], endpoint: str) -> None:
    unknown = sorted(set(body) - known)
    if unknown:
        logger.warning("%s: ignoring unknown request fields %s%s", endpoint,
                       json.dumps([k[:40] for k in unknown[:8]]),
                       f" and {len(unknown) - 8} more" if len(unknown) > 8 else "")


def check_fields(body: dict, chat: bool, reasoning: bool = False) -> None:
    """Refuse the first field that asks for something unsupported; log the unknown ones. With a
    reasoning parser (`reasoning`), include_reasoning is honoured (serve/reasoning/)."""
    log_unknown_fields(body, (CHAT_FIELDS if chat else COMPLETION_FIELDS) | set(EXTENSION_FIELDS),
                       "/v1/chat/completions" if chat else "/v1/completions")
    for name in sorted(REFUSED_CHAT if chat else REFUSED_COMPLETION):
        accepts, why = REFUSED[name]
        if name == "include_reasoning" and reasoning:
            continue
        if name in body and not accepts(body[name]):
            raise bad_request(f"{name}={short_repr(body[name], 80)}: {why}", name)
