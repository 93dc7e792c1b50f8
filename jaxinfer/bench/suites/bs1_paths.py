"""The engine's batch-1 TPOT along its host paths, in one engine (issue 26): Llama-3-8B shape, random
weights (`--quantization fp8` by default), the engine's default flags otherwise.

    PYTHONUNBUFFERED=1 jaxinfer bench latency --suite bs1-paths -- --save [DIR]
    JAX_PLATFORMS=cpu jaxinfer bench latency --suite bs1-paths -- --tiny   # CPU check

`--batches 4,8`: also N streams decoded together, single steps against the default loop
(`b<N>_<path>_tpot_ms`, a stream's ms per token).
paths, each `bs1` of bench_engine_llama8b (512-token prompt, `--out-len` greedy tokens; best and
median of RUNS):
  old      single steps, the step's inputs placed by `jax.device_put` of the StepBatch (one copy
           per array), forward and sampler apart, as the engine did before issue 26 (the
           anchor: engine_llama8b_bs1_fp8w_h200.json);
  packed   single steps, the inputs in one packed transfer (transfer.place_step_inputs), then
           forward and sampler apart: three dispatches, as the engine did before issue 65;
  inside   single steps as the engine runs them: one packed transfer, cut inside the forward
           and the sampler (step_programs.packed_forward, packed_sample): two dispatches;
  default  the engine's default: at batch 1 the on-device decode loop (8 steps per call, fixed trip
           count), packed inputs.
`probe_<path>`: profile/engine_host_probe over 32 single steps on each single-step path (host
phases per step, dispatch cost, compiles). Record engine_bs1_paths_<gpu>; a short table last.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

from jaxinfer.bench import results_io
from jaxinfer.bench.presets import LLAMA3_8B
from jaxinfer.bench.suites.llama8b import bs1
from jaxinfer.engine.args import EngineArgs
from jaxinfer.engine.llm_engine import LLMEngine
from jaxinfer.parallel.transfer import place_step_inputs
from jaxinfer.worker.programs import model_inputs
from jaxinfer.bench.profile.engine_host_probe import LaunchTimer, probe_host
from jaxinfer.paths import REPO_ROOT


PATHS = ("old", "packed", "inside", "default")
RUNS = 4  # the H200 host is noisy (single-step runs of one path spread 3.9-5.1 ms): min and median


def tree_put(batch, plan):
    """The placement before the packed transfer: one host-to-device copy per array."""
    return jax.device_put(batch)


def split_step(runner, place):
    """A replacement for the runner's `_run_step`: the step as dispatched before it was one
    program, its inputs placed by `place`, then the forward, then the sampler."""
    def run_step(batch, variant, hidden_reads=None):
        batch = place(batch, runner.plan)
        logits, runner.kv_cache = runner.programs.run(
            "forward", runner.params, runner.kv_cache, runner.last_tokens, model_inputs(batch))
        runner.last_tokens, out = runner.programs.run(
            "sample", logits, runner.last_tokens, batch.sampling, batch.emit_slot,
            variant=variant)
        return out, None
    return run_step


def run(tiny: bool, quantization: str | None, out_len: int, save, batches=()) -> dict:
    metrics: dict = {"quantization": quantization}
    with tempfile.TemporaryDirectory() as work:
        if tiny:
            opts = dict(model=str(REPO_ROOT / "checkpoints" / "demo-target"), dtype="float32",
                        max_model_len=256, max_num_batched_tokens=256, max_num_seqs=4)
            prompt_len, out_len = 32, min(out_len, 64)
        else:
            (Path(work) / "config.json").write_text(json.dumps(LLAMA3_8B))
            opts = dict(model=work, load_format="dummy", dtype="bfloat16",
                        attention_backend="mosaic", max_model_len=2048,
                        max_num_batched_tokens=2048, max_num_seqs=256)
            prompt_len = 512
        metrics["out_len"] = out_len
        t0 = time.perf_counter()
        # No warm-up: the first requests compile what batch 1 uses (the loop too, since
        # without a bucket compiler a loop runs as soon as the scheduler asks for one).
        engine = LLMEngine.from_engine_args(EngineArgs(
            **opts, quantization=quantization, num_blocks=2048, compilation_cache_dir="",
            warmup=False))
        loop_steps = engine.scheduler.decode_steps_per_call
        metrics["default_decode_steps_per_call"] = loop_steps
        rng = np.random.default_rng(0)

        def prompt():
            return rng.integers(3, engine.cfg.vocab_size, prompt_len).tolist()
        bs1(engine, prompt(), 16)  # compiles the loop (and the single step's shapes)
        engine.scheduler.decode_steps_per_call = 1
        bs1(engine, prompt(), 16)
        metrics["engine_ready_s"] = round(time.perf_counter() - t0, 1)
        runner = engine.runner
        for path in PATHS:
            engine.scheduler.decode_steps_per_call = loop_steps if path == "default" else 1
            if path in ("old", "packed"):
                runner._run_step = split_step(runner, tree_put if path == "old"
                                              else place_step_inputs)
            try:
                with LaunchTimer(engine.runner) as launches:
                    runs = [bs1(engine, prompt(), out_len) for _ in range(RUNS)]
                metrics[f"{path}_tpot_ms"] = min(r["tpot_ms"] for r in runs)
                metrics[f"{path}_tpot_median_ms"] = float(np.median([r["tpot_ms"] for r in runs]))
                metrics[f"{path}_tpot_runs_ms"] = [r["tpot_ms"] for r in runs]
                # Which device calls the runs made: a "default" figure from single steps only
                # would mean the loop never ran.
                metrics[f"{path}_launches"] = launches.kinds
                if path != "default":
                    metrics[f"probe_{path}"] = probe_host(engine, [prompt()], steps=32)
            finally:
                runner.__dict__.pop("_run_step", None)  # the method again
            save(metrics)
        for n in batches:  # a few streams at once: single steps against the default loop
            for path in ("inside", "default"):
                engine.scheduler.decode_steps_per_call = loop_steps if path == "default" else 1
                runs = [batch_tpot(engine, [prompt() for _ in range(n)], out_len)
                        for _ in range(2)]
                metrics[f"b{n}_{path}_tpot_ms"] = float(np.median(runs))
                metrics[f"b{n}_{path}_tpot_runs_ms"] = runs
            save(metrics)
    return metrics


def batch_tpot(engine, prompts: list[list[int]], out_len: int) -> float:
    """`prompts` decoded together (all added at once): ms per token of a stream, the median
    over the streams of (last token - first token) / (tokens - 1)."""
    from jaxinfer.bench.suites.llama8b import token_times
    run = token_times(engine, [(p, out_len) for p in prompts], len(prompts))
    return round(float(np.median([1e3 * (t[-1] - t[0]) / (len(t) - 1)
                                  for t in run["arrivals"].values()])), 3)


def table(m: dict) -> str:
    rows = [f"{'path':8} {'tpot_ms':>8} {'launch_ms':>9} {'dispatch_ms':>11} {'step_ms':>8}"]
    for path in PATHS:
        p = m.get(f"probe_{path}", {})
        host = p.get("host", {})
        rows.append(f"{path:8} {m.get(f'{path}_tpot_ms', float('nan')):8.3f} "
                    f"{host.get('launch', float('nan')):9.3f} "
                    f"{p.get('dispatch_ms', float('nan')):11.3f} "
                    f"{p.get('step_ms', float('nan')):8.3f}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="the demo model (a CPU check)")
    ap.add_argument("--quantization", choices=("fp8", "int8", "none"), default="fp8")
    ap.add_argument("--out-len", type=int, default=256)
    ap.add_argument("--batches", default="",
                    help="also time N streams at once, e.g. 4,8 (single steps vs the loop)")
    results_io.add_save_arg(ap, "engine_bs1_paths_<gpu>")
    args = ap.parse_args(argv)
    q = None if args.quantization == "none" else args.quantization
    name = args.name or f"engine_bs1_paths_{results_io.device_slug()}"
    batches = [int(b) for b in args.batches.split(",") if b]
    m = run(args.tiny, q, args.out_len, lambda m: args.save and results_io.save(
        args.save, name, config=dict(model="tiny" if args.tiny else "Llama-3-8B shape, random",
                                     quantization=q, out_len=args.out_len, batches=batches),
        metrics=m), batches)
    print(json.dumps(m))
    print(table(m), flush=True)


if __name__ == "__main__":
    main()
