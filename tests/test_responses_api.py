"""/v1/responses through the official openai client's `client.responses` on the shared server:
plain, streamed (the documented event sequence, numbered, the same items as the whole answer),
text.format json_schema, function tools, previous_response_id over the store (and its 404),
GET and DELETE; field errors name the Responses field; the store's LRU bound."""

from __future__ import annotations

import json

import openai
import pytest

from serve.responses.store import ResponseStore, StoredResponse
from server_harness import MODEL, NO_EOS, check_error_shape, post_raw

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
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
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
        store.put(StoredResponse({"id": f"r{i}"}, []))
        if i == 1:
            store.get("r0")  # r0 used: r1 is now the least recently used
    assert len(store) == 2 and store.get("r0") and store.get("r2")
    with pytest.raises(Exception, match="r1"):
        store.get("r1")
    ResponseStore(0).put(StoredResponse({"id": "x"}, []))
