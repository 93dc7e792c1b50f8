"""The host path's costs per decode step, split the way `jaxinfer serve` now splits them between
its two processes (docs/engine_core.md), for --num-seqs running requests, one new token each:

- core: the engine-core process's output side (tokens -> sequences, scheduler update) building
  token-id diffs (`token_deltas`), against the in-process engine's RequestOutputs
  (`make_request_output`, cumulative copies) on the same steps;
- ipc: one step's `CoreOutputs` encoded, sent over the ZMQ ipc socket, received and decoded
  (ipc_cost.py; the sender's and the receiver's CPU time);
- server: the server process's `RequestState.apply` for every request (detokenize, stop
  strings, the RequestOutputs), with --model's tokenizer (default: the demo model).

    jaxinfer bench throughput --host-path --num-seqs 256 [--logprobs 5] [--save]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from jaxinfer.bench import host_overhead, ipc_cost
from jaxinfer.frontends.core_messages import OUTPUTS_DECODER, OUTPUTS_ENCODER, CoreOutputs
from jaxinfer.frontends.engine_core import token_deltas
from jaxinfer.frontends.output_state import RequestState
from jaxinfer.sampling_params import SamplingParams


def host_path(args: argparse.Namespace) -> dict:
    n, steps = args.num_seqs, args.steps
    core = _core_side(args, n, steps)
    ipc = ipc_cost.measure("zmq+msgspec", n, max(steps, 100), args.logprobs)
    server = _server_side(args, n, steps)
    result = dict(num_seqs=n, steps=steps, **core,
                  ipc_send_cpu_ms=ipc["send_cpu_ms"], ipc_recv_cpu_ms=ipc["recv_cpu_ms"],
                  ipc_wall_ms_per_step=ipc["wall_ms_per_step"], ipc_bytes_per_step=ipc["bytes_per_step"],
                  **server)
    print(f"host path per decode step, {n} requests, logprobs={args.logprobs} (medians of {steps}):"
          f"\n  core output side: {core['core_deltas_ms']:.3f} ms with token diffs, "
          f"{core['core_request_outputs_ms']:.3f} ms with RequestOutputs (in-process engine)"
          f"\n  ipc: send {ipc['send_cpu_ms']:.3f} ms, receive + decode {ipc['recv_cpu_ms']:.3f} ms "
          f"({ipc['bytes_per_step']} B)"
          f"\n  server output side (detokenize, stop strings, RequestOutputs): "
          f"{server['server_outputs_ms']:.3f} ms")
    return result


def _core_side(args, n: int, steps: int) -> dict:
    """The engine's output side per step, with diffs and with RequestOutputs (host_overhead's
    synthetic engine: no device, no tokenizer)."""
    out = {}
    for key, deltas in (("core_deltas_ms", True), ("core_request_outputs_ms", False)):
        timed = host_overhead._host_overhead(
            argparse.Namespace(**{**vars(args), "final_output_only": False}), args.logprobs,
            setup=(lambda engine: engine.emit_token_deltas(token_deltas)) if deltas else None)
        out[key] = timed["process_outputs_ms"]
    return out


def _server_side(args, n: int, steps: int) -> dict:
    from jaxinfer.model.tokenizer import load_tokenizer
    from jaxinfer.frontends.core_messages import ChoiceDelta, CoreOutput
    model = args.model
    tok = load_tokenizer(model)
    rng = np.random.default_rng(0)
    vocab = min(tok.vocab_size, 30000) if hasattr(tok, "vocab_size") else 30000
    params = SamplingParams(temperature=0.8, ignore_eos=True, stop=["\n\n\n"], logprobs=args.logprobs)
    states = [RequestState(f"r{i}", rng.integers(100, vocab, args.input_len).tolist(), params, tok, ())
              for i in range(n)]
    k = args.logprobs or 0
    times = []
    for s in range(steps):
        tokens = rng.integers(100, vocab, n).tolist()
        msg = CoreOutputs([CoreOutput(f"r{i}", [ChoiceDelta(
            0, [tokens[i]], None if args.logprobs is None else [-0.5],
            list(range(k)) if k else None, [-1.0] * k if k else None)]) for i in range(n)])
        msg = OUTPUTS_DECODER.decode(OUTPUTS_ENCODER.encode(msg))  # as the server receives it
        t0 = time.perf_counter()
        for state, core_out in zip(states, msg.outputs):
            state.apply(core_out)
        times.append(1e3 * (time.perf_counter() - t0))
    return {"server_outputs_ms": statistics.median(times),
            "server_outputs_mean_ms": statistics.fmean(times)}

