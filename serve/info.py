"""Probes and descriptions: GET /health, /ping, /version, /v1/models; POST /tokenize, /detokenize."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from aiohttp import web

from serve.app_keys import CREATED, ENGINE
from serve.engine_requests import engine_unavailable
from serve.errors import APIError, bad_request, error_response
from serve.json_body import off_loop
from serve.limits import check_strings, check_text_length
from serve.protocol import (TOKENIZE_FIELDS, bool_field, check_model, check_token_ids,
                            read_json_body, render_chat)
from serve.request_fields import log_unknown_fields


def package_version() -> str:
    try:
        return version("jaxinfer")
    except PackageNotFoundError:  # running from a source tree that was never installed
        return "unknown"


async def health(request: web.Request) -> web.Response:
    """200 once the engine loop runs and is warmed up; 503 while it starts or after it died."""
    if (error := engine_unavailable(request.app)) is not None:
        return error_response(error.status, error.message, headers=error.headers)
    return web.Response(status=200)


async def get_version(request: web.Request) -> web.Response:
    return web.json_response({"version": package_version()})


async def list_models(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    cards = [{"id": name, "object": "model", "created": request.app[CREATED],
              "owned_by": "jaxinfer", "root": engine.model_name, "parent": None,
              "max_model_len": engine.max_model_len, "permission": []}
             for name in engine.served_model_names]
    cards += [{"id": name, "object": "model", "created": request.app[CREATED],
               "owned_by": "jaxinfer", "root": lora.lora_path, "parent": engine.model_name,
               "max_model_len": engine.max_model_len, "permission": []}
              for name, lora in engine.lora_requests.items()]
    return web.json_response({"object": "list", "data": cards})


async def tokenize(request: web.Request) -> web.Response:
    """vLLM's /tokenize: a `prompt`, or chat `messages` rendered with the chat template."""
    engine = request.app[ENGINE]
    body = await read_json_body(request)
    ids = await off_loop(_tokenize, engine, body)
    tok = engine.tokenizer
    result = {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids, "token_strs": None}
    if bool_field(body, "return_token_strs", False):
        result["token_strs"] = [tok.id_to_token(t) for t in ids]
    return web.json_response(result)


def _tokenize(engine, body: dict) -> list[int]:
    """Runs in a worker thread. Texts too long for the context are refused before tokenizing, as
    for generation requests."""
    check_strings(body, engine.tokenizer, engine.max_model_len)
    log_unknown_fields(body, TOKENIZE_FIELDS, "/tokenize")
    check_model(body, engine.model_names)
    tok = engine.tokenizer
    if "messages" in body:
        text = render_chat(tok, body, engine.max_model_len)
        # The template already holds the special tokens, as for chat requests.
        return tok.encode(text, add_special_tokens=bool_field(body, "add_special_tokens", False))
    if isinstance(body.get("prompt"), str):
        check_text_length(len(body["prompt"]), tok, engine.max_model_len, "prompt")
        return tok.encode(body["prompt"], add_special_tokens=bool_field(body, "add_special_tokens", True))
    raise bad_request("tokenize needs a string 'prompt' or a list of chat 'messages'", "prompt")


def _detokenize(engine, body: dict) -> str:
    """Runs in a worker thread."""
    check_strings(body, engine.tokenizer, engine.max_model_len)
    log_unknown_fields(body, frozenset({"model", "tokens"}), "/detokenize")
    check_model(body, engine.model_names)
    ids = body.get("tokens")
    if not isinstance(ids, list):
        raise APIError(400, "detokenize needs 'tokens': a list of token ids", "tokens")
    check_token_ids(ids, engine.model_config.vocab_size, "tokens", engine.max_model_len)
    return engine.tokenizer.decode(ids)


async def detokenize(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    body = await read_json_body(request)
    return web.json_response({"prompt": await off_loop(_detokenize, engine, body)})
