"""POST /v1/responses, GET and DELETE /v1/responses/{id}."""

from __future__ import annotations

import contextlib

from aiohttp import web

from jaxinfer.errors import InvalidRequestError
from serve.app_keys import ENGINE
from serve.chat import NO_TOOLS
from serve.choices import UsageCounter, collect_choices, now
from serve.engine_requests import RequestGroup, check_capacity
from serve.errors import APIError
from serve.json_body import off_loop
from serve.limits import LIMITS, check_strings
from serve.protocol import parse_generation, read_json_body
from serve.reasoning.request import REASONING_PARSER
from serve.responses.events import response_events
from serve.responses.output import conversation_messages, new_id, output_items, response_object, usage
from serve.responses.request import RENAMED_PARAMS, parse_responses_body
from serve.responses.store import RESPONSE_STORE, StoredResponse
from serve.sse import stream_chunks
from serve.tools import TOOL_OPTIONS


def _parse(body: dict, history_of, engine, app):
    """(the Responses request, the chat request it runs as, the conversation before this turn)."""
    # Every string of the body, not only those the chat request carries: the response echoes some of
    # the others (metadata), and a lone surrogate found while a stream is being written could no
    # longer be a 400.
    check_strings(body, engine.tokenizer, engine.max_model_len)
    rr = parse_responses_body(body)
    history = history_of(rr.previous_response_id) if rr.previous_response_id else []
    system = rr.chat_body["messages"][:len(rr.chat_body["messages"]) - len(rr.input_messages)]
    chat_body = {**rr.chat_body, "messages": system + history + rr.input_messages}
    with responses_params():
        req = parse_generation(chat_body, engine, app[LIMITS], chat=True, tool_options=app[TOOL_OPTIONS],
                               reasoning_parser=app[REASONING_PARSER])
    return rr, req, history


@contextlib.contextmanager
def responses_params():
    """Errors of the chat path (and the engine's checks) name the Responses field, not the chat one."""
    try:
        yield
    except (APIError, InvalidRequestError) as exc:
        exc.param = RENAMED_PARAMS.get(exc.param, exc.param)
        raise


async def create_response(request: web.Request) -> web.StreamResponse:
    engine, store = request.app[ENGINE], request.app[RESPONSE_STORE]
    body = await read_json_body(request)
    # The store is read here, on the event loop that owns it; parsing then runs off the loop.
    previous = body.get("previous_response_id")
    history = store.get(previous, "previous_response_id").conversation \
        if isinstance(previous, str) and previous else []
    rr, req, history = await off_loop(_parse, body, lambda _: history, engine, request.app)
    check_capacity(request.app, 1)
    engine_id, _ = req.ids("resp")
    response_id, created = new_id("resp"), now()

    def skeleton(status: str, output: list[dict], usage_dict: dict | None, finish_reason=None) -> dict:
        out = response_object(response_id, created, req.model_name(engine.model_name), rr.echo_fields,
                              rr.metadata, status, output, usage_dict, finish_reason)
        out["store"] = rr.store
        return out

    async def on_complete(final: dict) -> None:
        if rr.store:
            turn = rr.input_messages + conversation_messages(final["output"])
            entry = StoredResponse(final, history + turn)
            store.put(entry, await off_loop(entry.footprint))

    async with RequestGroup(engine, engine_id, req.prompts, req.params, req.priority,
                            req.lora_request) as group:
        with responses_params():
            await group.start()
        if req.stream:
            events = response_events(group, req, skeleton, on_complete)
            return await stream_chunks(request, events, named=True)
        counter = UsageCounter(req.prompts)
        state = (await collect_choices(group, 1, counter))[0][2]
    text, reasoning = state.text, None
    if req.reasoning is not None:
        reasoning, text = req.reasoning.split(text)
    message, _ = (req.tools or NO_TOOLS).message(text or "")
    final = skeleton("completed", output_items(reasoning, message["content"], message["tool_calls"]),
                     usage(counter), state.finish_reason)
    await on_complete(final)
    return web.json_response(final)


async def get_response(request: web.Request) -> web.Response:
    return web.json_response(request.app[RESPONSE_STORE].get(request.match_info["response_id"]).response)


async def delete_response(request: web.Request) -> web.Response:
    response_id = request.match_info["response_id"]
    request.app[RESPONSE_STORE].delete(response_id)
    return web.json_response({"id": response_id, "object": "response", "deleted": True})
