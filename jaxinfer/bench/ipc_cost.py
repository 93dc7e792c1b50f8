"""The engine-core IPC's cost per step: a child process (the core) sends --steps per-step messages of
--concurrency request outputs (one new token each, --logprobs K: a logprob and K alternatives per
token) to this process (the server), over each transport + serialization compared. Reports, per
step, the sender's CPU time (encode + send: the core's), the receiver's (receive + decode: the
server's) and the wall time per message when streamed back to back.

    jaxinfer bench throughput --ipc-cost --num-seqs 256 [--logprobs 5]

Compared: ZMQ PUSH/PULL over ipc:// with msgspec MessagePack structs (vLLM V1's choice and ours);
multiprocessing.Pipe with pickle of the same data as plain tuples (the best case for pickle) and
as dataclasses (what pickling RequestOutput-like objects costs).
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import pickle
import tempfile
import time

from jaxinfer.frontends.core_messages import (OUTPUTS_DECODER, OUTPUTS_ENCODER, ChoiceDelta,
                                              CoreOutput, CoreOutputs)

TRANSPORTS = ("zmq+msgspec", "pipe+pickle-tuples", "pipe+pickle-dataclasses", "zmq+pickle-tuples")


@dataclasses.dataclass
class _Delta:  # a RequestOutput-like object, for the pickle-of-objects case
    index: int
    token_ids: list[int]
    logprobs: list[float] | None
    top_ids: list[int] | None
    top_logprobs: list[float] | None
    finish_reason: str | None
    stop_reason: int | str | None


@dataclasses.dataclass
class _Output:
    request_id: str
    outputs: list[_Delta]
    finished: bool


def _message(kind: str, c: int, step: int, k: int | None):
    tok = 1000 + step
    lp = None if k is None else [-0.5]
    top_ids = None if not k else list(range(k))
    top_lps = None if not k else [-1.0] * k
    if kind.endswith("msgspec"):
        return CoreOutputs([CoreOutput(f"cmpl-{i:08d}-0", [ChoiceDelta(0, [tok], lp, top_ids, top_lps)])
                            for i in range(c)], num_waiting=0)
    if kind.endswith("tuples"):
        return [(f"cmpl-{i:08d}-0", [(0, [tok], lp, top_ids, top_lps, None, None)], False)
                for i in range(c)]
    return [_Output(f"cmpl-{i:08d}-0", [_Delta(0, [tok], lp, top_ids, top_lps, None, None)], False)
            for i in range(c)]


def _encode(kind: str, msg) -> bytes:
    return OUTPUTS_ENCODER.encode(msg) if kind.endswith("msgspec") else pickle.dumps(msg, 5)


def _decode(kind: str, data: bytes):
    return OUTPUTS_DECODER.decode(data) if kind.endswith("msgspec") else pickle.loads(data)


def _sender(kind: str, address, c: int, steps: int, k: int | None, result) -> None:
    msgs = [_message(kind, c, s, k) for s in range(steps)]  # built before the clock: the engine's
    if kind.startswith("zmq"):
        import zmq
        ctx = zmq.Context()
        sock = ctx.socket(zmq.PUSH)
        sock.connect(address)
        send = lambda b: sock.send(b, copy=False)
    else:
        send = address.send_bytes
    cpu0 = time.thread_time()
    for m in msgs:
        send(_encode(kind, m))
    result.put((time.thread_time() - cpu0) / steps)
    if kind.startswith("zmq"):
        sock.close(linger=-1)
        ctx.term()


def measure(kind: str, c: int, steps: int, k: int | None) -> dict:
    """One transport's per-step costs in ms."""
    ctx = mp.get_context("spawn")
    result = ctx.Queue()
    if kind.startswith("zmq"):
        import zmq
        zctx = zmq.Context()
        sock = zctx.socket(zmq.PULL)
        address = f"ipc://{tempfile.mkdtemp()}/bench.sock"
        sock.bind(address)
        recv, child_end = lambda: sock.recv(copy=False).buffer, address
    else:
        ours, child_end = ctx.Pipe(duplex=False)
        recv = ours.recv_bytes
    proc = ctx.Process(target=_sender, args=(kind, child_end, c, steps, k, result), daemon=True)
    proc.start()
    first = recv()  # the child is up (its start-up is not the IPC's cost)
    _decode(kind, first)
    cpu0, t0 = time.thread_time(), time.perf_counter()
    for _ in range(steps - 1):
        _decode(kind, recv())
    wall = (time.perf_counter() - t0) / (steps - 1)
    recv_cpu = (time.thread_time() - cpu0) / (steps - 1)
    send_cpu = result.get(timeout=60)
    proc.join(10)
    size = len(_encode(kind, _message(kind, c, 0, k)))
    if kind.startswith("zmq"):
        sock.close()
        zctx.term()
    return {"send_cpu_ms": round(send_cpu * 1e3, 4), "recv_cpu_ms": round(recv_cpu * 1e3, 4),
            "wall_ms_per_step": round(wall * 1e3, 4), "bytes_per_step": size}


def ipc_cost(num_seqs: int, steps: int = 400, logprobs: int | None = None) -> dict:
    out = {}
    for kind in TRANSPORTS:
        r = measure(kind, num_seqs, steps, logprobs)
        out[kind] = r
        print(f"c={num_seqs} logprobs={logprobs} {kind:24s} send {r['send_cpu_ms']:.3f} ms  "
              f"recv+decode {r['recv_cpu_ms']:.3f} ms  wall {r['wall_ms_per_step']:.3f} ms/step  "
              f"{r['bytes_per_step']} B", flush=True)
    return out


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    for c in (64, 256):
        ipc_cost(c)
    ipc_cost(256, logprobs=5)
