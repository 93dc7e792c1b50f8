"""POST /v1/chat/completions: `chat.completion` objects and `chat.completion.chunk` streams in vLLM's
wire format. The first chunk of each choice carries the assistant role (sent once the first token is
ready), `finish_reason` appears exactly once per choice, in its last chunk."""

from __future__ import annotations

from collections.abc import AsyncGenerator

from aiohttp import web

from jaxinfer.core.outputs import TokenLogprob
from serve.app_keys import ENGINE
from serve.choices import UsageCounter, collect_choices, now, safe_logprob, token_text
from serve.engine_requests import RequestGroup, check_capacity
from serve.json_body import off_loop
from serve.limits import LIMITS
from serve.prompt_logprobs import vllm_prompt_logprobs
from serve.protocol import GenerationRequest, parse_generation, read_json_body
from serve.reasoning.request import REASONING_PARSER, ReasoningStream
from serve.sse import stream_chunks
from serve.tool_parsers import ToolStream
from serve.tools import TOOL_OPTIONS, ToolRequest

ROLE = "assistant"
NO_TOOLS = ToolRequest([])  # a plain text reply


def _logprob_entry(tokenizer, token_id: int, logprob: float) -> dict:
    text = token_text(tokenizer, token_id)
    return {"token": text, "logprob": safe_logprob(logprob), "bytes": list(text.encode("utf-8"))}


def chat_logprobs(tokenizer, logprobs: list[TokenLogprob], top_logprobs: int) -> dict:
    content = []
    for lp in logprobs:
        entry = _logprob_entry(tokenizer, lp.token_id, lp.logprob)
        entry["top_logprobs"] = [_logprob_entry(tokenizer, tid, v) for tid, v in lp.top[:top_logprobs]]
        content.append(entry)
    return {"content": content}


def echo_prefix(body_messages: list[dict] | None, req: GenerationRequest) -> str:
    """vLLM's chat `echo`: the reply is prefixed with the last message when it is the assistant's
    own (a partial answer the model continues)."""
    if req.echo and body_messages and isinstance(body_messages[-1], dict) \
            and body_messages[-1].get("role") == ROLE and isinstance(body_messages[-1].get("content"), str):
        return body_messages[-1]["content"]
    return ""


async def full_chat(engine, group: RequestGroup, req: GenerationRequest, prefix: str, response_id: str,
                    created: int) -> dict:
    usage = UsageCounter(req.prompts)
    choices = []
    for idx, _, state in await collect_choices(group, req.params.n, usage):
        logprobs = None
        if req.top_logprobs is not None:
            logprobs = chat_logprobs(engine.tokenizer, state.logprobs, req.top_logprobs)
        tools = req.tools or NO_TOOLS
        text, reasoning = state.text, None
        if req.reasoning is not None:
            reasoning, content = req.reasoning.split(text)
            text = content or ""  # the tool parser sees only the answer
        message, called = tools.message(text, prefix)
        if req.reasoning is not None and not message["content"]:
            message["content"] = None
        # null without a parser, as in vLLM: clients read message.reasoning_content unconditionally
        message["reasoning_content"] = message["reasoning"] = reasoning
        choices.append({"index": idx, "message": message, "logprobs": logprobs,
                        "finish_reason": tools.finish_reason(state.finish_reason, called),
                        "stop_reason": state.stop_reason})
    return {"id": response_id, "object": "chat.completion", "created": created,
            "model": req.model_name(engine.model_name), "choices": choices, "usage": usage.as_dict(),
            "prompt_logprobs": vllm_prompt_logprobs(engine.tokenizer, state.prompt_logprobs)}


async def chat_chunks(engine, group: RequestGroup, req: GenerationRequest, prefix: str, response_id: str,
                      created: int) -> AsyncGenerator[dict, None]:
    usage = UsageCounter(req.prompts)
    started: set[int] = set()  # choices whose role chunk went out
    tools = req.tools if req.tools is not None and req.tools.parser is not None else None
    tool_streams: dict[int, ToolStream] = {}  # per choice, when the output may hold tool calls
    reasoning_streams: dict[int, ReasoningStream] = {}  # per choice, with --reasoning-parser

    def chunk(choice: dict) -> dict:
        out = {"id": response_id, "object": "chat.completion.chunk", "created": created,
               "model": req.model_name(engine.model_name), "choices": [choice]}
        if req.continuous_usage:
            out["usage"] = usage.as_dict()
        return out

    async for _, out in group.outputs():
        usage.update(0, out)
        for c in out.outputs:
            text, calls, finish, reasoning = c.new_text, [], c.finish_reason, ""
            if req.reasoning is not None:
                rs = reasoning_streams.setdefault(c.index, req.reasoning.stream())
                reasoning, text = rs.feed(text, finish is not None)
            if tools is not None:
                stream = tool_streams.setdefault(c.index, tools.parser.stream())
                text, calls = tools.stream_deltas(stream, text, finish is not None)
                finish = tools.finish_reason(finish, bool(stream.calls))
            if c.index not in started:
                started.add(c.index)
                yield chunk({"index": c.index, "delta": {"role": ROLE, "content": ""}, "logprobs": None,
                             "finish_reason": None})
                text = prefix + text
            logprobs = None
            if req.top_logprobs is not None:
                logprobs = chat_logprobs(engine.tokenizer, c.new_logprobs or [], req.top_logprobs)
            if reasoning:  # reasoning first, in a chunk of its own; the answer's text follows
                delta = {"reasoning_content": reasoning, "reasoning": reasoning}
                yield chunk({"index": c.index, "delta": delta, "logprobs": logprobs, "finish_reason": None})
                if not text and not calls and finish is None:
                    continue
                logprobs = None if logprobs is None else {"content": []}
            elif not text and not calls and finish is None and req.top_logprobs is None:
                continue  # text held back (half a UTF-8 character, a possible tool call): nothing yet
            delta = {"content": text} if text or not calls else {}
            if calls:
                delta["tool_calls"] = calls
            choice = {"index": c.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
            if finish is not None:
                choice["stop_reason"] = c.stop_reason
            yield chunk(choice)
    if req.include_usage:
        yield {"id": response_id, "object": "chat.completion.chunk", "created": created,
               "model": req.model_name(engine.model_name), "choices": [], "usage": usage.as_dict()}


async def create_chat_completion(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE]
    body = await read_json_body(request)
    req = await off_loop(parse_generation, body, engine, request.app[LIMITS], chat=True,
                         tool_options=request.app[TOOL_OPTIONS],
                         reasoning_parser=request.app[REASONING_PARSER])
    prefix = echo_prefix(body.get("messages"), req)
    check_capacity(request.app, req.num_seqs)
    engine_id, response_id = req.ids("chatcmpl")
    created = now()
    async with RequestGroup(engine, engine_id, req.prompts, req.params, req.priority,
                            req.lora_request) as group:
        await group.start()
        if req.stream:
            return await stream_chunks(request, chat_chunks(engine, group, req, prefix, response_id, created))
        return web.json_response(await full_chat(engine, group, req, prefix, response_id, created))
