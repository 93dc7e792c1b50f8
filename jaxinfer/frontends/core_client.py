"""The server's engine when the engine core runs in its own process (`jaxinfer serve`'s default,
`--engine-core process`): AsyncEngine's interface (async_engine.py, the in-process mode) over the
engine-core processes (engine_core.py; one per data-parallel replica, core_processes.py), after
vLLM V1's AsyncMPClient and DPAsyncMPClient (vllm/v1/engine/core_client.py).

Calls go out on a core's PUSH socket from the event loop; a new request goes to the core with the
fewest requests (ties: the lowest index), and every later call about it to that core. A reader
thread receives the cores' `CoreOutputs` and hands each to the event loop, where `RequestState`
(output_state.py) turns its token-id diffs into the streams' RequestOutputs. An add's verdict
(InvalidRequestError) comes back as the call's reply before any output, and the stream is
registered as that reply is read, so no output of the request can pass it.

A core process that exits (killed, a device failure that ended its loop) fails every open stream
with EngineDeadError and sets `dead`: the server exits non-zero (serve/app.py), it does not answer
503 forever.
"""

from __future__ import annotations

import dataclasses
import asyncio
import itertools
import json
import logging
import pickle
import threading
from typing import AsyncIterator

from jaxinfer.core.outputs import RequestOutput
from jaxinfer.engine.args import EngineArgs
from jaxinfer.engine.config import EngineConfig
from jaxinfer.engine.startup import STARTUP_LOG_PREFIX
from jaxinfer.errors import InvalidRequestError, RequestFailedError
from jaxinfer.frontends.async_engine import EngineDeadError
from jaxinfer.frontends.core_messages import Call, CoreOutputs
from jaxinfer.frontends.core_processes import POLL_MS, CoreProcesses
from jaxinfer.frontends.merged_metrics import merge_expositions
from jaxinfer.frontends.output_state import RequestState
from jaxinfer.frontends.output_stream import OutputStream
from jaxinfer.lora_request import LoRARequest
from jaxinfer.model.tokenizer import load_tokenizer
from jaxinfer.sampling_params import SamplingParams
from jaxinfer.structured.grammar import GrammarCompiler

log = logging.getLogger(__name__)


class CoreProcessEngine:
    def __init__(self, args: EngineArgs):
        """Start the engine-core processes (one per data-parallel replica) and wait until they
        have loaded the model (no compilation: that is `start`). Raises ConfigError when a core
        fails to load."""
        warm = args.warmup
        self.cores = CoreProcesses(dataclasses.replace(args, warmup=False))  # start() compiles
        self._warmup = warm
        try:  # (while the cores load the weights)
            self.tokenizer = load_tokenizer(args.model_path, args.tokenizer, args.chat_template)
            infos = self.cores.wait_loaded()
        except BaseException:
            self.cores.close(timeout_s=0)
            raise
        info = infos[0]
        config: EngineConfig = info["config"]
        self.config = dataclasses.replace(
            config, compilation=dataclasses.replace(config.compilation, warmup=warm),
            parallel=dataclasses.replace(config.parallel, data_parallel_size=self.cores.num))
        self.model_config = info["cfg"]
        self.max_model_len: int = info["max_model_len"]
        self.model_name: str = info["model_name"]
        self.served_model_names = self.config.model.served_model_names
        self.num_total_blocks: int = sum(i["num_total_blocks"] for i in infos)
        self.eos_token_ids = tuple(info["eos_token_ids"])
        self.lora_requests: dict[str, LoRARequest] = {r.lora_name: r for r in info["loras"]}
        self.startup = info["startup"]
        # The server compiles a request's grammar here to refuse a bad one before it is queued;
        # the core compiles its own copy.
        self.grammars = GrammarCompiler(self.tokenizer, self.model_config.vocab_size,
                                        self.eos_token_ids)
        self.is_ready = False
        self.errored: BaseException | None = None
        self.dead: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reader: threading.Thread | None = None
        self._stop = threading.Event()
        self._call_ids = itertools.count(1)
        self._calls: dict[int, asyncio.Future] = {}
        # add call id -> (request id, state, stream, flags) until the core's verdict
        self._adding: dict[int, tuple[str, RequestState, OutputStream, list]] = {}
        self._streams: dict[str, tuple[RequestState, OutputStream]] = {}
        self._unadded: dict[str, int] = {}  # request id -> sequences sent, not yet accepted
        self._owner: dict[str, int] = {}  # request id -> its core, while it runs there
        self._load = [0] * self.cores.num  # requests per core (a new one goes to the least loaded)
        self._core_waiting = [0] * self.cores.num

    # ---- lifecycle ----------------------------------------------------------------------------
    async def start(self) -> None:
        """Start reading the cores' outputs, then compile every step bucket there."""
        self._loop = asyncio.get_running_loop()
        self.dead = asyncio.Event()
        self._reader = threading.Thread(target=self._read, name="jaxinfer-core-reader", daemon=True)
        self._reader.start()
        if self._warmup:
            self.startup = (await self._call_all("warmup", True))[0]
        self.is_ready = True
        if self.startup is not None:
            log.info("%s%s", STARTUP_LOG_PREFIX, json.dumps(self.startup))

    async def shutdown(self, grace_s: float = 0) -> None:
        """Let in-flight requests finish for up to grace_s seconds, abort the rest, stop the cores."""
        self.is_ready = False
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        while self._streams and loop.time() < deadline and self.errored is None:
            await asyncio.sleep(0.01)
        for rid in list(self._streams):
            await self.abort(rid)
        for core in range(self.cores.num):  # (nothing is sent to dead cores)
            self._send_call(core, Call(0, "shutdown"))
        await asyncio.to_thread(self._close)

    def _close(self) -> None:
        self._stop.set()
        if self._reader is not None:
            self._reader.join(timeout=5)
        self.cores.close()

    def check_health(self) -> None:
        if (status := self.cores.exit_status()) is not None:
            raise RuntimeError(f"an engine-core process exited with status {status}")

    @property
    def num_waiting(self) -> int:
        """The cores' waiting sequences, plus those sent and not yet accepted."""
        return sum(self._core_waiting) + sum(self._unadded.values())

    @property
    def model_names(self) -> list[str]:
        return [*self.served_model_names, *self.lora_requests]

    async def metrics_text(self) -> bytes:
        """The cores' Prometheus metrics, as one text (summed over replicas)."""
        return merge_expositions(await self._call_all("metrics_text"))

    async def call(self, method: str, *args, core: int = 0):
        """An admin call on a core (EngineCore's methods): its result, or its exception."""
        return await self._call(core, method, *args)

    async def load_lora_adapter(self, name: str, path: str) -> LoRARequest:
        lora = (await self._call_all("load_lora_adapter", name, path))[0]
        self.lora_requests[name] = lora
        return lora

    async def unload_lora_adapter(self, name: str) -> None:
        await self._call_all("remove_lora", name)
        self.lora_requests.pop(name, None)

    # ---- requests -----------------------------------------------------------------------------
    def generate(self, prompt: str | list[int], params: SamplingParams, request_id: str,
                 priority: int = 0, lora_request: LoRARequest | None = None
                 ) -> AsyncIterator[RequestOutput]:
        """As AsyncEngine.generate: validation errors raise on the first __anext__, leaving early
        aborts the request; its sequences count as waiting from this call on."""
        self._unadded[request_id] = params.n if isinstance(params.n, int) and params.n > 0 else 1
        return self._generate(prompt, params, request_id, priority, lora_request)

    async def _generate(self, prompt, params, request_id, priority, lora_request):
        if self.errored is not None:
            self._unadded.pop(request_id, None)
            raise EngineDeadError("the engine loop has died") from self.errored
        if request_id in self._owner:  # (each core checks its own requests only)
            self._unadded.pop(request_id, None)
            raise InvalidRequestError(f"request_id {request_id!r} is already in use",
                                      param="request_id")
        prompt_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        state = RequestState(request_id, prompt_ids, params, self.tokenizer, self.eos_token_ids)
        stream = OutputStream()
        flags: list[str] = []  # "closed", "aborted": what happened while the add was on its way
        call_id = next(self._call_ids)
        added = self._loop.create_future()
        self._calls[call_id] = added
        self._adding[call_id] = (request_id, state, stream, flags)
        core = min(range(self.cores.num), key=self._load.__getitem__)
        self._owner[request_id] = core
        self._load[core] += 1
        self._send_call(core, Call(call_id, "add_request",
                                   (request_id, prompt_ids, params, priority, lora_request)))
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
            if not finished:
                flags.append("closed")  # an add still on its way registers no stream
                entry = self._streams.get(request_id)
                if entry is not None and entry[1] is stream:
                    del self._streams[request_id]
                rejected = added.done() and not added.cancelled() and added.exception() is not None
                if not rejected:
                    self._send(request_id, "abort", request_id)
                    self._release(request_id)

    async def abort(self, request_id: str) -> None:
        self._unadded.pop(request_id, None)
        for rid, _, _, flags in self._adding.values():
            if rid == request_id:  # its add is on its way: its stream ends once it is accepted
                flags.append("aborted")
        entry = self._streams.pop(request_id, None)
        self._send(request_id, "abort", request_id)
        self._release(request_id)
        if entry is not None:
            state, stream = entry
            stream.put_nowait(state.abort_output())

    # ---- the wire -----------------------------------------------------------------------------
    def _send_call(self, core: int, call: Call) -> None:
        if self.errored is None:
            self.cores.send(core, call)

    def _send(self, request_id: str, method: str, *args) -> None:
        """A call about a request, to its core (none once the request has left it)."""
        core = self._owner.get(request_id)
        if core is not None:
            self._send_call(core, Call(0, method, args))

    def _release(self, request_id: str) -> None:
        core = self._owner.pop(request_id, None)
        if core is not None:
            self._load[core] -= 1

    def _call(self, core: int, method: str, *args) -> asyncio.Future:
        if self.errored is not None:
            raise EngineDeadError("the engine loop has died") from self.errored
        call_id = next(self._call_ids)
        fut = self._loop.create_future()
        self._calls[call_id] = fut
        self._send_call(core, Call(call_id, method, args))
        return fut

    async def _call_all(self, method: str, *args) -> list:
        """The same call on every core, at once: their results in replica order."""
        return await asyncio.gather(*(self._call(c, method, *args) for c in range(self.cores.num)))

    def _read(self) -> None:
        """The reader thread: each message to the event loop; a core's exit to `_die`."""
        loop = self._loop
        while not self._stop.is_set():
            msg = self.cores.receive(POLL_MS)
            if msg is not None:
                loop.call_soon_threadsafe(self._on_message, msg)
                continue
            status = self.cores.exit_status()
            if status is not None and not self._stop.is_set():
                loop.call_soon_threadsafe(self._die, f"it exited with status {status}")
                return

    def _on_message(self, msg: CoreOutputs) -> None:
        for call_id, payload in msg.replies:
            self._on_reply(call_id, *pickle.loads(payload))
        self._core_waiting[msg.engine_index] = msg.num_waiting
        streams = self._streams
        for out in msg.outputs:
            entry = streams.get(out.request_id)
            if entry is None:
                continue  # aborted or stopped here; the core's last outputs are dropped
            state, stream = entry
            result, stopped = state.apply(out)
            for index, stop_str in stopped:
                self._send(out.request_id, "finish_choice", out.request_id, index, stop_str)
            if result is not None:
                if result.finished:
                    del streams[out.request_id]
                    self._release(out.request_id)
                stream.put_nowait(result)
        for rid, message in msg.failed:
            self._release(rid)
            entry = streams.pop(rid, None)
            if entry is not None:
                entry[1].put_nowait(RequestFailedError(message, (rid,)))
        if msg.dead is not None:
            self._die(msg.dead)

    def _on_reply(self, call_id: int, ok: bool, value) -> None:
        adding = self._adding.pop(call_id, None)
        if adding is not None:
            rid, state, stream, flags = adding
            self._unadded.pop(rid, None)
            if not ok:
                self._release(rid)
            elif "aborted" in flags:
                stream.put_nowait(state.abort_output())
            elif not flags:
                self._streams[rid] = (state, stream)
        fut = self._calls.pop(call_id, None)
        if fut is None or fut.done():
            return
        if ok:
            fut.set_result(value)
        else:
            fut.set_exception(value)

    def _die(self, reason: str) -> None:
        """The core is gone: every stream and call fails, `dead` is set."""
        if self.errored is not None:
            return
        log.error("the engine-core process died: %s", reason)
        self.errored = RuntimeError(f"the engine-core process died: {reason}")
        self.is_ready = False
        for _, stream in self._streams.values():
            stream.put_nowait(self.errored)
        self._streams.clear()
        for fut in self._calls.values():
            if not fut.done():
                error = EngineDeadError("the engine loop has died")
                error.__cause__ = self.errored
                fut.set_exception(error)
        self._calls.clear()
        self._adding.clear()
        self._unadded.clear()
        self._owner.clear()
        if self.dead is not None:
            self.dead.set()
