"""Server-sent events framing, as OpenAI and vLLM send it: each event is `data: <json>\\n\\n`, the
stream ends with `data: [DONE]\\n\\n`. JSON is compact and keeps non-ASCII text as UTF-8."""

from __future__ import annotations

import json

from aiohttp import web


def encode_event(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


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

    async def send(self, payload: dict) -> None:
        # Raises ConnectionResetError when the client went away; callers abort their request then.
        await self.response.write(encode_event(payload))

    async def finish(self) -> web.StreamResponse:
        await self.response.write(DONE_EVENT)
        await self.response.write_eof()
        return self.response
