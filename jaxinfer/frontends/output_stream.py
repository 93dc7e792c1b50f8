"""A request's outputs on their way from the engine to the one coroutine that streams them.

The engine puts one RequestOutput per step. A consumer that fell behind (the server's event loop
busy with other streams, or a 30 MB body) takes what queued up as one output (merge_outputs), so
a lagging server sends one event per stream instead of one per step, and catches up instead of
falling further behind. An exception in the queue (the request failed, the engine died) is never
merged: it comes after the outputs queued before it."""

from __future__ import annotations

import asyncio

from jaxinfer.core.outputs import RequestOutput, merge_outputs


class OutputStream:
    def __init__(self):
        self._queue: asyncio.Queue = asyncio.Queue()
        self._held = None  # an exception taken out of the queue behind a merged output

    def put_nowait(self, item: RequestOutput | BaseException) -> None:
        self._queue.put_nowait(item)

    async def get(self) -> RequestOutput | BaseException:
        item, self._held = self._held, None
        if item is None:
            item = await self._queue.get()
        while isinstance(item, RequestOutput) and not item.finished and not self._queue.empty():
            following = self._queue.get_nowait()
            if not isinstance(following, RequestOutput):
                self._held = following
                break
            item = merge_outputs(item, following)
        return item
