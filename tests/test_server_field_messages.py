"""What a refused or logged field says (issue 38): `max_completion_tokens: 0` names that field,
/v1/completions takes `max_tokens: 0` only with `echo` and says so, an unknown model is quoted
once, unknown fields are logged as JSON names. Parsed by serve/protocol.py directly, over the demo
model's tokenizer (no engine)."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

import pytest

from jaxinfer.model.tokenizer import load_tokenizer
from serve.errors import APIError
from serve.limits import RequestLimits
from serve.protocol import parse_generation

DEMO = Path(__file__).resolve().parent.parent / "checkpoints" / "demo-target"
ENGINE = SimpleNamespace(tokenizer=load_tokenizer(DEMO), max_model_len=1024,
                         served_model_names=["demo"], model_names=["demo"], lora_requests={},
                         model_config=SimpleNamespace(vocab_size=4096), grammars=None)
CHAT = [{"role": "user", "content": "hi"}]


def refusal(body: dict, chat: bool) -> APIError:
    with pytest.raises(APIError) as e:
        parse_generation(body, ENGINE, RequestLimits(), chat=chat)
    return e.value


@pytest.mark.parametrize("field", ["max_completion_tokens", "max_tokens"])
def test_a_zero_chat_limit_names_the_field_sent(field):
    e = refusal({"messages": CHAT, field: 0}, chat=True)
    assert e.status == 400 and e.param == field and field in e.message


def test_completions_take_zero_tokens_only_with_echo():
    e = refusal({"prompt": "x", "max_tokens": 0}, chat=False)
    assert e.param == "max_tokens" and "0 with echo" in e.message
    req = parse_generation({"prompt": "x", "max_tokens": 0, "echo": True}, ENGINE, RequestLimits(),
                           chat=False)
    assert req.generate_nothing


def test_unknown_model_quoted_once_and_unknown_fields_logged_as_json(caplog):
    assert "The model `nope` does not exist." in refusal({"model": "nope", "prompt": "x"},
                                                          chat=False).message
    with caplog.at_level(logging.WARNING, logger="serve"):
        parse_generation({"prompt": "x", "max_tokens": 1, "promtp": 1}, ENGINE, RequestLimits(),
                         chat=False)
    assert '["promtp"]' in caplog.text
