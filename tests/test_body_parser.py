"""serve/json_body.BodyParser: a large body is parsed in the helper process, its refusals come
back as the same 400s, and a helper that died is replaced without losing the body."""

from __future__ import annotations

import asyncio
import json

import pytest

from serve.errors import APIError
from serve.json_body import LARGE_BODY_BYTES, BodyParser

TEXT = "the quick brown fox " * (LARGE_BODY_BYTES // 10)  # 2 MB of prompt


def parse(parser: BodyParser, raw: bytes):
    return asyncio.run(parser.parse(raw))


def test_large_bodies_go_to_the_helper_and_refusals_come_back():
    parser = BodyParser(max_items=1000)
    try:
        assert parse(parser, b'{"prompt": "hi"}') == {"prompt": "hi"} and parser.helper_parses == 0
        body = json.dumps({"prompt": TEXT, "max_tokens": 3}).encode()
        assert parse(parser, body) == {"prompt": TEXT, "max_tokens": 3}
        assert parser.helper_parses == 1
        for raw, message in ((b"{" + b" " * LARGE_BODY_BYTES, "not valid JSON"),
                             (b"[" + b"1," * LARGE_BODY_BYTES + b"1]", "JSON values")):
            with pytest.raises(APIError) as e:
                parse(parser, raw)
            assert e.value.status == 400 and message in e.value.message
        assert parser.helper_parses == 3
    finally:
        parser.close()


def test_a_dead_helper_is_replaced_and_the_body_still_parsed():
    parser = BodyParser(max_items=1000)
    body = json.dumps({"prompt": TEXT}).encode()
    try:
        assert parse(parser, body)["prompt"] == TEXT
        proc = parser._helper[0]
        proc.kill()
        proc.join(5)
        assert parse(parser, body)["prompt"] == TEXT  # parsed here, the helper gone
        assert parser.helper_parses == 1 and parser._helper is None
        assert parse(parser, body)["prompt"] == TEXT and parser.helper_parses == 2  # a new one
    finally:
        parser.close()
    assert parser._helper is None
