"""Does dispatching a step block the host until the device gets there? A conditional on a device
value (`lax.cond`) that XLA runs outside a CUDA graph copies its predicate to the host and waits
for it, so the dispatch returns only once the device has reached it; the host then cannot prepare
the next step while this one runs, and one thread driving two engines (disaggregation) waits on
each in turn.

    PYTHONUNBUFFERED=1 jaxinfer bench latency --suite dispatch-sync -- --save [DIR]
    JAX_PLATFORMS=cpu jaxinfer bench latency --suite dispatch-sync -- --tiny   # CPU check

sections:
  micro   plain jnp: a ~10 ms matmul chain, then a small jit with or without a `lax.cond` (and the
          cond with command buffers off): how long the second dispatch takes to return;
  engine  Llama-3-8B shape, random bf16 weights, one engine per sampler (a subprocess each):
          `built` the sampler as built (its base variant skips the noise under `lax.cond` when
          every row is greedy), `no_cond` that variant without the conditional. Per sampler:
          batch-1 TPOT on the default decode loop and on single steps, and replays of captured
          launches (a batch-1 step, a batch-1 loop, a prefill step): `dispatch_ms` (the launch
          call's wall time, launches back to back) against `period_ms` (per launch, until the
          device is done); dispatch close to period means each launch waited for the device.
Measured on one H200 (dispatch_sync_h200.json): the micro conditional blocks (31 of 32 ms), the
engine's launches do not, with or without the sampler's conditional (prefill 3.4 / 16.1 ms).
Record dispatch_sync_<gpu>; a short table last.
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

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.bench import results_io
from jaxinfer.paths import REPO_ROOT


SAMPLERS = ("built", "no_cond")


def _timed_pair(first, second, reps: int = 5) -> dict:
    """first() then second() dispatched back to back: ms until each call returned, and until the
    device finished; medians of `reps`."""
    jax.block_until_ready(second(first()))
    rows = []
    for _ in range(reps):
        t0 = time.perf_counter()
        y = first()
        t1 = time.perf_counter()
        z = second(y)
        t2 = time.perf_counter()
        jax.block_until_ready(z)
        rows.append((t1 - t0, t2 - t1, time.perf_counter() - t0))
    med = np.median(np.array(rows), axis=0) * 1e3
    return dict(first_dispatch_ms=round(med[0], 3), second_dispatch_ms=round(med[1], 3),
                total_ms=round(med[2], 3))


def micro(tiny: bool) -> dict:
    n = 512 if tiny else 4096
    k = jax.random.key(0)
    w = jax.random.normal(k, (n, n), jnp.bfloat16) / np.sqrt(n)
    x = jax.random.normal(jax.random.fold_in(k, 1), (n, n), jnp.bfloat16)

    @jax.jit
    def chain(w, x):
        for _ in range(4 if tiny else 80):
            x = jnp.tanh(x @ w)
        return x

    def tail(y):
        return jnp.argmax(y, axis=-1).astype(jnp.int32)

    def cond_tail(y):
        return jax.lax.cond(jnp.all(y[:, 0] > 10.0), lambda a: jnp.zeros(a.shape[0], jnp.int32),
                            tail, y)
    variants = {"free": jax.jit(tail), "cond": jax.jit(cond_tail),
                "cond_no_cmdbuf": jax.jit(cond_tail, compiler_options={
                    "xla_gpu_enable_command_buffer": ""})}
    if jax.default_backend() != "gpu":
        del variants["cond_no_cmdbuf"]
    return {name: _timed_pair(lambda: chain(w, x), fn) for name, fn in variants.items()}


# ---- engine section (a subprocess per sampler) ---------------------------------------------------
def _use_branch_free_sampler() -> None:
    """The base variant without its all-greedy conditional (the noise drawn for every row), in
    place of the sampler's `sample`."""
    from jaxinfer.worker import runner, sampler

    def sample(logits, t, variant):
        if variant.masked or variant.advanced:
            return built_sample(logits, t, variant)
        raw = logits
        logits, scaled, greedy = sampler.process_logits(logits, t, variant)
        noise = sampler.row_gumbel(t.seed, t.out_pos, scaled.shape[-1])
        sampled = jnp.argmax(scaled + noise, axis=-1).astype(jnp.int32)
        tokens = jnp.where(greedy, jnp.argmax(logits, axis=-1), sampled).astype(jnp.int32)
        return sampler.SamplerOutput(tokens, sampler.sampled_logprob(raw, tokens), None, None)
    built_sample = sampler.sample
    runner.sample = sample


def replay(runner, args, n: int) -> dict:
    def done():
        jax.block_until_ready((runner.kv_cache, runner.last_tokens))
    runner._launch(*args)
    done()
    t0, c0 = time.perf_counter(), time.thread_time()
    for _ in range(n):
        runner._launch(*args)
    t1, c1 = time.perf_counter(), time.thread_time()
    done()
    t2 = time.perf_counter()
    return dict(dispatch_ms=round(1e3 * (t1 - t0) / n, 3), dispatch_cpu_ms=round(1e3 * (c1 - c0) / n, 3),
                period_ms=round(1e3 * (t2 - t0) / n, 3))


def engine_section(tiny: bool, sampler: str, out_len: int) -> dict:
    if sampler == "no_cond":
        _use_branch_free_sampler()
    from jaxinfer.bench.presets import LLAMA3_8B
    from jaxinfer.bench.suites.llama8b import bs1
    from jaxinfer.engine.args import EngineArgs
    from jaxinfer.engine.llm_engine import LLMEngine
    from jaxinfer.sampling_params import SamplingParams
    from jaxinfer.bench.profile.engine_host_probe import LaunchTimer
    m: dict = {}
    with tempfile.TemporaryDirectory() as work:
        if tiny:
            opts = dict(model=str(REPO_ROOT / "checkpoints" / "demo-target"), dtype="float32",
                        max_model_len=512, max_num_batched_tokens=128, max_num_seqs=4)
            prompt_len, long_len, out_len = 32, 256, min(out_len, 32)
        else:
            (Path(work) / "config.json").write_text(json.dumps(LLAMA3_8B))
            opts = dict(model=work, load_format="dummy", dtype="bfloat16",
                        attention_backend="mosaic", max_model_len=8192,
                        max_num_batched_tokens=2048, max_num_seqs=256)
            prompt_len, long_len = 512, 4096
        t0 = time.perf_counter()
        engine = LLMEngine.from_engine_args(EngineArgs(**opts, num_blocks=4096,
                                                       compilation_cache_dir="", warmup=False))
        rng = np.random.default_rng(0)

        def prompt(n=prompt_len):
            return rng.integers(3, engine.cfg.vocab_size, n).tolist()
        loop_steps = engine.scheduler.decode_steps_per_call
        with LaunchTimer(engine.runner) as cap:
            bs1(engine, prompt(), 16)                      # compiles the loop
            engine.scheduler.decode_steps_per_call = 1
            bs1(engine, prompt(), 16)                      # single steps
            engine.add_request("long", prompt(long_len), SamplingParams(max_tokens=1))
            while engine.has_unfinished_requests():
                engine.step()
        m["engine_ready_s"] = round(time.perf_counter() - t0, 1)
        for path, steps in (("loop", loop_steps), ("step", 1)):
            engine.scheduler.decode_steps_per_call = steps
            runs = [bs1(engine, prompt(), out_len)["tpot_ms"] for _ in range(3)]
            m[f"bs1_{path}_tpot_ms"] = float(np.median(runs))
            m[f"bs1_{path}_tpot_runs_ms"] = runs
        for kind, args in cap.seen.items():
            m[f"replay_{kind}"] = replay(engine.runner, args, 3 if kind == "prefill" else 8)
    return m


def run_engine(tiny: bool, sampler: str, out_len: int, timeout: float) -> dict:
    """engine_section in a subprocess (a fresh process per sampler: the patch is global)."""
    cmd = [sys.executable, "-m", __spec__.name, "--engine-only", sampler, "--out-len", str(out_len)]
    if tiny:
        cmd.append("--tiny")
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                           env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    for line in reversed(p.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    return {"error": (p.stderr or p.stdout)[-2000:]}


def table(m: dict) -> str:
    rows = ["micro (ms)         first  second   total"]
    for name, r in m.get("micro", {}).items():
        rows.append(f"  {name:14} {r['first_dispatch_ms']:7.2f} {r['second_dispatch_ms']:7.2f} "
                    f"{r['total_ms']:7.2f}")
    rows.append("engine        loop_tpot step_tpot | replay dispatch/period ms: step, loop, prefill")
    for s in SAMPLERS:
        e = m.get(f"engine_{s}", {})
        if "error" in e:
            rows.append(f"  {s:6} error: {e['error'][-200:]}")
            continue
        rep = "  ".join(f"{e.get(f'replay_{k}', {}).get('dispatch_ms', float('nan')):.2f}/"
                        f"{e.get(f'replay_{k}', {}).get('period_ms', float('nan')):.2f}"
                        for k in ("step", "loop", "prefill"))
        rows.append(f"  {s:6} {e.get('bs1_loop_tpot_ms', float('nan')):10.3f} "
                    f"{e.get('bs1_step_tpot_ms', float('nan')):9.3f} | {rep}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="small shapes, the demo model (a CPU check)")
    ap.add_argument("--out-len", type=int, default=128)
    ap.add_argument("--samplers", default=",".join(SAMPLERS))
    ap.add_argument("--engine-timeout-s", type=float, default=240)
    ap.add_argument("--engine-only", choices=SAMPLERS, help=argparse.SUPPRESS)
    results_io.add_save_arg(ap, "dispatch_sync_<gpu>")
    args = ap.parse_args(argv)
    if args.engine_only:
        print(json.dumps(engine_section(args.tiny, args.engine_only, args.out_len)), flush=True)
        return
    name = args.name or f"dispatch_sync_{results_io.device_slug()}"
    m = {"micro": micro(args.tiny)}
    print(table(m), flush=True)

    def save():
        if args.save:
            results_io.save(args.save, name, config=dict(
                model="demo" if args.tiny else "Llama-3-8B shape, random bf16",
                out_len=args.out_len, samplers=args.samplers), metrics=m)
    save()
    for s in args.samplers.split(","):
        m[f"engine_{s}"] = run_engine(args.tiny, s, args.out_len, args.engine_timeout_s)
        save()
    print(json.dumps(m))
    print(table(m), flush=True)


if __name__ == "__main__":
    main()
