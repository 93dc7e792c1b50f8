"""Chat templates render exactly as HF transformers' `apply_chat_template` does: goldens made by
tests/fixtures/chat_templates/make_goldens.py with transformers from the public templates of
Llama-3.1-Instruct, Qwen2.5-Instruct, Qwen3, Mistral-7B-Instruct-v0.3, Gemma 2 and 3 (turn format),
gpt-oss (harmony: channels, reasoning effort, builtin and function tools), the demo model's and a
template exercising the rest of the environment (documents, loop controls, tojson options,
namespace, generation blocks, reasoning fields); conversations with system prompts, several
turns, tools and template kwargs. A template that raises in transformers raises here too."""

from __future__ import annotations

import copy
import datetime
import json
from pathlib import Path

import pytest

from jaxinfer.errors import TokenizerError
from jaxinfer.model import chat_template
from jaxinfer.model.chat_template import render_chat_template
from jaxinfer.model.tokenizer import Tokenizer

HERE = Path(__file__).parent / "fixtures" / "chat_templates"
DEMO = Path(__file__).parents[1] / "checkpoints" / "demo-target"
GOLDENS = json.loads((HERE / "goldens.json").read_text())["cases"]


def _source(name: str) -> str:
    if name == "demo-target":
        return json.loads((DEMO / "tokenizer_config.json").read_text())["chat_template"]
    return (HERE / f"{name}.jinja").read_text()


@pytest.fixture
def goldens_day(monkeypatch):
    """`strftime_now` on the day the goldens were rendered (gpt-oss's template prints the date)."""
    today = datetime.date.fromisoformat(json.loads((HERE / "goldens.json").read_text())["today"])
    monkeypatch.setattr(chat_template, "_strftime_now", today.strftime)


@pytest.mark.parametrize("case", GOLDENS, ids=lambda c: f"{c['template']}-{c['case']}")
def test_renders_like_transformers(case, goldens_day):
    inputs = copy.deepcopy(case["inputs"])
    messages = inputs.pop("messages")
    expected = case["expected"]
    if isinstance(expected, dict):
        with pytest.raises(TokenizerError, match="chat template"):
            render_chat_template(_source(case["template"]), messages, case["special_tokens"],
                                 **inputs)
        return
    got = render_chat_template(_source(case["template"]), messages, case["special_tokens"], **inputs)
    assert got == expected
    assert messages == case["inputs"]["messages"]  # the caller's messages are left untouched


def test_tokenizer_passes_its_special_tokens_and_kwargs():
    tok = Tokenizer.from_dir(DEMO)
    for case in (c for c in GOLDENS if c["template"] == "demo-target"
                 and isinstance(c["expected"], str)):
        inputs = copy.deepcopy(case["inputs"])
        assert tok.apply_chat_template(inputs.pop("messages"), **inputs) == case["expected"]


def test_named_templates_pick_tool_use_when_tools_are_given():
    tok = Tokenizer.from_dir(DEMO)
    tok.chat_template = {"default": "plain", "tool_use": "{{ tools | length }} tools"}
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "plain"
    assert tok.apply_chat_template([{"role": "user", "content": "x"}], tools=[{"a": 1}]) == "1 tools"


def test_any_kwarg_name_is_a_template_variable_or_a_clean_error():
    tok = Tokenizer.from_dir(DEMO)
    tok.chat_template = "{{ special_tokens }}/{{ source }}/{{ eos_token }}"
    kwargs = {"special_tokens": 1, "source": 2, "eos_token": "E"}
    assert tok.apply_chat_template([], **kwargs) == "1/2/E"  # kwargs override special tokens
    with pytest.raises(TokenizerError, match="set from the request"):
        tok.apply_chat_template([], **{"messages": []})


def test_namespace_refuses_underscore_attributes():
    with pytest.raises(TokenizerError, match="underscore"):
        render_chat_template("{% set ns = namespace(_x=1) %}", [])
