"""POST /v1/completions: `text_completion` objects, streamed or not, in vLLM's wire format."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncGenerator

from aiohttp import web

from jaxinfer.core.outputs import TokenLogprob
from serve.app_keys import ENGINE
from serve.choices import (UsageCounter, choice_index, collect_choices, now,
                           safe_logprob, token_text)
from serve.engine_requests import RequestGroup, check_capacity
from serve.json_body import off_loop
from serve.limits import LIMITS
from serve.prompt_logprobs import vllm_prompt_logprobs
from serve.protocol import GenerationRequest, parse_generation, read_json_body
from serve.sse import stream_chunks


def completion_logprobs(tokenizer, logprobs: list[TokenLogprob], text_offset: int,
                        prompt: tuple[list[int], list[TokenLogprob | None]] | None = None) -> dict:
    """OpenAI's legacy logprobs object. `top_logprobs` maps token text to logprob for the requested
    alternatives plus the sampled token (as vLLM does); offsets count characters from `text_offset`.
    `prompt` (echo): the prompt's ids and prompt logprobs come first, their offsets from 0, with
    null logprob and top for the first token (what lm-eval's loglikelihood requests read)."""
    out: dict[str, list] = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}

    def add(token_id: int, lp: TokenLogprob | None, offset: int) -> int:
        text = token_text(tokenizer, token_id)
        out["tokens"].append(text)
        out["text_offset"].append(offset)
        if lp is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
        else:
            top = {token_text(tokenizer, tid): safe_logprob(v) for tid, v in lp.top}
            top.setdefault(text, safe_logprob(lp.logprob))
            out["token_logprobs"].append(safe_logprob(lp.logprob))
            out["top_logprobs"].append(top)
        return offset + len(text)

    if prompt is not None:
        offset = 0
        for token_id, lp in zip(*prompt):
            offset = add(token_id, lp, offset)
    for lp in logprobs:
        text_offset = add(lp.token_id, lp, text_offset)
    return out


def _echoed_prompt(req: GenerationRequest, prompt_index: int, plp) -> tuple | None:
    """The prompt part of an echoed logprobs object, or None when not echoing logprobs."""
    if not (req.echo and req.top_logprobs is not None and plp is not None):
        return None
    return req.prompts[prompt_index], plp


async def full_completion(engine, group: RequestGroup, req: GenerationRequest, response_id: str,
                          created: int) -> dict:
    usage = UsageCounter(req.prompts, count_generated=not req.generate_nothing)
    choices = []
    for idx, prompt_index, state in await collect_choices(group, req.params.n, usage):
        if req.generate_nothing:
            state = dataclasses.replace(state, text="", logprobs=[], finish_reason="length",
                                        stop_reason=None)
        prefix = req.prompt_texts[prompt_index] if req.echo else ""
        logprobs = None
        if req.top_logprobs is not None:
            logprobs = completion_logprobs(engine.tokenizer, state.logprobs, len(prefix),
                                           _echoed_prompt(req, prompt_index, state.prompt_logprobs))
        choices.append({"index": idx, "text": prefix + state.text, "logprobs": logprobs,
                        "finish_reason": state.finish_reason, "stop_reason": state.stop_reason,
                        "prompt_logprobs": vllm_prompt_logprobs(engine.tokenizer,
                                                                state.prompt_logprobs)})
    return {"id": response_id, "object": "text_completion", "created": created,
            "model": req.model_name(engine.model_name), "choices": choices, "usage": usage.as_dict(),
            "system_fingerprint": None}


async def completion_chunks(engine, group: RequestGroup, req: GenerationRequest, response_id: str,
                            created: int) -> AsyncGenerator[dict, None]:
    usage = UsageCounter(req.prompts, count_generated=not req.generate_nothing)
    text_len: dict[int, int] = {}  # choice index -> characters sent so far (logprob offsets)

    def chunk(choices: list[dict]) -> dict:
        return {"id": response_id, "object": "text_completion", "created": created,
                "model": req.model_name(engine.model_name), "choices": choices,
                "usage": usage.as_dict() if req.continuous_usage else None}

    async for prompt_index, out in group.outputs():
        usage.update(prompt_index, out)
        for c in out.outputs:
            idx = choice_index(prompt_index, c.index, req.params.n)
            if req.generate_nothing:  # (max_tokens 1 in the engine: this is the choice's only output)
                c = dataclasses.replace(c, new_text="", new_logprobs=[], finish_reason="length",
                                        stop_reason=None)
            text = c.new_text
            echoed = None
            first = idx not in text_len
            if first:
                text_len[idx] = 0
                if req.echo:
                    text = req.prompt_texts[prompt_index] + text
                    echoed = _echoed_prompt(req, prompt_index, out.prompt_logprobs)
            if not text and c.finish_reason is None and req.top_logprobs is None:
                continue  # a token whose text is held back (half a UTF-8 character): nothing to say yet
            logprobs = None
            if req.top_logprobs is not None:
                logprobs = completion_logprobs(engine.tokenizer, c.new_logprobs or [],
                                               text_len[idx] + len(text) - len(c.new_text), echoed)
            text_len[idx] += len(text)
            choice = {"index": idx, "text": text, "logprobs": logprobs,
                      "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
            if first and out.prompt_logprobs is not None:
                choice["prompt_logprobs"] = vllm_prompt_logprobs(engine.tokenizer, out.prompt_logprobs)
            yield chunk([choice])
    if req.include_usage:
        final = chunk([])
        final["usage"] = usage.as_dict()
        yield final


async def create_completion(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE]
    body = await read_json_body(request)
    req = await off_loop(parse_generation, body, engine, request.app[LIMITS], chat=False)
    check_capacity(request.app, req.num_seqs)
    engine_id, response_id = req.ids("cmpl")
    created = now()
    async with RequestGroup(engine, engine_id, req.prompts, req.params, req.priority,
                            req.lora_request) as group:
        await group.start()
        if req.stream:
            return await stream_chunks(request, completion_chunks(engine, group, req, response_id, created))
        return web.json_response(await full_completion(engine, group, req, response_id, created))
