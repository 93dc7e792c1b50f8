"""Every field of vLLM's CompletionRequest and ChatCompletionRequest (vllm/entrypoints/openai/protocol.py)
against the shared test server: each is either accepted with a representative value (and has its
effect where that is cheap to see) or refused with an OpenAI-shaped 400 whose `param` names it. The
tables must cover vLLM's lists exactly, so a field cannot be forgotten."""

from __future__ import annotations

import json
import re

import pytest

from serve.request_fields import CHAT_FIELDS, COMPLETION_FIELDS, REFUSED
from server_harness import MODEL, NO_EOS, check_error_shape, post_raw

# vLLM's field names, in its declaration order (`structured_outputs`: vLLM >= 0.10.2).
VLLM_COMPLETION = (
    "model prompt prompt_embeds best_of echo frequency_penalty logit_bias logprobs max_tokens n "
    "presence_penalty seed stop stream stream_options suffix temperature top_p user use_beam_search top_k "
    "min_p repetition_penalty length_penalty stop_token_ids include_stop_str_in_output ignore_eos "
    "min_tokens skip_special_tokens spaces_between_special_tokens truncate_prompt_tokens allowed_token_ids "
    "prompt_logprobs add_special_tokens response_format guided_json guided_regex guided_choice "
    "guided_grammar guided_decoding_backend guided_whitespace_pattern priority request_id "
    "logits_processors return_tokens_as_token_ids cache_salt kv_transfer_params vllm_xargs "
    "structured_outputs").split()
VLLM_CHAT = (
    "messages model frequency_penalty logit_bias logprobs top_logprobs max_tokens max_completion_tokens n "
    "presence_penalty response_format seed stop stream stream_options temperature top_p tools tool_choice "
    "reasoning_effort include_reasoning parallel_tool_calls user best_of use_beam_search top_k min_p "
    "repetition_penalty length_penalty stop_token_ids include_stop_str_in_output ignore_eos min_tokens "
    "skip_special_tokens spaces_between_special_tokens truncate_prompt_tokens prompt_logprobs "
    "allowed_token_ids bad_words echo add_generation_prompt continue_final_message add_special_tokens "
    "documents chat_template chat_template_kwargs mm_processor_kwargs guided_json guided_regex "
    "guided_choice guided_grammar structural_tag guided_decoding_backend guided_whitespace_pattern "
    "priority request_id logits_processors return_tokens_as_token_ids cache_salt kv_transfer_params "
    "vllm_xargs structured_outputs").split()

PROMPT = "The quick brown fox jumps"
MESSAGES = [{"role": "user", "content": "Hello world"}]
BASE = {"completions": {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "temperature": 0, **NO_EOS},
        "chat": {"model": MODEL, "messages": MESSAGES, "max_tokens": 2, "temperature": 0, **NO_EOS}}
PATH = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


def ok(check=None):
    return ("ok", check)


def text_of(r: dict) -> str:
    c = r["choices"][0]
    return c["text"] if "text" in c else c["message"]["content"]


def streamed(r) -> bool:
    return isinstance(r, str) and r.startswith("data: ") and r.rstrip().endswith("data: [DONE]")


# Accepted fields: name -> (value, check(response)). `None` means "200 is the check".
HONOURED = {
    "model": ok(lambda r: r["model"] == MODEL),
    "max_tokens": ok(lambda r: r["usage"]["completion_tokens"] == 2),
    "n": ok(lambda r: len(r["choices"]) == 2),
    "temperature": ok(), "top_p": ok(), "top_k": ok(), "min_p": ok(), "repetition_penalty": ok(),
    "presence_penalty": ok(), "frequency_penalty": ok(), "seed": ok(), "stop": ok(),
    "stop_token_ids": ok(), "include_stop_str_in_output": ok(), "ignore_eos": ok(),
    "min_tokens": ok(lambda r: r["usage"]["completion_tokens"] == 2), "skip_special_tokens": ok(),
    "stream": ok(streamed),
    "stream_options": ok(lambda r: json.loads(r.split("data: ")[-2])["usage"]["completion_tokens"] == 2),
    "user": ok(), "best_of": ok(lambda r: len(r["choices"]) == 1),
    "prompt_logprobs": ok(lambda r: (r["choices"][0].get("prompt_logprobs") or r.get("prompt_logprobs"))),
    "priority": ok(), "add_special_tokens": ok(),
    "request_id": ok(lambda r: r["id"].endswith("-client-id-7")),
    "truncate_prompt_tokens": ok(lambda r: r["usage"]["prompt_tokens"] == 2),
    # completions
    "prompt": ok(), "echo": ok(lambda r: "text" not in r["choices"][0] or text_of(r).startswith(PROMPT)),
    "logprobs": ok(lambda r: r["choices"][0]["logprobs"] is not None),
    # chat
    "messages": ok(), "max_completion_tokens": ok(lambda r: r["usage"]["completion_tokens"] == 1),
    "top_logprobs": ok(lambda r: len(r["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 2),
    "add_generation_prompt": ok(), "chat_template_kwargs": ok(), "documents": ok(),
    "parallel_tool_calls": ok(),
    # structured output (tests/test_structured_output.py checks it on the demo model)
    "response_format": ok(lambda r: text_of(r).startswith("{")),
    "guided_json": ok(lambda r: text_of(r).startswith("{")),
    "guided_whitespace_pattern": ok(lambda r: text_of(r).startswith("{")),
    "guided_regex": ok(lambda r: re.fullmatch("[a-z]*", text_of(r))),
    "guided_choice": ok(lambda r: any(c.startswith(text_of(r)) for c in ("yes", "no"))),
    "guided_grammar": ok(lambda r: text_of(r) == "a"),
    "structured_outputs": ok(lambda r: any(c.startswith(text_of(r)) for c in ("yes", "no"))),
    # tools (tests/test_tool_calls.py has the rest)
    "tools": ok(lambda r: r["choices"][0]["message"]["tool_calls"] == []),
    "tool_choice": ok(lambda r: r["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "f"),
}
VALUES = {
    "model": MODEL, "max_tokens": 2, "n": 2, "temperature": 0.5, "top_p": 0.9, "top_k": 5, "min_p": 0.05,
    "repetition_penalty": 1.1, "presence_penalty": 0.5, "frequency_penalty": 0.5, "seed": 7,
    "stop": ["zzz"], "stop_token_ids": [380], "include_stop_str_in_output": True, "ignore_eos": True,
    "min_tokens": 2, "skip_special_tokens": False, "stream": True,
    "stream_options": {"include_usage": True}, "user": "someone", "best_of": 1, "prompt_logprobs": 1,
    "priority": -3, "add_special_tokens": True, "request_id": "client-id-7", "truncate_prompt_tokens": 2,
    "prompt": [5, 6, 7], "echo": True, "logprobs": 2, "messages": MESSAGES, "max_completion_tokens": 1,
    "top_logprobs": 2, "add_generation_prompt": False, "chat_template_kwargs": {"flavour": "plain"},
    "documents": [{"title": "t", "text": "some text"}], "parallel_tool_calls": False,
    "response_format": {"type": "json_object"}, "guided_json": {"type": "object"},
    "guided_whitespace_pattern": " ", "guided_regex": "[a-z]+", "guided_choice": ["yes", "no"],
    "guided_grammar": "root ::= \"a\"", "structured_outputs": {"choice": ["yes", "no"]},
    # refused: values that ask for what the server lacks
    "prompt_embeds": "AAAA", "suffix": " the end", "logit_bias": {"5": 10.0}, "allowed_token_ids": [5, 6],
    "bad_words": ["fox"], "structural_tag": "{}", "guided_decoding_backend": "xgrammar",
    "use_beam_search": True, "length_penalty": 0.5, "spaces_between_special_tokens": False,
    "continue_final_message": True, "chat_template": "{{ messages }}", "mm_processor_kwargs": {"a": 1},
    "logits_processors": ["my.Processor"], "return_tokens_as_token_ids": True, "cache_salt": "salt",
    "kv_transfer_params": {"do_remote_decode": True}, "vllm_xargs": {"k": 1},
    "tools": [{"type": "function", "function": {"name": "f"}}],
    "tool_choice": {"type": "function", "function": {"name": "f"}},
    "reasoning_effort": "low", "include_reasoning": False,
}
# Values of refused fields that ask for nothing: sent together, they are accepted.
NO_OPS = {"prompt_embeds": None, "suffix": "", "logit_bias": {}, "allowed_token_ids": None, "bad_words": [],
          "response_format": {"type": "text"}, "guided_json": None, "guided_decoding_backend": "auto",
          "use_beam_search": False,
          "length_penalty": 1.0, "spaces_between_special_tokens": True, "continue_final_message": False,
          "logits_processors": [], "return_tokens_as_token_ids": False, "vllm_xargs": {}, "tools": [],
          "tool_choice": "none", "include_reasoning": True}
CHAT_VALUES = {"logprobs": True}
EXTRA = {"n": {"temperature": 0.8}, "top_logprobs": {"logprobs": True}, "stream_options": {"stream": True},
         "guided_whitespace_pattern": {"guided_json": {"type": "object"}}, "tools": {"tool_choice": "none"},
         "tool_choice": {"tools": [{"type": "function", "function": {"name": "f"}}]}}


def post(endpoint: str, server, body: dict):
    status, _, raw = post_raw(server.urls["main"], PATH[endpoint], json.dumps(body).encode())
    return status, raw


def test_tables_cover_vllms_fields_exactly():
    assert COMPLETION_FIELDS == set(VLLM_COMPLETION) and CHAT_FIELDS == set(VLLM_CHAT)
    for name in set(VLLM_COMPLETION) | set(VLLM_CHAT):
        assert (name in HONOURED) != (name in REFUSED), name
        assert name in VALUES, name


@pytest.mark.parametrize("endpoint,name", [("completions", f) for f in VLLM_COMPLETION]
                         + [("chat", f) for f in VLLM_CHAT])
def test_every_vllm_field_is_honoured_or_refused(server, endpoint, name):
    value = CHAT_VALUES.get(name, VALUES[name]) if endpoint == "chat" else VALUES[name]
    body = {**BASE[endpoint], **EXTRA.get(name, {}), name: value}
    status, raw = post(endpoint, server, body)
    if name in REFUSED:
        assert status == 400, raw
        check_error_shape(raw, 400, name)
        return
    assert status == 200, raw
    _, check = HONOURED[name]
    if check is not None:
        text = raw.decode()
        assert check(text if body.get("stream") else json.loads(text)), text


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_refused_fields_accept_values_that_ask_for_nothing(server, endpoint):
    known = COMPLETION_FIELDS if endpoint == "completions" else CHAT_FIELDS
    body = {**BASE[endpoint], **{k: v for k, v in NO_OPS.items() if k in known}}
    status, raw = post(endpoint, server, body)
    assert status == 200, raw


def test_best_of_beyond_n_and_bad_priority_are_refused(server):
    for extra, param in (({"best_of": 3}, "best_of"), ({"priority": "high"}, "priority"),
                         ({"request_id": ""}, "request_id"), ({"truncate_prompt_tokens": 0},
                                                              "truncate_prompt_tokens")):
        status, raw = post("completions", server, {**BASE["completions"], **extra})
        assert status == 400, raw
        check_error_shape(raw, 400, param)


def test_priority_reaches_the_engine(server):
    seen = []
    engine = server.engine
    original = engine.generate

    def spy(prompt, params, request_id, priority=0, **kwargs):
        seen.append(priority)
        return original(prompt, params, request_id, priority=priority, **kwargs)

    engine.generate = spy
    try:
        status, raw = post("completions", server, {**BASE["completions"], "priority": -5})
    finally:
        del engine.generate
    assert status == 200, raw
    assert seen == [-5]


def test_speculative_decoding_opt_out_reaches_the_engine(server):
    """jaxinfer's own field: `speculative_decoding: false` opts a request out; a non-boolean is a
    400 naming it."""
    seen = []
    engine = server.engine
    original = engine.generate

    def spy(prompt, params, request_id, priority=0, **kwargs):
        seen.append(params.speculative_decoding)
        return original(prompt, params, request_id, priority=priority, **kwargs)

    engine.generate = spy
    try:
        status, raw = post("completions", server, {**BASE["completions"],
                                                   "speculative_decoding": False})
    finally:
        del engine.generate
    assert status == 200, raw
    assert seen == [False]
    status, raw = post("chat", server, {**BASE["chat"], "speculative_decoding": "no"})
    assert status == 400, raw
    check_error_shape(raw, 400, "speculative_decoding")
