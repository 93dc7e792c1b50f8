"""/v1/responses through the official openai client's `client.responses` on the shared server:
plain, streamed (the documented event sequence, numbered, the same items as the whole answer,
ending in response.incomplete when max_output_tokens cut it), text.format json_schema, function
tools, previous_response_id over the store (and its 404), GET and DELETE; field errors name the
Responses field, lone surrogates anywhere in the body too (streamed: before the first byte); the
store's LRU bounds, entries and bytes, and the request keys it does not keep."""

from __future__ import annotations

import json
import sys

import openai
import pytest

from serve.errors import APIError
from serve.responses.store import RESPONSE_STORE, ResponseStore, StoredResponse, footprint
from server_harness import MODEL, NO_EOS, add_app, check_error_shape, post_raw

pytest.importorskip("llguidance")

BASE = dict(model=MODEL, temperature=0, max_output_tokens=6, extra_body=NO_EOS)
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["pick"],
          "properties": {"pick": {"enum": ["fox", "dog"]}}}
TOOL = {"type": "function", "name": "pick_animal", "description": "Pick one",
        "parameters": SCHEMA, "strict": True}


def test_plain_and_streamed_agree(client):
    whole = client.responses.create(input="Hello world", instructions="Be brief.", **BASE)
    assert whole.object == "response" and whole.status == "incomplete"  # ran out of max_output_tokens
    assert whole.incomplete_details.reason == "max_output_tokens"
    assert [item.type for item in whole.output] == ["message"] and whole.output_text
    assert whole.usage.output_tokens == 6 and whole.usage.input_tokens > 0
    assert whole.instructions == "Be brief." and whole.max_output_tokens == 6
    events = list(client.responses.create(input="Hello world", instructions="Be brief.", stream=True,
                                          **BASE))
    kinds = [e.type for e in events]
    # OpenAI's last event names how it ended: an answer cut short by max_output_tokens is
    # response.incomplete, never a response.completed with status "incomplete".
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.incomplete"
    assert "response.completed" not in kinds and events[-1].response.status == "incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done",
                            "response.output_item.done"]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text
    done = [e for e in events if e.type == "response.output_text.done"]
    assert len(done) == 1 and done[0].text == text


def test_json_schema_output(client):
    r = client.responses.create(input="Pick an animal", text={"format": {
        "type": "json_schema", "name": "pick", "schema": SCHEMA, "strict": True}},
        **{**BASE, "max_output_tokens": 40})
    assert json.loads(r.output_text)["pick"] in ("fox", "dog")


def test_function_call_round_trip_with_previous_response_id(client):
    first = client.responses.create(input="Pick an animal", tools=[TOOL],
                                    tool_choice={"type": "function", "name": "pick_animal"},
                                    **{**BASE, "max_output_tokens": 40})
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "pick_animal"
    assert json.loads(calls[0].arguments)["pick"] in ("fox", "dog")
    second = client.responses.create(previous_response_id=first.id, input=[
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "a fine choice"}], **BASE)
    assert second.previous_response_id == first.id and second.output_text
    # The second turn's prompt holds the first turn: more input tokens than the new item alone.
    assert second.usage.input_tokens > first.usage.input_tokens
    assert client.responses.retrieve(second.id).output_text == second.output_text
    client.responses.delete(second.id)
    with pytest.raises(openai.NotFoundError, match=second.id):
        client.responses.retrieve(second.id)
    with pytest.raises(openai.NotFoundError, match="resp_missing"):
        client.responses.create(previous_response_id="resp_missing", input="Hi", **BASE)


@pytest.mark.parametrize("body,param", [
    ({"input": 3}, "input"), ({"input": []}, "input"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input"),
    ({"input": [{"type": "input_image"}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
    ({"input": "x", "max_output_tokens": -1}, "max_output_tokens"),
    ({"input": "x", "max_output_tokens": 10**6}, "max_output_tokens"),
    ({"input": "x", "text": {"format": {"type": "xml"}}}, "text"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "schema": 3}}}, "text"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": "x", "tool_choice": 5, "tools": [TOOL]}, "tool_choice"),
    ({"input": "x", "reasoning": {"effort": "huge"}}, "reasoning"),
    ({"input": "x", "temperature": "hot"}, "temperature"),
    ({"input": "x", "instructions": 7}, "instructions"),
    ({"input": "x", "metadata": {"k": 1}}, "metadata"),
    ({"input": "x", "store": "yes"}, "store"),
    ({"input": "x", "background": True}, "background"),
    ({"input": "x", "previous_response_id": 7}, "previous_response_id"),
])
def test_bad_fields_are_400s_naming_them(server, body, param):
    raw_body = json.dumps({"model": MODEL, **body}).encode()
    status, _, raw = post_raw(server.urls["main"], "/v1/responses", raw_body)
    assert status == 400, raw
    check_error_shape(raw, 400, param)


def test_store_is_a_bounded_lru():
    store = ResponseStore(2)
    for i in range(3):
        store.put(StoredResponse({"id": f"r{i}"}, []), 1)
        if i == 1:
            store.get("r0")  # r0 used: r1 is now the least recently used
    assert len(store) == 2 and store.get("r0") and store.get("r2")
    with pytest.raises(Exception, match="r1"):
        store.get("r1")
    assert not ResponseStore(0).put(StoredResponse({"id": "x"}, []), 1)


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("extra,param", [
    ({"metadata": {"k": "a\ud800"}}, "metadata"),
    ({"text": {"format": {"type": "text"}, "unused": "\udc00"}}, "text"),
    ({"reasoning": {"effort": None, "unused": ["\ud83d"]}}, "reasoning"),
    ({"tools": [{"type": "function", "name": "f", "unused": "\ud800"}]}, "tools"),
    ({"unknown_field": "\ud800"}, "unknown_field"),
])
def test_lone_surrogates_are_400s_before_the_stream_starts(server, stream, extra, param):
    """Strings the response echoes (metadata) or the request merely carries: a lone surrogate cannot
    be encoded as UTF-8, so found while the stream is written it was a 200 with an in-band 500."""
    body = {"model": MODEL, "input": "Hello", "max_output_tokens": 2, "stream": stream, **extra}
    status, headers, raw = post_raw(server.urls["main"], "/v1/responses", json.dumps(body).encode())
    assert status == 400 and headers["Content-Type"].startswith("application/json"), raw
    check_error_shape(raw, 400, param)


def test_store_bounds_its_bytes():
    def entry(i: int, chars: int) -> StoredResponse:
        return StoredResponse({"id": f"r{i}", "output": ["x" * chars]}, [{"role": "user", "content": "hi"}])

    def put(store: ResponseStore, e: StoredResponse) -> bool:
        return store.put(e, e.footprint())
    size = entry(0, 1000).footprint()
    assert size > 1000 + sys.getsizeof({})  # every byte of the text counts, and the objects around it
    assert footprint(["x" * 1000] * 3) == footprint(["x" * 1000]) + 2 * 8  # a shared string counts once
    store = ResponseStore(100, max_bytes=3 * size + 10)
    for i in range(9):
        assert put(store, entry(i, 1000))
        assert store.nbytes == min(i + 1, 3) * size <= store.max_bytes
    assert len(store) == 3 and [store.get(f"r{i}").response["id"] for i in (6, 7, 8)]  # the newest
    with pytest.raises(APIError, match="r5"):
        store.get("r5")
    assert not put(store, entry(9, 4 * size))  # larger than the whole bound: not kept...
    assert len(store) == 3 and store.nbytes == 3 * size  # ...and nothing forgotten for it
    with pytest.raises(APIError) as e:
        store.get("r9", "previous_response_id")
    assert e.value.status == 404 and e.value.param == "previous_response_id"
    store.delete("r7")
    assert store.nbytes == 2 * size
    assert not put(ResponseStore(10, max_bytes=0), entry(0, 0))


def _store_of(server, url: str) -> ResponseStore:
    return next(s.app[RESPONSE_STORE] for s in server._servers if url.endswith(f":{s.port}"))


def test_store_bytes_over_the_server_and_unused_keys_not_kept(server):
    """--responses-store-mib bounds what the store holds (the oldest go first, a response larger
    than the bound is a 404 afterwards); request keys nothing reads are neither echoed nor kept."""
    url = add_app(server, "small-store", responses_store_mib=0.03)
    store = _store_of(server, url)
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
    junk = "j" * 2000  # (a string longer than any prompt that fits the context is a 400)
    ids = []
    for i in range(6):
        r = client.responses.create(
            input=f"Hello {i}", text={"format": {"type": "text"}, "verbosity_junk": junk},
            reasoning={"effort": "low", "junk": junk}, tools=[{**TOOL, "junk": junk}], tool_choice="none",
            **{**BASE, "max_output_tokens": 2, "extra_body": {**NO_EOS, "junk": junk}})
        ids.append(r.id)
        assert junk not in r.model_dump_json()
        assert r.text.format.type == "text" and r.reasoning.effort == "low"
        assert r.tools[0].name == "pick_animal" and r.tools[0].parameters == SCHEMA
        assert server.call(_accounted(store, ids)) <= store.max_bytes
    kept = [i for i in ids if server.call(_accounted(store, [i]))]
    assert 1 < len(kept) < 6 and kept == ids[-len(kept):]  # the oldest forgotten for room
    assert server.call(_accounted(store, ids)) == store.nbytes
    with pytest.raises(openai.NotFoundError, match=ids[0]):
        client.responses.retrieve(ids[0])
    stored = client.responses.retrieve(ids[-1])
    assert junk not in stored.model_dump_json() and stored.output_text == r.output_text
    tools = [{**TOOL, "name": f"pick_{i}", "description": "d" * 2000} for i in range(16)]  # echoed
    big = client.responses.create(input="Hello", tools=tools, tool_choice="none",
                                  **{**BASE, "max_output_tokens": 2})
    with pytest.raises(openai.NotFoundError, match=big.id):
        client.responses.retrieve(big.id)
    with pytest.raises(openai.NotFoundError, match=big.id):
        client.responses.create(previous_response_id=big.id, input="And?", **BASE)
    assert client.responses.retrieve(ids[-1]).id == ids[-1]  # not forgotten for it


async def _accounted(store: ResponseStore, ids: list[str]) -> int:
    """The footprints of the kept responses among `ids`, read on the loop that owns the store."""
    total = 0
    for response_id in ids:
        try:
            entry = store.get(response_id)
        except APIError:
            continue
        total += entry.footprint()
    return total
