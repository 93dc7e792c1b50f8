"""The engine-core process: one LLMEngine that schedules and runs the device, and nothing else
(vLLM V1's EngineCoreProc, vllm/v1/engine/core.py). `jaxinfer serve` starts one per server
(core_client.py); HTTP, tokenizing, detokenizing, stop strings and SSE stay in the server process,
so a 30 MB request body's json.loads there no longer holds up a step.

Its loop: take every waiting call (adds, aborts, admin calls) off the input socket, step the
engine while it has work, and push one `CoreOutputs` per iteration with each advanced request's
new token ids (diffs: `token_deltas`), the engine's failed requests and the calls' replies. The
engine keeps no output text (`LLMEngine.emit_token_deltas`); the server finishes a choice at a
stop string with the `finish_choice` call.

Run as `python -m jaxinfer.frontends.engine_core IN_ADDRESS OUT_ADDRESS [REPLICA]` with the
pickled EngineArgs on stdin (core_processes.py starts it). It exits when told to (`shutdown`),
when its server process is gone, or, with status 1 after a last `CoreOutputs(dead=...)`, when a
step raises past the engine's own per-request failure handling.
"""

from __future__ import annotations

import gc
import logging
import os
import pickle
import sys
import time

from jaxinfer.core.request import Request
from jaxinfer.engine.llm_engine import LLMEngine
from jaxinfer.frontends.core_messages import (OUTPUTS_ENCODER, ChoiceDelta, CoreOutput, CoreOutputs,
                                              decode_call, encode_reply)

log = logging.getLogger(__name__)

IDLE_POLL_MS = 100  # how long an idle core waits for a call before checking on its parent


def token_deltas(req: Request, full: bool = False) -> CoreOutput:
    """The request's news since its previous output: each choice's new token ids, their logprobs,
    finish events (the engine-core's `make_output`; `full` is LLM.generate's, never asked here)."""
    outs = []
    for i, seq in enumerate(req.choices):
        if seq is None or (not seq.new_token_ids and (seq.finish_reason is None
                                                       or seq.finish_reported)):
            continue
        delta = ChoiceDelta(i, seq.new_token_ids, finish_reason=seq.finish_reason,
                            stop_reason=seq.stop_reason)
        store = seq.logprobs
        if store is not None:
            start, k = seq.num_logprobs_reported, store.k
            delta.logprobs = store.logprobs[start:]
            if k:
                delta.top_ids = store.top_ids[start * k:]
                delta.top_logprobs = store.top_logprobs[start * k:]
            seq.num_logprobs_reported = len(store)
        seq.new_token_ids = []
        if seq.finish_reason is not None:
            seq.finish_reported = True
        outs.append(delta)
    out = CoreOutput(req.request_id, outs, req.finished, req.num_cached_tokens, req.weight_version)
    if req.prompt_logprobs is not None and not getattr(req, "prompt_logprobs_sent", False):
        out.prompt_logprobs = pickle.dumps(req.prompt_logprobs, pickle.HIGHEST_PROTOCOL)
        req.prompt_logprobs_sent = True
    if req.pooled is not None and req.finished:
        out.embedding = req.pooled.tolist()
    return out


def freeze_heap() -> None:
    """Take every object made so far (the loaded engine: jax, the model, the compiled steps) out of
    the cyclic garbage collector's passes, which then walk only what the steps make. On the
    host-overhead bench (256 requests, CPU) a full pass over the unfrozen heap paused the step
    loop for 110 ms, 3 ms over the frozen one (vLLM's engine core freezes its heap too)."""
    gc.collect()
    gc.freeze()


class EngineCore:
    """The calls the server process makes on the engine (by name, over the input socket)."""

    def __init__(self, engine: LLMEngine):
        engine.emit_token_deltas(token_deltas)
        self.engine = engine
        self.stopping = False

    # ---- requests ---------------------------------------------------------------------------
    def add_request(self, request_id, prompt, params, priority=0, lora_request=None) -> None:
        self.engine.add_request(request_id, prompt, params, priority, lora_request=lora_request)

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    def finish_choice(self, request_id: str, index: int, stop_reason: str) -> None:
        self.engine.finish_choice(request_id, index, stop_reason)

    # ---- admin ------------------------------------------------------------------------------
    def describe(self) -> dict:
        """What the server process needs of the loaded engine."""
        e = self.engine
        return dict(config=e.config, cfg=e.cfg, max_model_len=e.max_model_len, model_name=e.model_name,
                    num_total_blocks=e.num_total_blocks, loras=e.list_loras(),
                    startup=None if e.startup is None else e.startup.as_dict(),
                    eos_token_ids=e.eos_token_ids)

    def warmup(self, progress: bool = True) -> dict | None:
        """Compile the step shapes; the startup phases' times, warm-up included."""
        self.engine.warmup(progress)
        freeze_heap()  # (what compiling made)
        return None if self.engine.startup is None else self.engine.startup.as_dict()

    def load_lora_adapter(self, name: str, path: str):
        return self.engine.load_lora_adapter(name, path)

    def remove_lora(self, name: str) -> None:
        self.engine.remove_lora(name)

    def metrics_text(self) -> bytes:
        from prometheus_client import generate_latest
        return generate_latest(self.engine.metrics.registry)

    def kv_pool_state(self) -> tuple[int, int, list]:
        """(free blocks, blocks, request ids holding blocks): tests check that nothing leaks."""
        kv = self.engine.scheduler.kv
        return kv.num_free_blocks, kv.num_blocks, kv.request_ids()

    def live_request_ids(self) -> list[str]:
        return list(self.engine.requests)

    def shutdown(self) -> None:
        for rid in list(self.engine.requests):
            self.engine.abort(rid)
        self.stopping = True

    # ---- the loop ---------------------------------------------------------------------------
    def handle(self, data: bytes, replies: list) -> None:
        call = decode_call(data)
        try:
            value = getattr(self, call.method)(*call.args, **call.kwargs)
        except Exception as e:  # the caller's to report; the loop goes on
            if call.call_id:
                replies.append((call.call_id, encode_reply(False, e)))
            elif not isinstance(e, (KeyError, ValueError)):
                log.exception("engine-core call %s failed", call.method)
        else:
            if call.call_id:
                replies.append((call.call_id, encode_reply(True, value)))

    def iteration(self, calls, send) -> None:
        """Take the waiting calls, step once if there is work, send what came of both."""
        replies: list = []
        for data in calls:
            self.handle(data, replies)
        engine = self.engine
        if replies:  # an add's verdict does not wait for a step
            send(CoreOutputs(replies=replies, num_waiting=engine.num_waiting))
        if self.stopping or not engine.has_unfinished_requests():
            return
        outs = engine.step()  # (a finished request has left engine.requests)
        failed = [(rid, str(err)) for rid, err in engine.take_failed()]
        if outs or failed:
            send(CoreOutputs(outs, failed, num_waiting=engine.num_waiting))


def serve_core(engine_args, in_address: str, out_address: str, index: int = 0) -> int:
    """The process's life: load, describe itself, then the loop until shut down or orphaned.
    `index`: its data-parallel replica, on every message it sends."""
    import zmq
    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.setsockopt(zmq.RCVHWM, 0)
    inbox.connect(in_address)
    outbox = ctx.socket(zmq.PUSH)
    outbox.setsockopt(zmq.SNDHWM, 0)  # a server busy for a while (a huge body) never stalls a step
    outbox.connect(out_address)

    def send(msg: CoreOutputs) -> None:
        msg.engine_index = index
        outbox.send(OUTPUTS_ENCODER.encode(msg), copy=False)

    parent = os.getppid()
    try:
        core = EngineCore(LLMEngine.from_engine_args(engine_args))
    except BaseException as e:  # the server raises it as its own (the same error as in-process)
        send(CoreOutputs(replies=[(0, encode_reply(False, e))], dead=f"the engine failed to load: {e!r}"))
        log.exception("engine-core failed to load")
        return 1
    send(CoreOutputs(replies=[(0, encode_reply(True, core.describe()))]))
    freeze_heap()
    poller = zmq.Poller()
    poller.register(inbox, zmq.POLLIN)
    try:
        while not core.stopping:
            busy = core.engine.has_unfinished_requests()
            calls = []
            if poller.poll(0 if busy else IDLE_POLL_MS):
                while True:
                    try:
                        calls.append(inbox.recv(zmq.NOBLOCK, copy=True))
                    except zmq.Again:
                        break
            elif not busy and os.getppid() != parent:
                log.error("engine-core: the server process is gone; exiting")
                return 1
            core.iteration(calls, send)
    except BaseException as e:
        log.exception("engine-core loop died")
        send(CoreOutputs(dead=repr(e)))
        return 1
    finally:
        outbox.close(linger=2000)
        inbox.close(linger=0)
        ctx.term()
    return 0


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine-core %(levelname)s %(message)s")
    engine_args = pickle.load(sys.stdin.buffer)
    t0 = time.perf_counter()
    status = serve_core(engine_args, argv[0], argv[1], int(argv[2]) if len(argv) > 2 else 0)
    log.info("engine-core exits with status %d after %.1f s", status, time.perf_counter() - t0)
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
