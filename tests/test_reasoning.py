"""Reasoning parsers: the split of canned outputs (qwen3, deepseek_r1, gpt_oss), the same split for
any re-chunking of the stream (hypothesis) and for a fixture tokenizer's token-by-token detokenized
stream (every marker straddles tokens there), tool calls parsed from the answer after the
reasoning, enable_thinking reaching the qwen3 template; and, through the official openai client on
the shared server with --reasoning-parser deepseek_r1, reasoning apart from content, streamed =
non-streamed, include_reasoning=false, and structured output constraining the answer only; without
a parser, a reply's reasoning_content is null."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from serve.reasoning.parsers import REASONING_PARSERS, DeepSeekR1Parser, GptOssParser, Qwen3Parser
from serve.reasoning.request import ReasoningRequest
from serve.tool_parsers import HermesParser
from server_harness import MODEL, NO_EOS, add_app, check_error_shape, post_raw

HARMONY = ("<|channel|>analysis<|message|>The user wants 2+2. That is 4.<|end|>"
           "<|start|>assistant<|channel|>final<|message|>It is 4.<|return|>")
CASES = [  # (parser, prompt, output, reasoning, content)
    (Qwen3Parser(), "", "<think>\nLet me add.\n</think>\n\nIt is 4.", "\nLet me add.\n", "\n\nIt is 4."),
    (Qwen3Parser(), "", "It is 4.", None, "It is 4."),
    (Qwen3Parser(), "<|im_start|>assistant\n<think>\n", "Add.\n</think>\n\n4", "Add.\n", "\n\n4"),
    (Qwen3Parser(), "<think>\n\n</think>\n\n", "4 <think>x</think>", None, "4 <think>x</think>"),
    (Qwen3Parser(), "", "<think>cut short", "cut short", None),
    (DeepSeekR1Parser(), "", "Let me add.</think>It is 4.", "Let me add.", "It is 4."),
    (DeepSeekR1Parser(), "", "<think>Let me add.</think>It is 4.", "Let me add.", "It is 4."),
    (DeepSeekR1Parser(), "", "Still thinking <thi", "Still thinking <thi", None),
    (GptOssParser(), "", HARMONY, "The user wants 2+2. That is 4.", "It is 4."),
    (GptOssParser(), "", "plain text", None, "plain text"),
    (GptOssParser(), "", "<|channel|>analysis<|message|>hmm", "hmm", None),
]


def stream_split(parser, prompt: str, pieces: list[str]) -> tuple[str | None, str | None]:
    s = ReasoningRequest(parser, prompt).stream()
    reasoning = content = ""
    for i, piece in enumerate(pieces):
        r, c = s.feed(piece, i == len(pieces) - 1)
        reasoning, content = reasoning + r, content + c
    return reasoning or None, content or None


@pytest.mark.parametrize("parser,prompt,text,reasoning,content", CASES)
def test_split_and_every_two_piece_stream(parser, prompt, text, reasoning, content):
    assert parser.split(text, prompt) == (reasoning, content)
    for i in range(len(text) + 1):
        assert stream_split(parser, prompt, [text[:i], text[i:]]) == (reasoning, content), i


@settings(max_examples=150, deadline=None)
@given(case=st.sampled_from(CASES), cuts=st.lists(st.integers(0, 200), max_size=12))
def test_any_rechunking_gives_the_same_split(case, cuts):
    parser, prompt, text, reasoning, content = case
    bounds = sorted({c % (len(text) + 1) for c in cuts})
    pieces = [text[a:b] for a, b in zip([0] + bounds, bounds + [len(text)])]
    assert stream_split(parser, prompt, pieces) == (reasoning, content)


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(sorted(REASONING_PARSERS)),
       text=st.lists(st.sampled_from(["<think>", "</think>", "<th", "ink>", "</", "a", "\n", " ",
                                      "<|channel|>", "analysis", "final", "<|message|>", "<|end|>",
                                      "<|start|>", "<|", "|>"]), max_size=14).map("".join),
       cuts=st.lists(st.integers(0, 200), max_size=10))
def test_marker_soup_rechunks_like_the_whole(name, text, cuts):
    parser = REASONING_PARSERS[name]()
    bounds = sorted({c % (len(text) + 1) for c in cuts})
    pieces = [text[a:b] for a, b in zip([0] + bounds, bounds + [len(text)])]
    assert stream_split(parser, "", pieces) == parser.split(text)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from jaxinfer.model.tokenizer import Tokenizer
    from server_harness import make_tiny_model_dir
    return Tokenizer.from_dir(make_tiny_model_dir(tmp_path_factory.mktemp("tok")))


@pytest.mark.parametrize("parser,prompt,text,reasoning,content", CASES)
def test_token_by_token_detokenized_stream(tokenizer, parser, prompt, text, reasoning, content):
    """The fixture's byte-level BPE has no marker tokens: every marker spans several tokens."""
    from jaxinfer.model.tokenizer import IncrementalDetokenizer
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > 3 and tokenizer.decode(ids) == text
    detok = IncrementalDetokenizer(tokenizer)
    assert stream_split(parser, prompt, [detok.add(t) for t in ids]) == (reasoning, content)


def test_tool_calls_parse_from_the_answer_after_reasoning():
    text = ('<think>I could call <tool_call>{"name": "nope"}</tool_call> here.</think>\n'
            '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>')
    reasoning, content = Qwen3Parser().split(text)
    assert "nope" in reasoning
    _, calls = HermesParser().parse(content)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_time", {"zone": "UTC"})]
    s, tools = ReasoningRequest(Qwen3Parser(), "").stream(), HermesParser().stream()
    streamed_calls = []
    for i in range(0, len(text), 3):
        _, c = s.feed(text[i:i + 3], i + 3 >= len(text))
        streamed_calls += tools.feed(c)[1]
    streamed_calls += tools.finish()[1]
    assert [d["function"]["name"] for d in streamed_calls] == ["get_time"]


def test_enable_thinking_reaches_the_template(tokenizer):
    from serve.protocol import render_chat
    tok = tokenizer
    tok.chat_template = (Path(__file__).parent / "fixtures" / "chat_templates" / "qwen3.jinja").read_text()
    body = {"messages": [{"role": "user", "content": "2+2?"}]}
    thinking = render_chat(tok, body, 4096)
    off = render_chat(tok, {**body, "chat_template_kwargs": {"enable_thinking": False}}, 4096)
    assert off == thinking + "<think>\n\n</think>\n\n"
    assert Qwen3Parser().split("4", off) == (None, "4")


# ---- through the server ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def reasoning_client(server):
    import openai
    url = add_app(server, "reasoning", reasoning_parser="deepseek_r1")
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


CHAT = dict(model=MODEL, messages=[{"role": "user", "content": "Hello world"}], max_tokens=8,
            temperature=0, extra_body=NO_EOS)


@pytest.fixture(scope="module")
def free_reply(reasoning_client):
    return reasoning_client.chat.completions.create(**CHAT).choices[0].message


def test_server_reasoning_apart_from_content_streamed_equals_whole(reasoning_client, free_reply):
    """Random weights never close the think block: deepseek_r1 calls all of it reasoning."""
    whole = free_reply
    reasoning = whole.model_extra["reasoning_content"]
    assert reasoning and whole.model_extra["reasoning"] == reasoning and whole.content is None
    chunks = list(reasoning_client.chat.completions.create(**CHAT, stream=True))
    deltas = [c.choices[0].delta.model_extra for c in chunks if c.choices]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == reasoning
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_server_include_reasoning_false_drops_it(reasoning_client):
    msg = reasoning_client.chat.completions.create(
        **{**CHAT, "extra_body": {**NO_EOS, "include_reasoning": False}}).choices[0].message
    assert msg.model_extra["reasoning_content"] is None and msg.content is None
    chunks = reasoning_client.chat.completions.create(
        **{**CHAT, "extra_body": {**NO_EOS, "include_reasoning": False}}, stream=True)
    assert not any((c.choices[0].delta.model_extra or {}).get("reasoning_content") for c in chunks
                   if c.choices)


def test_without_a_parser_reasoning_content_is_null(client):
    """As vLLM: the whole message always carries its reasoning fields (null without a parser), so
    the README's `message.reasoning_content` reads None instead of raising AttributeError; stream
    deltas leave them out (vLLM's chunks are dumped with exclude_unset)."""
    msg = client.chat.completions.create(**CHAT).choices[0].message
    assert msg.reasoning_content is None and msg.reasoning is None and msg.content
    chunks = list(client.chat.completions.create(**CHAT, stream=True))
    deltas = [c.choices[0].delta.model_extra or {} for c in chunks if c.choices]
    assert deltas and not any("reasoning_content" in d or "reasoning" in d for d in deltas)


def test_server_reasoning_fields_are_checked(server, reasoning_client):
    body = {"model": MODEL, "messages": CHAT["messages"], "max_tokens": 2, "include_reasoning": "no"}
    status, _, raw = post_raw(server.urls["reasoning"], "/v1/chat/completions", json.dumps(body).encode())
    assert status == 400
    check_error_shape(raw, 400, "include_reasoning")


SCHEMA = {"type": "object", "additionalProperties": False, "required": ["pick"],
          "properties": {"pick": {"enum": ["fox", "dog"]}}}
FORMAT = {"type": "json_schema", "json_schema": {"name": "pick", "schema": SCHEMA}}


def test_structured_output_constrains_the_answer_not_the_reasoning(reasoning_client, free_reply):
    """deepseek_r1 thinks from the first token and random weights never close the think block: with
    a schema the thinking is the same free text as without one (the grammar waits for `</think>`),
    streamed = non-streamed, chat and Responses alike. (That the grammar starts after the marker:
    tests/test_structured_output.py, on the engine.)"""
    free = free_reply.model_extra["reasoning_content"]
    msg = reasoning_client.chat.completions.create(**CHAT, response_format=FORMAT).choices[0].message
    assert msg.model_extra["reasoning_content"] == free and msg.content is None
    chunks = list(reasoning_client.chat.completions.create(**CHAT, response_format=FORMAT, stream=True))
    assert "".join(c.choices[0].delta.model_extra.get("reasoning_content") or ""
                   for c in chunks if c.choices) == free
    fmt = {"format": {"type": "json_schema", "name": "pick", "schema": SCHEMA}}
    events = list(reasoning_client.responses.create(
        model=MODEL, input="Hello world", max_output_tokens=8, temperature=0, text=fmt,
        extra_body=NO_EOS, stream=True))
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == free
    done = events[-1].response
    assert [i.type for i in done.output] == ["reasoning", "message"] and done.output_text == ""
    assert done.output[0].content[0].text == free


def test_the_grammar_waits_for_each_parsers_end_marker(tokenizer):
    from jaxinfer.structured.params import StructuredOutputsParams
    from serve.reasoning.request import constrain_answer_only
    so = StructuredOutputsParams(json=SCHEMA)

    def end_text(parser, prompt: str) -> str | None:
        gated = constrain_answer_only(so, ReasoningRequest(parser, prompt), tokenizer)
        ids = gated.reasoning_end_token_ids
        return None if ids is None else tokenizer.decode(list(ids), skip_special_tokens=False)
    assert end_text(DeepSeekR1Parser(), "") == "</think>"
    assert end_text(Qwen3Parser(), "<|im_start|>assistant\n") == "</think>"
    assert end_text(Qwen3Parser(), "assistant\n<think>\n\n</think>\n\n") is None  # enable_thinking off
    assert end_text(GptOssParser(), "") == "<|channel|>final<|message|>"
    assert constrain_answer_only(so, None, tokenizer) is so
    assert constrain_answer_only(None, ReasoningRequest(Qwen3Parser(), ""), tokenizer) is None
