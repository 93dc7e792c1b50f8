"""Server-sent events framing, as OpenAI and vLLM send it: each event is `data: <json>\\n\\n`, the
stream ends with `data: [DONE]\\n\\n`. JSON is compact and keeps non-ASCII text as UTF-8."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncGenerator

from aiohttp import web

from serve.errors import APIError, as_api_error, error_body

logger = logging.getLogger(__name__)


def encode_event(payload: dict, name: str | None = None) -> bytes:
    head = b"" if name is None else b"event: " + name.encode() + b"\n"
    data = json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode()
    return head + b"data: " + data + b"\n\n"


DONE_EVENT = b"data: [DONE]\n\n"


class SSEWriter:
    """One event stream. `start` sends the headers, so call it only once every check that could still
    become an HTTP error status has passed."""

    def __init__(self, request: web.Request):
        self._request = request
        self.response = web.StreamResponse(status=200, headers={
            "Content-Type": "text/event-stream; charset=utf-8",
            "Cache-Control": "no-cache",
            # Tell reverse proxies (nginx) not to buffer the stream.
            "X-Accel-Buffering": "no",
        })

    async def start(self) -> None:
        await self.response.prepare(self._request)

    async def send(self, payload: dict, name: str | None = None) -> None:
        # Raises ConnectionResetError when the client went away; callers abort their request then.
        await self.response.write(encode_event(payload, name))

    async def finish(self, done: bool = True) -> web.StreamResponse:
        if done:
            await self.response.write(DONE_EVENT)
        await self.response.write_eof()
        return self.response


async def stream_chunks(request: web.Request, chunks: AsyncGenerator[dict, None],
                        named: bool = False) -> web.StreamResponse:
    """Send every chunk as an event, then [DONE]. An error raised after the stream began cannot be a
    status code any more: it goes out as a `data: {"error": ...}` event followed by [DONE], as in
    vLLM. A client that went away ends the stream quietly (the caller aborts its engine requests).
    `named` (the Responses API): each event carries `event: <its type>`, an error is an `error`
    event, and no [DONE] follows."""
    sse = SSEWriter(request)
    try:
        await sse.start()
        async for chunk in chunks:
            await sse.send(chunk, chunk["type"] if named else None)
    except ConnectionResetError:
        return sse.response
    except Exception as exc:  # reported to the client in-band
        api_error = as_api_error(exc)
        if api_error is None:
            logger.exception("error while streaming %s", request.path)
            api_error = APIError(500, f"internal server error: {type(exc).__name__}: {exc}")
        try:
            body = error_body(api_error.status, api_error.message, api_error.param)
            await sse.send({"type": "error", **body["error"]} if named else body, "error" if named else None)
        except ConnectionResetError:
            return sse.response
    finally:
        await chunks.aclose()
    try:
        return await sse.finish(done=not named)
    except ConnectionResetError:
        return sse.response
