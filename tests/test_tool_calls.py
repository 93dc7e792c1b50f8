"""Tool calling: the hermes / llama3_json parsers and the forced-call parsers on canned model text,
whole and streamed in every chunking; tools / tool_choice validation; and, through the official
openai client on the demo model, forced calls (named, required) that the grammar makes valid and
`auto` calls in each parser's format (the model held to the format's text by a regex)."""

from __future__ import annotations

import json
import random

import pytest

from serve.errors import APIError
from serve.tool_parsers import HermesParser, Llama3JsonParser, NamedCallParser, RequiredCallsParser
from serve.tools import ToolOptions, tool_request

pytest.importorskip("llguidance")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "days"],
                   "properties": {"city": {"type": "string", "pattern": "^[A-Z][a-z]{1,8}$"},
                                  "days": {"type": "integer", "minimum": 1, "maximum": 7}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["zone"],
    "properties": {"zone": {"enum": ["UTC", "CET"]}}}}}

HERMES = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n'
          '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>')
LLAMA = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}; ' \
        '{"name": "get_time", "parameters": {"zone": "UTC"}}'
EXPECTED = [("get_weather", {"city": "Paris", "days": 2}), ("get_time", {"zone": "UTC"})]


def calls_of(calls) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


def streamed(parser, text: str, rng: random.Random) -> tuple[str, list[tuple[str, dict]]]:
    """Feed `text` in random pieces; reassemble content and calls from the deltas as a client does."""
    stream = parser.stream()
    content, calls = "", {}
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 12))))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    outs = [stream.feed(p) for p in pieces] + [stream.finish()]
    for c, deltas in outs:
        content += c
        for d in deltas:
            assert d["index"] in calls or "id" in d  # the first delta of a call carries its id
            entry = calls.setdefault(d["index"], {"name": "", "arguments": ""})
            entry["name"] += d["function"].get("name", "")
            entry["arguments"] += d["function"].get("arguments", "")
    return content, [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())]


@pytest.mark.parametrize("parser,text,content,expected", [
    (HermesParser(), HERMES, "Let me check.\n", EXPECTED),
    (HermesParser(), "no tools here", "no tools here", []),
    (HermesParser(), '<tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}', None,
     [("get_time", {"zone": "CET"})]),  # EOS before the closing tag
    (HermesParser(), "<tool_call>{not json}</tool_call>", "<tool_call>{not json}</tool_call>", []),
    (HermesParser(), "a < b <tool_c", "a < b <tool_c", []),
    (Llama3JsonParser(), LLAMA, None, EXPECTED),
    (Llama3JsonParser(), '{"name": "get_time", "parameters": {"zone": "UTC"}}', None, EXPECTED[1:]),
    (Llama3JsonParser(), "The weather is fine.", "The weather is fine.", []),
    (Llama3JsonParser(), '{"city": "Paris"}', '{"city": "Paris"}', []),
    (RequiredCallsParser(), json.dumps([{"name": n, "parameters": a} for n, a in EXPECTED]), None, EXPECTED),
    (RequiredCallsParser(), '[{"name": "get_time", "param', '[{"name": "get_time", "param', []),
    (NamedCallParser("get_weather"), '{"city": "Paris", "days": 2}', None, EXPECTED[:1]),
])
def test_parsers_on_canned_text_whole_and_streamed(parser, text, content, expected):
    got_content, calls = parser.parse(text)
    assert got_content == content and calls_of(calls) == expected
    for seed in range(20):
        s_content, s_calls = streamed(parser, text, random.Random(seed))
        assert s_calls == expected
        if expected:  # streamed content is what precedes the calls
            assert s_content == (content or "")
        else:
            assert s_content == text


@pytest.mark.parametrize("body,message", [
    ({"tools": [WEATHER]}, "--enable-auto-tool-choice"),  # auto is the default with tools
    ({"tools": "get_weather", "tool_choice": "none"}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}], "tool_choice": "none"}, "name"),
    ({"tools": [{"type": "retrieval"}], "tool_choice": "none"}, "tools"),
    ({"tool_choice": "required"}, "needs tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not among"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
])
def test_bad_tools_and_choices_are_refused_naming_the_field(body, message):
    with pytest.raises(APIError, match=message) as e:
        tool_request(body, ToolOptions())
    assert e.value.status == 400 and e.value.param in ("tools", "tool_choice")


def test_server_flags_need_each_other():
    from serve.tools import check_tool_args
    from server_harness import server_args
    with pytest.raises(ValueError, match="--tool-call-parser"):
        check_tool_args(server_args(enable_auto_tool_choice=True))


# ---- through the official client, on the demo model ----------------------------------------------

def client_for(demo_server, app: str):
    import openai
    return openai.OpenAI(base_url=demo_server.urls[app] + "/v1", api_key="unused", max_retries=0,
                         timeout=120)


MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


def validate_args(call, tool) -> dict:
    import jsonschema
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, tool["function"]["parameters"])
    return args


def stream_calls(stream) -> tuple[str, dict, str]:
    content, calls, finish = "", {}, None
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for d in delta.tool_calls or []:
            entry = calls.setdefault(d.index, {"name": "", "arguments": ""})
            entry["name"] += (d.function.name or "") if d.function else ""
            entry["arguments"] += (d.function.arguments or "") if d.function else ""
        finish = chunk.choices[0].finish_reason or finish
    return content, calls, finish


def test_forced_named_and_required_calls_on_the_demo_model(demo_server):
    client = client_for(demo_server, "main")
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(model="demo-target", messages=MESSAGES, tools=[WEATHER, TIME],
                                       tool_choice=named, max_tokens=32, temperature=0.8, seed=2)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "stop" and msg.content is None
    assert [c.function.name for c in msg.tool_calls] == ["get_weather"]
    validate_args(msg.tool_calls[0], WEATHER)
    content, calls, finish = stream_calls(client.chat.completions.create(
        model="demo-target", messages=MESSAGES, tools=[WEATHER, TIME], tool_choice=named, max_tokens=32,
        temperature=0.8, seed=2, stream=True))
    assert content == "" and finish == "stop"
    assert calls == {0: {"name": "get_weather", "arguments": msg.tool_calls[0].function.arguments}}
    r = client.chat.completions.create(model="demo-target", messages=MESSAGES, tools=[WEATHER, TIME],
                                       tool_choice="required", max_tokens=64, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for call in choice.message.tool_calls:
        validate_args(call, {"get_weather": WEATHER, "get_time": TIME}[call.function.name])


@pytest.mark.parametrize("app,canned", [
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}</tool_call>'),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}'),
])
def test_auto_calls_in_each_parsers_format(demo_server, app, canned):
    """tool_choice auto: the model's own text in the parser's format (held to it by a regex here,
    as the demo model never learned the format) comes back as tool_calls, whole and streamed."""
    import re
    client = client_for(demo_server, app)
    extra = {"guided_regex": re.escape(canned)}
    r = client.chat.completions.create(model="demo-target", messages=MESSAGES, tools=[WEATHER, TIME],
                                       max_tokens=64, temperature=0, extra_body=extra)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert [(c.function.name, validate_args(c, WEATHER)) for c in choice.message.tool_calls] == [
        ("get_weather", {"city": "Paris", "days": 2})]
    content, calls, finish = stream_calls(client.chat.completions.create(
        model="demo-target", messages=MESSAGES, tools=[WEATHER], max_tokens=64, temperature=0,
        stream=True, extra_body=extra))
    assert content == "" and finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        ("get_weather", {"city": "Paris", "days": 2})]
    # without a call in the text, the reply is plain content
    r = client.chat.completions.create(model="demo-target", messages=MESSAGES, tools=[WEATHER], max_tokens=8,
                                       temperature=0, extra_body={"guided_regex": "It is sunny"})
    assert r.choices[0].message.content == "It is sunny" and not r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "stop"
