"""The engine requests behind one API request (one per prompt), merged into a single stream of
(prompt_index, RequestOutput).

`start` submits every prompt and waits for each one's first output, so the engine's own validation
errors surface before the HTTP response has begun and become real status codes. Closing the group
(`async with`) aborts whatever has not finished: a client that disconnects mid-prefill or mid-decode
(aiohttp cancels its handler) frees its KV blocks at once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
from collections.abc import AsyncIterator

from aiohttp import web

from jaxinfer.core.outputs import RequestOutput
from jaxinfer.core.waiting_queue import PROMPT_INDEX_SEP
from jaxinfer.sampling_params import SamplingParams
from serve.app_keys import ENGINE, MAX_WAITING
from serve.errors import APIError


@dataclasses.dataclass
class Lifecycle:
    """Mutable per-app state (aiohttp freezes the app's own mapping once it runs)."""
    engine_start: asyncio.Task | None = None  # engine.start() running in the background
    shutting_down: bool = False


LIFECYCLE: web.AppKey[Lifecycle] = web.AppKey("lifecycle")


def engine_unavailable(app) -> APIError | None:
    """Why the engine cannot take requests right now (a 503), or None when it can."""
    engine, life = app[ENGINE], app[LIFECYCLE]
    start = life.engine_start
    if start is not None and start.done() and not start.cancelled() and start.exception() is not None:
        return APIError(503, f"the engine failed to start: {start.exception()!r}")
    if engine.errored is not None:
        return APIError(503, f"the engine loop has stopped: {engine.errored!r}")
    try:
        engine.check_health()
    except Exception as e:  # whatever stops it (the multi-host stream's sender, say): 503
        return APIError(503, f"the engine cannot serve: {e!r}")
    if life.shutting_down:
        return APIError(503, "the server is shutting down")
    if not engine.is_ready:
        return APIError(503, "the engine is still starting up (compiling); retry shortly",
                        headers={"Retry-After": "5"})
    return None


def check_capacity(app, num_seqs: int = 1) -> None:
    """Refuse new work while the engine cannot take it (503, so clients and balancers retry). A
    request's `num_seqs` sequences (n x prompts) are counted against --max-waiting up front: it is
    taken whole or refused whole, never partly queued. (The caller submits them before its next
    await, and the engine counts submitted sequences as waiting at once, so concurrent requests
    cannot all slip under the limit.)"""
    if (error := engine_unavailable(app)) is not None:
        raise error
    engine, max_waiting = app[ENGINE], app[MAX_WAITING]
    waiting = engine.num_waiting
    if waiting + num_seqs > max_waiting:
        if num_seqs > max_waiting >= 1:
            raise APIError(400, f"this request starts {num_seqs} sequences (n x prompts), more than the "
                                f"server ever queues (--max-waiting {max_waiting})", "n")
        raise APIError(503, f"server overloaded: {waiting} sequences are already waiting and this "
                            f"request adds {num_seqs} (--max-waiting {max_waiting}); retry later",
                       headers={"Retry-After": "1"})


class RequestGroup:
    def __init__(self, engine, request_id: str, prompts: list[list[int]], params: SamplingParams,
                 priority: int = 0, lora_request=None):
        self.engine = engine
        self.request_ids = [f"{request_id}{PROMPT_INDEX_SEP}{i}" for i in range(len(prompts))]
        self._iters = [engine.generate(p, params, rid, priority=priority, lora_request=lora_request)
                       for p, rid in zip(prompts, self.request_ids)]
        self._first: list[RequestOutput] = []
        self._pending: dict[int, asyncio.Task] = {}  # prompt index -> task awaiting its next output
        self._finished: set[int] = set()

    async def __aenter__(self) -> "RequestGroup":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def start(self) -> None:
        """Wait for every prompt's first output; raises the engine's InvalidRequestError if it
        refuses one (the others are aborted by `close`)."""
        for i, it in enumerate(self._iters):
            self._pending[i] = asyncio.ensure_future(anext(it))
        # Fail fast: the first refusal is enough to answer the whole request with a 400; `close`
        # cancels and aborts the rest.
        await asyncio.wait(self._pending.values(), return_when=asyncio.FIRST_EXCEPTION)
        for task in self._pending.values():
            if task.done() and task.exception() is not None:
                raise task.exception()
        self._first = [self._pending[i].result() for i in range(len(self._iters))]
        self._pending.clear()

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Every RequestOutput, tagged with its prompt index, in arrival order."""
        for i, out in enumerate(self._first):
            if out.finished:
                self._finished.add(i)
            yield i, out
        if len(self._iters) == 1:  # the common case: no tasks, no extra hop per token
            if 0 not in self._finished:
                async for out in self._iters[0]:
                    if out.finished:
                        self._finished.add(0)
                    yield 0, out
            return
        for i in range(len(self._iters)):
            if i not in self._finished:
                self._pending[i] = asyncio.ensure_future(anext(self._iters[i]))
        while self._pending:
            done, _ = await asyncio.wait(self._pending.values(), return_when=asyncio.FIRST_COMPLETED)
            for i in [i for i, t in self._pending.items() if t in done]:
                task = self._pending.pop(i)
                try:
                    out = task.result()
                except StopAsyncIteration:
                    self._finished.add(i)
                    continue
                if out.finished:
                    self._finished.add(i)
                else:
                    self._pending[i] = asyncio.ensure_future(anext(self._iters[i]))
                yield i, out

    async def close(self) -> None:
        """Abort every unfinished engine request and release its iterator."""
        for task in self._pending.values():
            task.cancel()
        if self._pending:
            await asyncio.gather(*self._pending.values(), return_exceptions=True)
        self._pending.clear()
        for i, (rid, it) in enumerate(zip(self.request_ids, self._iters)):
            if i not in self._finished:
                await self.engine.abort(rid)
            if inspect.isasyncgen(it):
                await it.aclose()
