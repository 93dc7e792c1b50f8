"""POST /v1/completions: `text_completion` objects, streamed or not, in vLLM's wire format."""

from __future__ import annotations

from collections.abc import AsyncGenerator

from aiohttp import web

from jaxinfer.engine.outputs import TokenLogprob
from serve.app_keys import ENGINE
from serve.choices import (UsageCounter, choice_index, collect_choices, new_response_id, now,
                           safe_logprob, token_text)
from serve.engine_requests import RequestGroup, check_capacity
from serve.json_body import off_loop
from serve.limits import LIMITS
from serve.protocol import GenerationRequest, parse_generation, read_json_body
from serve.sse import stream_chunks


def completion_logprobs(tokenizer, logprobs: list[TokenLogprob], text_offset: int) -> dict:
    """OpenAI's legacy logprobs object. `top_logprobs` maps token text to logprob for the requested
    alternatives plus the sampled token (as vLLM does); offsets count characters from `text_offset`."""
    tokens, token_logprobs, tops, offsets = [], [], [], []
    for lp in logprobs:
        text = token_text(tokenizer, lp.token_id)
        tokens.append(text)
        token_logprobs.append(safe_logprob(lp.logprob))
        top = {token_text(tokenizer, tid): safe_logprob(v) for tid, v in lp.top}
        top.setdefault(text, safe_logprob(lp.logprob))
        tops.append(top)
        offsets.append(text_offset)
        text_offset += len(text)
    return {"text_offset": offsets, "token_logprobs": token_logprobs, "tokens": tokens, "top_logprobs": tops}


async def full_completion(engine, group: RequestGroup, req: GenerationRequest, response_id: str,
                          created: int) -> dict:
    usage = UsageCounter(req.prompts)
    choices = []
    for idx, prompt_index, state in await collect_choices(group, req.params.n, usage):
        prefix = req.prompt_texts[prompt_index] if req.echo else ""
        logprobs = None
        if req.top_logprobs is not None:
            logprobs = completion_logprobs(engine.tokenizer, state.logprobs, len(prefix))
        choices.append({"index": idx, "text": prefix + state.text, "logprobs": logprobs,
                        "finish_reason": state.finish_reason, "stop_reason": state.stop_reason,
                        "prompt_logprobs": None})
    return {"id": response_id, "object": "text_completion", "created": created, "model": engine.model_name,
            "choices": choices, "usage": usage.as_dict(), "system_fingerprint": None}


async def completion_chunks(engine, group: RequestGroup, req: GenerationRequest, response_id: str,
                            created: int) -> AsyncGenerator[dict, None]:
    usage = UsageCounter(req.prompts)
    text_len: dict[int, int] = {}  # choice index -> characters sent so far (logprob offsets)

    def chunk(choices: list[dict]) -> dict:
        return {"id": response_id, "object": "text_completion", "created": created,
                "model": engine.model_name, "choices": choices,
                "usage": usage.as_dict() if req.continuous_usage else None}

    async for prompt_index, out in group.outputs():
        usage.update(prompt_index, out)
        for c in out.outputs:
            idx = choice_index(prompt_index, c.index, req.params.n)
            text = c.new_text
            if idx not in text_len:  # this choice's first chunk
                text_len[idx] = 0
                if req.echo:
                    text = req.prompt_texts[prompt_index] + text
            if not text and c.finish_reason is None and req.top_logprobs is None:
                continue  # a token whose text is held back (half a UTF-8 character): nothing to say yet
            logprobs = None
            if req.top_logprobs is not None:
                logprobs = completion_logprobs(engine.tokenizer, c.new_logprobs or [], text_len[idx])
            text_len[idx] += len(text)
            yield chunk([{"index": idx, "text": text, "logprobs": logprobs,
                          "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}])
    if req.include_usage:
        final = chunk([])
        final["usage"] = usage.as_dict()
        yield final


async def create_completion(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE]
    body = await read_json_body(request)
    req = await off_loop(parse_generation, body, engine, request.app[LIMITS], chat=False)
    check_capacity(request.app, len(req.prompts) * req.params.n)
    response_id, created = new_response_id("cmpl"), now()
    async with RequestGroup(engine, response_id, req.prompts, req.params) as group:
        await group.start()
        if req.stream:
            return await stream_chunks(request, completion_chunks(engine, group, req, response_id, created))
        return web.json_response(await full_completion(engine, group, req, response_id, created))
