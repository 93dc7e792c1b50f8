"""LoRA over HTTP: --enable-lora --lora-modules; /v1/models lists the adapters with their parent;
a request's `model` picks its adapter; /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's
shapes) and every refusal: a 400 naming the field, nothing changed."""

from __future__ import annotations


import openai
import pytest

from server_harness import (MODEL, check_error_shape,
                            post_raw, raw_json)


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _complete(client, model: str) -> str:
    out = client.completions.create(model=model, prompt="Once upon a time", max_tokens=6,
                                    temperature=0, extra_body={"ignore_eos": True})
    return out.choices[0].text


def _models(client) -> dict:
    return {m.id: m for m in client.models.list().data}


def test_adapters_are_models_and_pick_their_weights(lora_server):
    client = _client(lora_server.urls["main"])
    models = _models(client)
    assert models["sql"].parent == MODEL and models[MODEL].parent is None
    base, sql = _complete(client, MODEL), _complete(client, "sql")
    assert sql != base
    url = lora_server.urls["main"]
    status, _, body = post_raw(url, "/v1/load_lora_adapter", raw_json(
        {"lora_name": "sql2", "lora_path": str(lora_server.paths["sql"])}))
    assert (status, body) == (200, b"Success: LoRA adapter 'sql2' added successfully.")
    assert _models(client)["sql2"].parent == MODEL
    assert _complete(client, "sql2") == sql and _complete(client, MODEL) == base
    status, _, body = post_raw(url, "/v1/unload_lora_adapter", raw_json({"lora_name": "sql2"}))
    assert (status, body) == (200, b"Success: LoRA adapter 'sql2' removed successfully.")
    with pytest.raises(openai.NotFoundError):
        _complete(client, "sql2")


@pytest.mark.parametrize("body, status, param", [
    ({"lora_name": "x", "lora_path": "/does/not/exist"}, 400, "lora_path"),
    ({"lora_name": "x", "lora_path": "big"}, 400, "r"),
    ({"lora_name": "x", "lora_path": "wrong"}, 400, "r"),
    ({"lora_name": "x", "lora_path": "embed"}, 400, "target_modules"),
    ({"lora_name": "x", "lora_path": "saves"}, 400, "modules_to_save"),
    ({"lora_name": "sql", "lora_path": "sql"}, 400, "lora_name"),
    ({"lora_name": MODEL, "lora_path": "sql"}, 400, "lora_name"),
    ({"lora_path": "sql"}, 400, "lora_name"),
    ({"lora_name": "x"}, 400, "lora_path"),
])
def test_bad_loads_are_refused_by_field_and_change_nothing(lora_server, body, status, param):
    client = _client(lora_server.urls["main"])
    before = sorted(_models(client))
    if body.get("lora_path") in lora_server.paths:
        body = {**body, "lora_path": str(lora_server.paths[body["lora_path"]])}
    got, _, raw = post_raw(lora_server.urls["main"], "/v1/load_lora_adapter", raw_json(body))
    assert got == status, raw
    check_error_shape(raw, status, param)
    assert sorted(_models(client)) == before


def test_unload_refusals_and_the_flag(lora_server):
    url = lora_server.urls["main"]
    status, _, raw = post_raw(url, "/v1/unload_lora_adapter", raw_json({"lora_name": "nope"}))
    check_error_shape(raw, 404, "lora_name")
    status, _, raw = post_raw(url, "/v1/unload_lora_adapter",
                              raw_json({"lora_name": "sql", "lora_int_id": 99}))
    check_error_shape(raw, 400, "lora_int_id")
    locked = lora_server.urls["locked"]
    for path, body in (("/v1/load_lora_adapter", {"lora_name": "y", "lora_path": "sql"}),
                       ("/v1/unload_lora_adapter", {"lora_name": "sql"})):
        status, _, raw = post_raw(locked, path, raw_json(body))
        assert status == 400 and b"--allow-runtime-lora-updating" in raw
    assert "sql" in _models(_client(url))


def test_responses_name_the_adapter_they_ran(lora_server):
    """`model` of a response is the adapter's name when the request picked one (vLLM's), the base
    model's otherwise: completions, chat, their streams, and /v1/responses."""
    client = _client(lora_server.urls["main"])
    kw = dict(model="sql", max_tokens=1, temperature=0)
    msgs = [{"role": "user", "content": "Hi"}]
    assert client.completions.create(prompt="Hi", **kw).model == "sql"
    assert {c.model for c in client.completions.create(prompt="Hi", stream=True, **kw)} == {"sql"}
    assert client.chat.completions.create(messages=msgs, **kw).model == "sql"
    chunks = client.chat.completions.create(messages=msgs, stream=True, **kw)
    assert {c.model for c in chunks} == {"sql"}
    assert client.responses.create(model="sql", input="Hi", max_output_tokens=1).model == "sql"
    assert client.chat.completions.create(messages=msgs, **{**kw, "model": MODEL}).model == MODEL
