"""What XLA:GPU's command buffers (CUDA graphs it records itself) do to the host's cost of a step:
the Llama-3-8B-shape engine (dummy bf16, single steps) under each `XLA_FLAGS` variant, one
subprocess per variant: batch-1 TPOT, the engine's host phases per step at batch 1 and at 64 rows
(engine_host_probe), and the launch split into packing, transfer and dispatch (profile_host_step
`launch_costs`).

    python -m jaxinfer.bench.profile.command_buffers [--variants default,off] [--save]
    JAX_PLATFORMS=cpu python -m jaxinfer.bench.profile.command_buffers --tiny --variants default

variants: default (XLA's own choice of commands), off (no command buffers), min1 (graphs of any
size), plus_cf (conditionals, loops and dynamic-slice fusions recorded too, graphs of any size).
Record command_buffers_<gpu> (a one-off probe, not a `jaxinfer bench` suite); a table last.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

VARIANTS = {
    "default": "",
    "off": "--xla_gpu_enable_command_buffer=",
    "min1": "--xla_gpu_graph_min_graph_size=1",
    "plus_cf": "--xla_gpu_enable_command_buffer=+CONDITIONAL,+WHILE,+DYNAMIC_SLICE_FUSION "
               "--xla_gpu_graph_min_graph_size=1",
}
PROBE_KEYS = ("step_ms", "host", "host_ms", "launch_cpu_ms", "dispatch_ms", "dispatch_cpu_ms",
              "compiles")


def bs1_tpot_ms(engine, prompt: list[int], out_len: int) -> float:
    """One greedy request alone: ms between its first and last token, per token."""
    from jaxinfer.sampling_params import SamplingParams
    engine.add_request("bs1", prompt, SamplingParams(temperature=0.0, max_tokens=out_len,
                                                     ignore_eos=True))
    times = []
    while engine.has_unfinished_requests():
        outs = engine.step()
        times += [time.perf_counter()] * sum(len(o.outputs[0].new_token_ids) for o in outs)
    return round(1e3 * (times[-1] - times[0]) / (len(times) - 1), 3)


def child(tiny: bool) -> dict:
    """One variant's figures (XLA_FLAGS already set for this process)."""
    import numpy as np

    from jaxinfer.bench.presets import LLAMA3_8B
    from jaxinfer.bench.profile.engine_host_probe import probe_host
    from jaxinfer.bench.profile.profile_host_step import launch_costs
    from jaxinfer.engine.args import EngineArgs
    from jaxinfer.engine.llm_engine import LLMEngine
    from jaxinfer.paths import DEFAULT_MODEL
    work = Path(tempfile.mkdtemp(prefix="cmdbuf-"))
    (work / "config.json").write_text(json.dumps(LLAMA3_8B))
    model = (dict(model=str(DEFAULT_MODEL), dtype="float32", max_model_len=1024) if tiny else
             dict(model=str(work), load_format="dummy", dtype="bfloat16", max_model_len=2048))
    t0 = time.perf_counter()
    engine = LLMEngine.from_engine_args(EngineArgs(
        **model, max_num_batched_tokens=2048, max_num_seqs=64, num_blocks=2048,
        compilation_cache_dir="", warmup=False, decode_steps_per_call=1))
    rng = np.random.default_rng(0)

    def prompt() -> list[int]:
        return rng.integers(3, engine.cfg.vocab_size, 128).tolist()
    bs1_tpot_ms(engine, prompt(), 16)  # compiles batch 1
    out = {"ready_s": round(time.perf_counter() - t0, 1),
           "bs1_tpot_ms": min(bs1_tpot_ms(engine, prompt(), 64) for _ in range(3))}
    out["bs1"] = {k: v for k, v in probe_host(engine, [prompt()], steps=32).items()
                  if k in PROBE_KEYS}
    probe_host(engine, [prompt() for _ in range(64)], steps=4)  # compiles 64 rows
    out["c64"] = {k: v for k, v in probe_host(engine, [prompt() for _ in range(64)],
                                              steps=24).items() if k in PROBE_KEYS}
    out["launch"] = launch_costs(engine, (1, 8, 64))
    return out


def metrics_of(results: dict[str, dict]) -> dict[str, float]:
    """Per variant `<v>_...` the record's scalar figures: batch-1 TPOT, host and dispatch ms per
    step at batch 1 and 64 rows, and the launch's parts per decode bucket."""
    m: dict[str, float] = {}
    for v, r in results.items():
        if "error" in r:
            continue
        m[f"{v}_bs1_tpot_ms"] = r["bs1_tpot_ms"]
        for run in ("bs1", "c64"):
            for key in ("step_ms", "host_ms", "launch_cpu_ms", "dispatch_cpu_ms"):
                m[f"{v}_{run}_{key}"] = r[run][key]
        for bucket, parts in r.get("launch", {}).items():
            for part, ms in parts.items():
                m[f"{v}_{bucket}_{part}"] = ms
    return m


def table(results: dict[str, dict]) -> str:
    rows = [f"{'variant':9} {'bs1_tpot':>8} {'bs1_host':>8} {'bs1_disp':>8} {'c64_step':>8} "
            f"{'c64_host':>8} {'c64_disp':>8}  (ms; disp: CPU ms of one dispatched step)"]
    for v, r in results.items():
        if "error" in r:
            rows.append(f"{v:9} error: {r['error'][-160:]}")
            continue
        b, c = r["bs1"], r["c64"]
        rows.append(f"{v:9} {r['bs1_tpot_ms']:8.3f} {b['host_ms']:8.3f} {b['dispatch_cpu_ms']:8.3f} "
                    f"{c['step_ms']:8.3f} {c['host_ms']:8.3f} {c['dispatch_cpu_ms']:8.3f}")
    return "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"comma-separated, of {', '.join(VARIANTS)}")
    p.add_argument("--tiny", action="store_true", help="the demo model (a CPU check)")
    p.add_argument("--timeout", type=float, default=150, help="seconds per variant")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    from jaxinfer.bench import results_io
    results_io.add_save_arg(p, "command_buffers_<gpu>")
    args = p.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(args.tiny)), flush=True)
        return
    results = {}
    for v in args.variants.split(","):
        argv = [sys.executable, "-m", __spec__.name, "--child"] + (["--tiny"] if args.tiny else [])
        env = dict(os.environ, XLA_FLAGS=" ".join(filter(None, [os.environ.get("XLA_FLAGS"),
                                                                 VARIANTS[v]])))
        try:
            proc = subprocess.run(argv, env=env, capture_output=True, text=True,
                                  timeout=args.timeout)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            results[v] = (json.loads(lines[-1][7:]) if lines else
                          {"error": (proc.stderr or proc.stdout)[-800:]})
        except subprocess.TimeoutExpired:
            results[v] = {"error": f"timed out after {args.timeout:.0f} s"}
        print(v, json.dumps(results[v]), flush=True)
    if args.save:
        results_io.save(args.save, args.name or f"command_buffers_{results_io.device_slug()}",
                        config={"variants": {v: VARIANTS[v] for v in results}, "tiny": args.tiny,
                                "engine": "Llama-3-8B shape, dummy bf16, single steps, 64 rows "
                                          "at most, every shape compiled before it is timed"},
                        metrics=metrics_of(results))
    print(table(results))


if __name__ == "__main__":
    main()
