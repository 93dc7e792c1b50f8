"""Property-based fuzzing of the request schemas (/v1/completions, /v1/chat/completions,
/v1/responses) against the server over loopback: wrong types, huge / negative / NaN / infinite
numbers, integers of hundreds of digits, unicode edge cases (lone surrogates, NUL, astral
characters), deep nesting, oversized lists.

Properties: no response is >= 500; every refusal is an OpenAI-shaped 4xx whose `param` names a field
of the request (or whose message says the body itself is wrong); a stream that starts ends with
[DONE] and carries no 5xx error; and afterwards the engine still serves, with the same greedy tokens
as before the fuzzing. Derandomized, a fixed number of examples: the same cases every CI run.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from server_harness import MODEL, NO_EOS, add_app, check_error_shape, post_raw, wait_pool_free

pytestmark = pytest.mark.slow  # minutes on the CI machine: xdist starts its group first (conftest.py)

EXAMPLES = 90  # per schema; about 20-40 s each on the 2-core CI machine
RESPONSES_EXAMPLES = 30  # /v1/responses: most of its path is chat's, fuzzed above

# ---- values --------------------------------------------------------------------------------------

weird_chars = st.one_of(
    st.characters(),  # any valid code point
    st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF),  # lone surrogates
    st.sampled_from(["\x00", "\u200b", "\ufeff", "\U0001f600", "\u0301"]),
)
# Pieces the tokenizer or the chat template treat specially, among ordinary characters.
weird_text = st.lists(
    st.one_of(weird_chars, st.sampled_from(["<|im_end|>", "<s>", "{{", "%}", " hello"])), max_size=30
).map("".join)
huge_ints = st.sampled_from(
    [10**400, -(10**400), 2**31, 2**31 - 1, -(2**31) - 1, 2**63, 2**64, -1, 0, 10**18]
)
weird_floats = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([1e308, -1e308, 5e-324, 3.5e38, 1e-45, -0.0]),
)
scalars = st.one_of(st.none(), st.booleans(), st.integers(), huge_ints, weird_floats, weird_text)


class Deep:
    """`depth` levels of alternating objects and lists around "x", written straight into the JSON
    bytes by `send` (json.dumps and hypothesis's printer would recurse past Python's limit)."""

    def __init__(self, depth: int):
        self.depth = depth

    def __repr__(self) -> str:
        return f"Deep({self.depth})"

    def placeholder(self) -> str:
        return f"@@DEEP{self.depth}@@"

    def json(self) -> bytes:
        opens = b"".join(b"[" if i % 2 else b'{"a":' for i in reversed(range(self.depth)))
        closes = b"".join(b"]" if i % 2 else b"}" for i in range(self.depth))
        return opens + b'"x"' + closes


deep = st.integers(20, 100_000).map(Deep)
oversized = st.sampled_from(
    [["x"] * 5000, [1] * 100_000, ["stop"] * 300, [[5, 6]] * 600, {str(i): i for i in range(2000)}]
)
garbage = st.one_of(
    scalars, deep, oversized, st.lists(scalars, max_size=5), st.dictionaries(weird_text, scalars, max_size=3)
)


def field(plausible, *, nullable: bool = True):
    """A field's plausible values (bodies() then swaps some fields for garbage)."""
    return plausible


SMALL_TOKENS = st.integers(1, 6)
COMMON = {
    "model": field(st.just(MODEL)),
    "max_tokens": field(SMALL_TOKENS, nullable=False),
    "temperature": field(st.sampled_from([0, 0.0, 0.5, 1.0, 2.0, 1e-9])),
    "top_p": field(st.floats(0.01, 1.0)),
    "top_k": field(st.integers(-1, 100)),
    "min_p": field(st.floats(0.0, 1.0)),
    "repetition_penalty": field(st.floats(0.5, 2.0)),
    "presence_penalty": field(st.floats(-2.0, 2.0)),
    "frequency_penalty": field(st.floats(-2.0, 2.0)),
    "seed": field(st.integers(-(2**63), 2**63 - 1)),
    "n": field(st.integers(1, 3)),
    "min_tokens": field(st.integers(0, 3)),
    "stop": field(st.one_of(weird_text, st.lists(weird_text, max_size=4))),
    "stop_token_ids": field(st.lists(st.integers(0, 383), max_size=4)),
    "ignore_eos": field(st.booleans()),
    "include_stop_str_in_output": field(st.booleans()),
    "skip_special_tokens": field(st.booleans()),
    "stream": field(st.booleans()),
    "stream_options": field(
        st.fixed_dictionaries(
            {}, optional={"include_usage": st.booleans(), "continuous_usage_stats": st.booleans()}
        )
    ),
    "user": field(weird_text),
    "unknown_field": garbage,
}
token_lists = st.lists(st.integers(0, 383), min_size=1, max_size=20)
COMPLETION = {
    **COMMON,
    "prompt": field(
        st.one_of(
            weird_text,
            st.lists(weird_text, min_size=1, max_size=3),
            token_lists,
            st.lists(token_lists, min_size=1, max_size=3),
        )
    ),
    "logprobs": field(st.integers(0, 20)),
    "echo": field(st.booleans()),
    "add_special_tokens": field(st.booleans()),
}
content = st.one_of(
    weird_text, st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": weird_text}), max_size=2)
)
message = st.fixed_dictionaries(
    {"role": field(st.sampled_from(["user", "system", "assistant"])), "content": field(content)}
)
CHAT = {
    **COMMON,
    "messages": field(st.lists(field(message), min_size=1, max_size=3)),
    "max_completion_tokens": field(SMALL_TOKENS, nullable=False),
    "logprobs": field(st.booleans()),
    "top_logprobs": field(st.integers(0, 20)),
    "add_generation_prompt": field(st.booleans()),
    "chat_template_kwargs": field(st.dictionaries(st.sampled_from(["x", "y"]), scalars, max_size=2)),
    "tools": field(st.just([])),
    "tool_choice": field(st.sampled_from(["none", "auto"])),
    "response_format": field(st.just({"type": "text"})),
    "logit_bias": field(st.just({})),
}


input_item = st.one_of(
    message,
    st.fixed_dictionaries({"type": st.just("function_call"), "call_id": weird_text, "name": weird_text,
                           "arguments": weird_text}),
    st.fixed_dictionaries({"type": st.just("function_call_output"), "call_id": weird_text,
                           "output": weird_text}),
)
RESPONSES = {
    **{k: COMMON[k] for k in ("model", "temperature", "top_p", "stream", "user", "seed", "unknown_field")},
    "input": field(st.one_of(weird_text, st.lists(input_item, min_size=1, max_size=3))),
    "instructions": field(weird_text),
    "max_output_tokens": field(SMALL_TOKENS, nullable=False),
    "text": field(st.sampled_from([{"format": {"type": "text"}}, {"format": {"type": "json_object"}}])),
    "tools": field(st.sampled_from([[], [{"type": "function", "name": "f",
                                          "parameters": {"type": "object"}}]])),
    "tool_choice": field(st.just("none")),
    "reasoning": field(st.fixed_dictionaries({}, optional={"effort": st.sampled_from(["low", "high"])})),
    "previous_response_id": field(st.none()),  # (a miss is a 404; garbage swaps in other values)
    "store": field(st.booleans()),
    "metadata": field(st.dictionaries(weird_text, weird_text, max_size=2)),
}


def bodies(schema: dict, required: str):
    """A body of plausible fields (each optional one present or not), then 0-3 fields (present or
    not) replaced by garbage: most requests fail on one thing, many get through to the engine."""
    optional = {k: v for k, v in schema.items() if k != required}
    plausible = st.fixed_dictionaries({required: schema[required]}, optional=optional)
    mutations = st.lists(st.tuples(st.sampled_from(sorted(schema)), garbage), max_size=3)

    def mutate(args):
        body, changes = args
        body = dict(body)
        for key, value in changes:
            if value is None and key in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
                continue  # null = until the context is full: 256 tokens, slow on CPU
            body[key] = value
        if "max_output_tokens" in schema and value_is_null_length(body, required):
            body["max_output_tokens"] = 4
        if required == "messages" and "max_tokens" not in body and "max_completion_tokens" not in body:
            body["max_tokens"] = 4  # chat's default is also "until the context is full"
        return body

    return st.tuples(plausible, mutations).map(mutate)


HIDDEN = 64  # the tiny model's hidden size: the one `dimensions` it takes
EMBEDDINGS = {
    **{k: COMMON[k] for k in ("model", "user", "unknown_field")},
    "input": COMPLETION["prompt"],
    "encoding_format": field(st.sampled_from(["float", "base64"])),
    "dimensions": field(st.sampled_from([HIDDEN, HIDDEN, 16])),  # (16: refused, no Matryoshka)
    "add_special_tokens": field(st.booleans()),
}


def value_is_null_length(body: dict, required: str) -> bool:
    """A Responses body without max_output_tokens would run to the end of the context."""
    return required == "input" and "max_output_tokens" not in body


# ---- the property --------------------------------------------------------------------------------


def check_response(path: str, body: dict, status: int, raw: bytes) -> None:
    assert status < 500, (path, status, raw[:500])
    if status >= 400:
        error = check_error_shape(raw, status)
        if status == 404:
            assert error["param"] in ("model", "previous_response_id"), error
        elif status == 400:
            named = error["param"] is not None and (
                error["param"] in body
                or error["param"] in ("prompt", "messages", "max_tokens", "top_logprobs", "n")
            )
            named = named or any(isinstance(v, Deep) for v in body.values())  # refused as a body
            named = named or (error["param"] == "tool_choice" and "tools" in body)  # its default
            assert named or error["message"].startswith("request body"), (error, sorted(body))
        else:
            assert status in (413, 503), error
        return
    assert status == 200, raw[:500]
    if body.get("stream") is True and path == "/v1/responses":
        events = [e for e in raw.split(b"\n\n") if e]
        assert events[-1].startswith((b"event: response.completed\n", b"event: response.incomplete\n",
                                      b"event: error\n")), raw[-300:]
        for e in events:
            name, data = e.split(b"\n", 1)
            event = json.loads(data[len(b"data: "):])
            assert name == b"event: " + event["type"].encode(), e
            assert event["type"] != "error" or event["code"] < 500, event
    elif body.get("stream") is True:
        events = raw.split(b"\n\n")
        assert events[-2] == b"data: [DONE]", raw[-300:]
        for e in events[:-2]:
            chunk = json.loads(e[len(b"data: ") :])
            assert "error" not in chunk or chunk["error"]["code"] < 500, chunk
    else:
        json.loads(raw)


def send(url: str, path: str, body: dict) -> tuple[int, bytes]:
    # json.dumps writes NaN / Infinity (which Python's json, and so the server, reads back), integers of
    # any size, and lone surrogates as \\ud800 escapes.
    deep: dict[str, Deep] = {}

    def placeholder(obj):
        assert isinstance(obj, Deep)
        deep[obj.placeholder()] = obj
        return obj.placeholder()

    data = json.dumps(body, default=placeholder).encode()
    for key, obj in deep.items():
        data = data.replace(json.dumps(key).encode(), obj.json())
    status, _, raw = post_raw(url, path, data, timeout=120)
    return status, raw


def greedy_tokens(url: str) -> list[str]:
    status, raw = send(
        url,
        "/v1/completions",
        {
            "model": MODEL,
            "prompt": "Once upon a time",
            "max_tokens": 12,
            "temperature": 0,
            "logprobs": 0,
            **NO_EOS,
        },
    )
    assert status == 200, raw
    return json.loads(raw)["choices"][0]["logprobs"]["tokens"]


FUZZ_SETTINGS = settings(
    max_examples=EXAMPLES,
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=list(HealthCheck),
    print_blob=True,
)


def test_fuzz_both_schemas_never_5xx_and_greedy_unchanged(server):
    url = server.urls["main"]
    before = greedy_tokens(url)
    statuses: dict[tuple[str, int], int] = {}

    def sent(path: str, body: dict) -> None:
        status, raw = send(url, path, body)
        statuses[path, status] = statuses.get((path, status), 0) + 1
        check_response(path, body, status, raw)

    @FUZZ_SETTINGS
    @given(bodies(COMPLETION, "prompt"))
    def fuzz_completions(body):
        sent("/v1/completions", body)

    @FUZZ_SETTINGS
    @given(bodies(CHAT, "messages"))
    def fuzz_chat(body):
        sent("/v1/chat/completions", body)

    @settings(FUZZ_SETTINGS, max_examples=RESPONSES_EXAMPLES)
    @given(bodies(RESPONSES, "input"))
    def fuzz_responses(body):
        sent("/v1/responses", body)

    embed_url = add_app(server, "fuzz-embed", task="embed")

    @settings(FUZZ_SETTINGS, max_examples=RESPONSES_EXAMPLES)
    @given(bodies(EMBEDDINGS, "input"))
    def fuzz_embeddings(body):
        status, raw = send(embed_url, "/v1/embeddings", body)
        statuses["/v1/embeddings", status] = statuses.get(("/v1/embeddings", status), 0) + 1
        check_response("/v1/embeddings", body, status, raw)

    fuzz_completions()
    fuzz_chat()
    fuzz_responses()
    fuzz_embeddings()
    print("fuzz statuses:", sorted(statuses.items()))
    # every endpoint reached the engine, and refusals
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/embeddings"):
        least = {"/v1/responses": 2, "/v1/embeddings": 3}.get(path, 5)  # (fewer examples)
        assert statuses.get((path, 200), 0) >= least and statuses.get((path, 400), 0) >= 4 * least, statuses
    assert server.engine.errored is None
    wait_pool_free(server, timeout=30)
    assert greedy_tokens(url) == before
