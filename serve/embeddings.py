"""POST /v1/embeddings (OpenAI's and vLLM's wire format) for pooling models.

`--task embed` serves it (`auto`, the default: when the model directory holds a sentence-transformers
pooling configuration; `generate`: never). Each input is one engine request that only prefills
(SamplingParams.pooling): it is scheduled and batched with every other request, its final hidden
states are pooled on the device (jaxinfer/worker/hidden_reads.py), and its KV blocks go back when
its prefill ends. The pooling method and normalization are the model's (jaxinfer/engine/pooling.py);
`dimensions` truncates Matryoshka models only; `encoding_format` is float or base64 (float32
little-endian bytes, which the openai client decodes)."""

from __future__ import annotations

import argparse
import base64
import dataclasses

import numpy as np
from aiohttp import web

from jaxinfer.engine.pooling import (PoolingConfig, check_dimensions, check_embedding_engine,
                                     finish_embedding, pooling_config)
from jaxinfer.errors import InvalidRequestError
from jaxinfer.sampling_params import SamplingParams, short_repr
from serve.app_keys import ENGINE
from serve.choices import new_response_id
from serve.engine_requests import RequestGroup, check_capacity
from serve.errors import APIError, bad_request
from serve.json_body import off_loop
from serve.limits import LIMITS, RequestLimits, check_sequence_count, check_strings, check_text_length
from serve.protocol import bool_field, check_model, check_token_ids, parse_prompts, read_json_body
from serve.request_fields import log_unknown_fields

TASKS = ("auto", "generate", "embed")
KNOWN_FIELDS = frozenset({"model", "input", "encoding_format", "dimensions", "user",
                          "add_special_tokens", "priority"})
EMBEDDINGS: web.AppKey[PoolingConfig | None] = web.AppKey("embeddings")


def add_embedding_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--task", choices=TASKS, default="auto",
                   help="embed: serve /v1/embeddings (the model's pooling, from its sentence-transformers "
                        "config, else last-token, normalized); auto: embed when the model directory has "
                        "that config (default: %(default)s)")


def embeddings_config(args: argparse.Namespace, model_dir: str | None) -> PoolingConfig | None:
    """The pooling the server embeds with, or None when it serves no embeddings."""
    task = getattr(args, "task", "auto")
    cfg = pooling_config(model_dir)
    if task == "embed" or (task == "auto" and cfg.detected):
        return cfg
    return None


@dataclasses.dataclass
class EmbeddingRequest:
    prompts: list[list[int]]
    base64: bool
    dimensions: int | None
    priority: int


def parse_embedding(body: dict, engine, limits: RequestLimits, cfg: PoolingConfig) -> EmbeddingRequest:
    check_strings(body, engine.tokenizer, engine.max_model_len)
    log_unknown_fields(body, KNOWN_FIELDS, "/v1/embeddings")
    check_model(body, engine.served_model_names)
    fmt = body.get("encoding_format", "float")
    if fmt not in ("float", "base64", None):
        raise bad_request(f"encoding_format={short_repr(fmt)}: must be 'float' or 'base64'",
                          "encoding_format")
    if not isinstance(body.get("user", ""), (str, type(None))):
        raise bad_request("user must be a string", "user")
    priority = body.get("priority", 0)
    if isinstance(priority, bool) or not isinstance(priority, int) or not -2**31 <= priority < 2**31:
        raise bad_request(f"priority={short_repr(priority)}: must be a 32-bit integer", "priority")
    try:
        check_dimensions(cfg, body.get("dimensions"), engine.model_config.hidden_size)
        parsed = parse_prompts(body.get("input"))
    except (APIError, InvalidRequestError) as exc:
        exc.param = "input" if exc.param == "prompt" else exc.param
        raise
    check_sequence_count(len(parsed), 1, limits)
    add_special = bool_field(body, "add_special_tokens", True)
    max_len, tokenizer = engine.max_model_len, engine.tokenizer
    prompts = []
    for p in parsed:
        if isinstance(p, str):
            if not p:
                raise bad_request("input: an input is empty", "input")
            check_text_length(len(p), tokenizer, max_len, "input")
            ids = tokenizer.encode(p, add_special_tokens=add_special)
        else:
            ids = check_token_ids(p, engine.model_config.vocab_size, "input", max_len)
        if not 1 <= len(ids) < max_len:
            raise bad_request(f"input: {len(ids)} tokens; this model embeds 1 to {max_len - 1} tokens "
                              "per input", "input")
        prompts.append(ids)
    return EmbeddingRequest(prompts, fmt == "base64", body.get("dimensions"), priority)


def _encode(vector, as_base64: bool):
    """The vector as the response carries it. A non-finite value (a model that overflowed) is an
    error of the server's, not a NaN in the body: JSON has no NaN, and clients' parsers reject it."""
    if not np.isfinite(vector).all():
        raise APIError(500, "the model produced a non-finite embedding; no vector is returned")
    if as_base64:
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()


async def create_embedding(request: web.Request) -> web.Response:
    engine, cfg = request.app[ENGINE], request.app[EMBEDDINGS]
    if cfg is None:
        raise APIError(400, f"{engine.model_name} is served for generation; start the server with "
                            "--task embed to serve /v1/embeddings", "model")
    check_embedding_engine(engine.config)
    body = await read_json_body(request)
    req = await off_loop(parse_embedding, body, engine, request.app[LIMITS], cfg)
    check_capacity(request.app, len(req.prompts))
    params = SamplingParams(max_tokens=1, temperature=0.0, pooling=cfg.method)
    request_id = new_response_id("embd")
    pooled: dict[int, list[float]] = {}
    async with RequestGroup(engine, request_id, req.prompts, params, req.priority) as group:
        await group.start()
        async for i, out in group.outputs():
            if out.finished:
                pooled[i] = out.embedding
    data = [{"object": "embedding", "index": i,
             "embedding": _encode(finish_embedding(pooled[i], cfg.normalize, req.dimensions), req.base64)}
            for i in range(len(req.prompts))]
    tokens = sum(len(p) for p in req.prompts)
    return web.json_response({"id": request_id, "object": "list", "model": engine.model_name,
                              "data": data, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})
