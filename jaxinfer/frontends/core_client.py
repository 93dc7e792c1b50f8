"""The server's engine when the engine core runs in its own process (`jaxinfer serve`'s default,
`--engine-core process`): AsyncEngine's interface (async_engine.py, the in-process mode) over an
engine-core process (engine_core.py), after vLLM V1's AsyncMPClient (vllm/v1/engine/core_client.py).

Two ZMQ sockets over ipc://: calls go out on a PUSH socket from the event loop; a reader thread
receives the core's `CoreOutputs` and hands each to the event loop, where `RequestState`
(output_state.py) turns its token-id diffs into the streams' RequestOutputs. An add's verdict
(InvalidRequestError) comes back as the call's reply before any output, and the stream is
registered as that reply is read, so no output of the request can pass it.

A core process that exits (killed, a device failure that ended its loop) fails every open stream
with EngineDeadError and sets `dead`: the server exits non-zero (serve/app.py), it does not answer
503 forever.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import threading
from typing import AsyncIterator

import zmq

from jaxinfer.core.outputs import RequestOutput
from jaxinfer.engine.args import EngineArgs
from jaxinfer.engine.startup import STARTUP_LOG_PREFIX
from jaxinfer.errors import ConfigError, RequestFailedError
from jaxinfer.frontends.async_engine import EngineDeadError
from jaxinfer.frontends.core_messages import OUTPUTS_DECODER, Call, CoreOutputs, encode_call
from jaxinfer.frontends.output_state import RequestState
from jaxinfer.lora_request import LoRARequest
from jaxinfer.model.tokenizer import load_tokenizer
from jaxinfer.sampling_params import SamplingParams
from jaxinfer.structured.grammar import GrammarCompiler

log = logging.getLogger(__name__)

POLL_MS = 200  # how often the reader checks that the core process is still alive


def _core_env() -> dict[str, str]:
    """The server's environment, plus the jax settings made in code that change numerics."""
    env = dict(os.environ)
    import jax
    precision = jax.config.jax_default_matmul_precision
    if precision is not None:
        env["JAX_DEFAULT_MATMUL_PRECISION"] = str(precision)
    return env


class CoreProcessEngine:
    def __init__(self, args: EngineArgs):
        """Start the engine-core process and wait until it has loaded the model (no compilation:
        that is `start`). Raises ConfigError when the core fails to load."""
        warm = args.warmup
        args.warmup = False  # compiled in start(), as AsyncEngine does
        self._dir = tempfile.mkdtemp(prefix="jaxinfer-core-")
        self._zmq = zmq.Context()
        self._to_core = self._zmq.socket(zmq.PUSH)
        self._to_core.bind(f"ipc://{self._dir}/in")
        self._from_core = self._zmq.socket(zmq.PULL)
        self._from_core.bind(f"ipc://{self._dir}/out")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "jaxinfer.frontends.engine_core", f"ipc://{self._dir}/in",
             f"ipc://{self._dir}/out"], stdin=subprocess.PIPE, env=_core_env())
        self.proc.stdin.write(pickle.dumps(args))
        self.proc.stdin.close()
        args.warmup = warm
        self._warmup = warm
        try:  # (while the core loads the weights)
            self.tokenizer = load_tokenizer(args.model_path, args.tokenizer, args.chat_template)
            info = self._wait_loaded()
        except BaseException:
            self._close()
            raise
        self.args: EngineArgs = info["args"]
        self.args.warmup = warm
        self.model_config = info["cfg"]
        self.max_model_len: int = info["max_model_len"]
        self.model_name: str = info["model_name"]
        self.served_model_names = self.args.served_model_names
        self.num_total_blocks: int = info["num_total_blocks"]
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
        # add call id -> (request id, state, stream, [cancelled]) until the core's verdict
        self._adding: dict[int, tuple[str, RequestState, asyncio.Queue, list]] = {}
        self._streams: dict[str, tuple[RequestState, asyncio.Queue]] = {}
        self._unadded: dict[str, int] = {}  # request id -> sequences sent, not yet accepted
        self._core_waiting = 0

    def _wait_loaded(self) -> dict:
        while True:
            if self._from_core.poll(POLL_MS):
                msg = OUTPUTS_DECODER.decode(self._from_core.recv())
                if msg.dead is not None:
                    raise ConfigError(f"the engine-core process failed: {msg.dead}")
                ok, value = pickle.loads(msg.replies[0][1])
                return value
            if self.proc.poll() is not None:
                raise ConfigError(f"the engine-core process exited with status "
                                  f"{self.proc.returncode} while loading the model")

    # ---- lifecycle ----------------------------------------------------------------------------
    async def start(self) -> None:
        """Start reading the core's outputs, then compile every step bucket there."""
        self._loop = asyncio.get_running_loop()
        self.dead = asyncio.Event()
        self._reader = threading.Thread(target=self._read, name="jaxinfer-core-reader", daemon=True)
        self._reader.start()
        if self._warmup:
            self.startup = await self._call("warmup", True)
        self.is_ready = True
        if self.startup is not None:
            log.info("%s%s", STARTUP_LOG_PREFIX, json.dumps(self.startup))

    async def shutdown(self, grace_s: float = 0) -> None:
        """Let in-flight requests finish for up to grace_s seconds, abort the rest, stop the core."""
        self.is_ready = False
        if self._loop is not None and self.errored is None:
            deadline = self._loop.time() + grace_s
            while self._streams and self._loop.time() < deadline and self.errored is None:
                await asyncio.sleep(0.01)
            for rid in list(self._streams):
                await self.abort(rid)
            self._send("shutdown")
        await asyncio.to_thread(self._close)

    def _close(self) -> None:
        self._stop.set()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            log.error("the engine-core process did not exit; killing it")
            self.proc.kill()
            self.proc.wait()
        if self._reader is not None and self._reader is not threading.current_thread():
            self._reader.join(timeout=5)
        self._to_core.close(linger=0)
        self._from_core.close(linger=0)
        self._zmq.term()
        shutil.rmtree(self._dir, ignore_errors=True)

    def check_health(self) -> None:
        if self.proc.poll() is not None:
            raise RuntimeError(f"the engine-core process exited with status {self.proc.returncode}")

    @property
    def num_waiting(self) -> int:
        """The core's waiting sequences, plus those sent and not yet accepted."""
        return self._core_waiting + sum(self._unadded.values())

    @property
    def model_names(self) -> list[str]:
        return [*self.served_model_names, *self.lora_requests]

    async def metrics_text(self) -> bytes:
        """The core's Prometheus metrics, as text."""
        return await self._call("metrics_text")

    async def call(self, method: str, *args):
        """An admin call on the core (EngineCore's methods): its result, or its exception."""
        return await self._call(method, *args)

    async def load_lora_adapter(self, name: str, path: str) -> LoRARequest:
        lora = await self._call("load_lora_adapter", name, path)
        self.lora_requests[name] = lora
        return lora

    async def unload_lora_adapter(self, name: str) -> None:
        await self._call("remove_lora", name)
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
        prompt_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        state = RequestState(request_id, prompt_ids, params, self.tokenizer, self.eos_token_ids)
        stream: asyncio.Queue = asyncio.Queue()
        cancelled: list = []
        call_id = next(self._call_ids)
        added = self._loop.create_future()
        self._calls[call_id] = added
        self._adding[call_id] = (request_id, state, stream, cancelled)
        self._send_call(Call(call_id, "add_request",
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
                cancelled.append(True)  # an add still on its way registers no stream
                entry = self._streams.get(request_id)
                if entry is not None and entry[1] is stream:
                    del self._streams[request_id]
                rejected = added.done() and not added.cancelled() and added.exception() is not None
                if not rejected:
                    self._send("abort", request_id)

    async def abort(self, request_id: str) -> None:
        self._unadded.pop(request_id, None)
        entry = self._streams.pop(request_id, None)
        self._send("abort", request_id)
        if entry is not None:
            state, stream = entry
            stream.put_nowait(state.abort_output())

    # ---- the wire -----------------------------------------------------------------------------
    def _send_call(self, call: Call) -> None:
        if self.errored is None:
            self._to_core.send(encode_call(call), copy=False)

    def _send(self, method: str, *args) -> None:
        self._send_call(Call(0, method, args))

    def _call(self, method: str, *args) -> asyncio.Future:
        if self.errored is not None:
            raise EngineDeadError("the engine loop has died") from self.errored
        call_id = next(self._call_ids)
        fut = self._loop.create_future()
        self._calls[call_id] = fut
        self._send_call(Call(call_id, method, args))
        return fut

    def _read(self) -> None:
        """The reader thread: each message to the event loop; the core's exit to `_die`."""
        sock, loop = self._from_core, self._loop
        while not self._stop.is_set():
            try:
                if sock.poll(POLL_MS):
                    msg = OUTPUTS_DECODER.decode(sock.recv(copy=False).buffer)
                    loop.call_soon_threadsafe(self._on_message, msg)
                    continue
            except zmq.ZMQError:
                return  # closed by _close
            status = self.proc.poll()
            if status is not None and not self._stop.is_set():
                loop.call_soon_threadsafe(self._die, f"it exited with status {status}")
                return

    def _on_message(self, msg: CoreOutputs) -> None:
        for call_id, payload in msg.replies:
            self._on_reply(call_id, *pickle.loads(payload))
        self._core_waiting = msg.num_waiting
        streams = self._streams
        for out in msg.outputs:
            entry = streams.get(out.request_id)
            if entry is None:
                continue  # aborted or stopped here; the core's last outputs are dropped
            state, stream = entry
            result, stopped = state.apply(out)
            for index, stop_str in stopped:
                self._send("finish_choice", out.request_id, index, stop_str)
            if result is not None:
                if result.finished:
                    del streams[out.request_id]
                stream.put_nowait(result)
        for rid, message in msg.failed:
            entry = streams.pop(rid, None)
            if entry is not None:
                entry[1].put_nowait(RequestFailedError(message, (rid,)))
        if msg.dead is not None:
            self._die(msg.dead)

    def _on_reply(self, call_id: int, ok: bool, value) -> None:
        adding = self._adding.pop(call_id, None)
        if adding is not None:
            rid, state, stream, cancelled = adding
            self._unadded.pop(rid, None)
            if ok and not cancelled:
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
        if self.dead is not None:
            self.dead.set()
