"""AsyncEngine: the LLMEngine behind one background loop, with a per-request async stream of
RequestOutputs for the server.

The engine is not thread-safe, so every engine call (add_request, abort, step) happens on one
dedicated worker thread; the asyncio side only enqueues commands and reads per-request queues. The
event loop therefore never blocks on a step, and a step never races an add or an abort.

A failure that belongs to one request (building, running or processing its part of a step) fails that
request only: its stream raises RequestFailedError, its blocks are freed, the loop goes on. Anything
else that escapes a step (the device's results lost, say) stops the loop: every stream raises
EngineDeadError and `dead` is set, which the server turns into a non-zero exit so that a supervisor
restarts it (instead of a process that answers 503 forever).

In a multi-process run (jax.process_count() > 1) this is process 0's server: its engine calls are
recorded and replayed on the other processes (frontends/multihost.py), and stopping the loop,
or its death, stops their replay too.
"""

from __future__ import annotations

import dataclasses
import asyncio
import json
import logging
import queue
import threading
from typing import AsyncIterator, Callable

import jax

from jaxinfer.engine.protocol import EngineClient
from jaxinfer.frontends.factory import create_engine
from jaxinfer.frontends.multihost import StreamLeader
from jaxinfer.frontends.output_stream import OutputStream
from jaxinfer.engine.args import EngineArgs
from jaxinfer.errors import JaxinferError, RequestFailedError
from jaxinfer.core.outputs import RequestOutput
from jaxinfer.engine.startup import STARTUP_LOG_PREFIX
from jaxinfer.lora_request import LoRARequest
from jaxinfer.sampling_params import SamplingParams

log = logging.getLogger(__name__)


class EngineDeadError(JaxinferError):
    """The background loop died; `__cause__` is the original exception."""


class AsyncEngine:
    def __init__(self, args: EngineArgs | None = None, *, engine: EngineClient | None = None):
        """Load the model and tokenizer (no compilation yet), or wrap a ready `engine`."""
        if engine is None:
            args = args or EngineArgs()
            self._warmup = args.warmup
            engine = create_engine(dataclasses.replace(args, warmup=False))  # start() compiles
        else:
            self._warmup = engine.config.compilation.warmup
        self._leader: StreamLeader | None = None
        if jax.process_count() > 1:  # every other process replays this engine's request stream
            engine = self._leader = StreamLeader(engine)
        self.engine: EngineClient = engine
        self.config = engine.config
        self.tokenizer = engine.tokenizer
        self.model_config = engine.cfg
        self.grammars = engine.grammars  # the server compiles structured-output grammars off the loop
        self.max_model_len = engine.max_model_len
        self.model_name = engine.model_name
        self.served_model_names = engine.config.model.served_model_names
        # The LoRA adapters requests may name as their `model` (a copy for the event loop's side,
        # updated when a load or unload has run on the engine thread).
        self.lora_requests: dict[str, LoRARequest] = {
            r.lora_name: r for r in engine.list_loras()}
        self.metrics = engine.metrics
        self.num_total_blocks = engine.num_total_blocks
        self.is_ready = False
        self.errored: BaseException | None = None
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, OutputStream]] = {}
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._wake = threading.Event()
        self.dead: asyncio.Event | None = None  # set (on the loop that started us) if the loop dies
        self._loop: asyncio.AbstractEventLoop | None = None
        # Sequences submitted by generate() whose add has not run on the engine thread yet, so that
        # `num_waiting` counts them at once (the server's --max-waiting check). request id -> count.
        self._unadded: dict[str, int] = {}
        self._unadded_lock = threading.Lock()

    # ---- lifecycle ----------------------------------------------------------------------------
    async def start(self) -> None:
        """Compile every step bucket (in a thread) and start the background loop."""
        self._loop = asyncio.get_running_loop()
        self.dead = asyncio.Event()
        if self._warmup:
            await asyncio.to_thread(self.engine.warmup, True)
        self._thread = threading.Thread(target=self._run, name="jaxinfer-engine", daemon=True)
        self._thread.start()
        self.is_ready = True
        startup = self.engine.startup
        if startup is not None:
            log.info("%s%s", STARTUP_LOG_PREFIX, json.dumps(startup.as_dict()))

    async def shutdown(self, grace_s: float = 0) -> None:
        """Let in-flight requests finish for up to grace_s seconds, abort the rest, stop the loop."""
        self.is_ready = False
        if self._thread is None:
            self._stop_followers(None)  # never started: the other processes wait for step 0
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        while self._streams and loop.time() < deadline and self.errored is None:
            await asyncio.sleep(0.01)
        for rid in list(self._streams):
            await self.abort(rid)
        self._stop.set()
        self._wake.set()
        await asyncio.to_thread(self._thread.join)
        self._thread = None

    def check_health(self) -> None:
        """Raise if the front end can no longer serve (reads only: safe off the engine thread)."""
        self.engine.check_health()

    @property
    def num_waiting(self) -> int:
        """Sequences waiting to be scheduled, counting those submitted but not yet added."""
        with self._unadded_lock:
            unadded = sum(self._unadded.values())
        return self.engine.num_waiting + unadded

    def _set_unadded(self, request_id: str, count: int | None) -> None:
        with self._unadded_lock:
            if count is None:
                self._unadded.pop(request_id, None)
            else:
                self._unadded[request_id] = count

    # ---- requests -----------------------------------------------------------------------------
    @property
    def model_names(self) -> list[str]:
        """Every name a request's `model` may give: the served names, then the adapters'."""
        return [*self.served_model_names, *self.lora_requests]

    async def metrics_text(self) -> bytes:
        """The engine's Prometheus metrics, as text (read off the engine thread, as /metrics
        always has: the client library's collectors lock their own values)."""
        from prometheus_client import generate_latest
        return generate_latest(self.engine.metrics.registry)

    async def load_lora_adapter(self, name: str, path: str) -> LoRARequest:
        """Register a new adapter (read and checked on the engine thread; raises
        InvalidRequestError / LoRAAdapterError, changing nothing)."""
        lora = await self._on_engine_thread(lambda: self.engine.load_lora_adapter(name, path))
        self.lora_requests[name] = lora
        return lora

    async def unload_lora_adapter(self, name: str) -> None:
        await self._on_engine_thread(lambda: self.engine.remove_lora(name))
        self.lora_requests.pop(name, None)

    async def _on_engine_thread(self, fn: Callable):
        """Run `fn` between steps on the engine thread; its result or exception."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()

        def command():
            try:
                result = fn()
            except BaseException as e:  # the caller's to report, the loop goes on
                loop.call_soon_threadsafe(_settle, done, e)
            else:
                loop.call_soon_threadsafe(_settle, done, None, result)

        self._submit(command)
        return await done

    def generate(self, prompt: str | list[int], params: SamplingParams, request_id: str,
                 priority: int = 0, lora_request: LoRARequest | None = None
                 ) -> AsyncIterator[RequestOutput]:
        """Stream the request's outputs. Validation errors (InvalidRequestError) raise on the first
        __anext__; leaving the iteration early (break, cancellation) aborts the request and frees
        its KV blocks. Its sequences count as waiting from this call on."""
        n = params.n if isinstance(params.n, int) and params.n > 0 else 1
        self._set_unadded(request_id, n)
        return self._generate(prompt, params, request_id, priority, lora_request)

    async def _generate(self, prompt, params, request_id, priority, lora_request):
        if self.errored is not None:
            self._set_unadded(request_id, None)
            raise EngineDeadError("the engine loop has died") from self.errored
        loop = asyncio.get_running_loop()
        stream = OutputStream()
        added: asyncio.Future = loop.create_future()

        def add():
            try:
                self.engine.add_request(request_id, prompt, params, priority,
                                        lora_request=lora_request)
            except BaseException as e:  # reported to the caller, the loop goes on
                loop.call_soon_threadsafe(_settle, added, e)
                return
            finally:
                self._set_unadded(request_id, None)
            self._streams[request_id] = (loop, stream)
            loop.call_soon_threadsafe(_settle, added, None)

        self._submit(add)
        finished = False
        try:
            await added  # raises the validation error, before any output
            while True:
                item = await stream.get()
                if isinstance(item, RequestFailedError):
                    finished = True  # already aborted by the engine
                    raise item
                if isinstance(item, BaseException):
                    raise EngineDeadError("the engine loop has died") from item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            # Also reached when cancelled while the add was still queued: the abort command runs
            # after it (commands run in order), so the request never runs unobserved.
            # Only the stream registered by this call is aborted: a rejected duplicate request_id
            # must not abort the request that owns it.
            if not finished:
                self._submit(lambda: self._abort_now(request_id, notify=False, only=stream))

    async def abort(self, request_id: str) -> None:
        self._set_unadded(request_id, None)  # (an add still queued runs first, then this abort)
        self._submit(lambda: self._abort_now(request_id, notify=True))

    # ---- the worker thread --------------------------------------------------------------------
    def _submit(self, command: Callable[[], None]) -> None:
        self._commands.put(command)
        self._wake.set()

    def _abort_now(self, request_id: str, notify: bool, only: OutputStream | None = None) -> None:
        entry = self._streams.get(request_id)
        if only is not None and (entry is None or entry[1] is not only):
            return
        out = self.engine.abort(request_id)
        self._streams.pop(request_id, None)
        if notify and entry is not None and out is not None:
            loop, stream = entry
            loop.call_soon_threadsafe(stream.put_nowait, out)

    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                while True:  # commands first: shutdown's aborts are queued before the stop flag
                    try:
                        self._commands.get_nowait()()
                    except queue.Empty:
                        break
                if self._stop.is_set():
                    break
                if not engine.has_unfinished_requests():
                    self._wake.wait(timeout=0.1)
                    self._wake.clear()
                    continue
                for out in engine.step():
                    entry = self._streams.get(out.request_id)
                    if entry is None:
                        continue
                    loop, stream = entry
                    if out.finished:
                        del self._streams[out.request_id]
                    loop.call_soon_threadsafe(stream.put_nowait, out)
                for rid, error in engine.take_failed():  # aborted by the engine: tell their clients
                    entry = self._streams.pop(rid, None)
                    if entry is not None:
                        entry[0].call_soon_threadsafe(entry[1].put_nowait, error)
        except BaseException as e:  # surface it to every stream and to the server's health check
            log.exception("engine loop died")
            self.errored = e
            self.is_ready = False
            for loop, stream in self._streams.values():
                loop.call_soon_threadsafe(stream.put_nowait, e)
            self._streams.clear()
            self._stop_followers(e)
            if self._loop is not None and self.dead is not None and not self._loop.is_closed():
                self._loop.call_soon_threadsafe(self.dead.set)
        else:
            self._stop_followers(None)

    def _stop_followers(self, error: BaseException | None) -> None:
        if self._leader is None:
            return
        try:
            self._leader.publish_stop(error)
        except Exception:  # the coordinator gone too: nothing left to tell
            log.exception("could not tell the other processes to stop")


def _settle(fut: asyncio.Future, error: BaseException | None, result=None) -> None:
    if fut.done():
        return
    if error is None:
        fut.set_result(result)
    else:
        fut.set_exception(error)
