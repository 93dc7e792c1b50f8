"""Where the host spends a steady decode step of the engine: cProfile around a few `step()` calls of
running requests, the engine's own phase split (`EngineStats.breakdown_ms`), and the functions
with the most own time.

    from jaxinfer.bench.profile.profile_host_step import profile_host_steps
    summary = profile_host_steps(engine, [prompt_ids] * 256, steps=20)

    JAX_PLATFORMS=cpu python -m jaxinfer.bench.profile.profile_host_step --num-seqs 256   # demo model

The requests are added and stepped until each has its first token (prefill done); then `steps`
engine steps run under the profiler (and, separately, without it: the wall time per step and the
phase split, which the profiler would inflate), and the requests are aborted.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

from jaxinfer.paths import DEFAULT_MODEL
from jaxinfer.bench.profile.trace_engine_step import start_decoding, stop_requests


def top_functions(stats: pstats.Stats, steps: int, top: int) -> dict[str, float]:
    """Own time (ms per step) of the `top` functions with the most of it."""
    rows = []
    for (path, line, name), (_, _, tottime, _, _) in stats.stats.items():
        rows.append((tottime, f"{Path(path).name}:{line}({name})"))
    rows.sort(reverse=True)
    return {label: round(1e3 * t / steps, 3) for t, label in rows[:top]}


def profile_host_steps(engine, prompts: list[list[int]], steps: int = 20, top: int = 25) -> dict:
    """Time `steps` pure-decode steps of len(prompts) running requests, then profile as many."""
    rids = start_decoding(engine, prompts, 2 * steps + 16, "hostprof")
    engine.stats.__init__()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    wall = time.perf_counter() - t0
    phases = engine.stats.breakdown_ms()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        engine.step()
    prof.disable()
    stop_requests(engine, rids)
    stats = pstats.Stats(prof, stream=io.StringIO())
    cumulative = {}
    for (path, line, name), (_, _, _, cumtime, _) in stats.stats.items():
        if name in ("schedule", "execute", "process", "_collect", "result", "build",
                    "_update_gauges", "update_from_output", "_run_step"):
            cumulative[f"{Path(path).name}:{name}"] = round(1e3 * cumtime / steps, 3)
    return dict(num_seqs=len(prompts), steps=steps, ms_per_step=round(1e3 * wall / steps, 3),
                phases_ms=phases, profiled_cumulative_ms=cumulative,
                profiled_top_own_ms=top_functions(stats, steps, top))


def launch_costs(engine, sizes: tuple[int, ...] = (8, 256), reps: int = 20) -> dict:
    """Host milliseconds (median of `reps`) of one all-padding decode step of each bucket size:
    `launch_ms` the runner's whole launch (pack, transfer, forward and sampler dispatched), and its
    parts: `pack_ms` the host inputs into one buffer (transfer._split_packed), `place_ms` that
    buffer's transfer (waited for), `dispatch_ms` the two programs' calls on placed inputs. Run
    with no request in flight: the steps write no KV and emit no token."""
    import statistics

    import jax

    from jaxinfer.parallel import transfer
    from jaxinfer.worker.programs import forward_key
    from jaxinfer.worker.sampler import BASE_SAMPLER
    runner = engine.runner
    out = {}

    def median_ms(fn) -> float:
        jax.block_until_ready((runner.kv_cache, runner.last_tokens))
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        jax.block_until_ready((runner.kv_cache, runner.last_tokens))
        return round(1e3 * statistics.median(times), 3)

    for size in sizes:
        if size not in runner.buckets.decode_buckets:
            continue
        batch = runner.step_batch([], size, size, size, BASE_SAMPLER)  # all padding
        tail = runner.sampling_tail(size)
        placed, apart, packing = transfer.pack_split_step_inputs(batch, runner.plan, tail)

        def dispatch():
            logits, runner.kv_cache, rest = runner.programs.run(
                "packed forward", runner.params, runner.kv_cache, runner.last_tokens, placed,
                key=forward_key(batch), packing=packing.model)
            runner.last_tokens, _ = runner.programs.run(
                "packed sample", logits, runner.last_tokens, rest, apart,
                key=(size, BASE_SAMPLER), packing=packing.sample, variant=BASE_SAMPLER)
        out[f"decode{size}"] = dict(
            launch_ms=median_ms(lambda: runner._run_step(batch, BASE_SAMPLER)),
            pack_ms=median_ms(lambda: transfer._split_packed(batch, tail)),
            place_ms=median_ms(lambda: jax.block_until_ready(
                transfer.pack_split_step_inputs(batch, runner.plan, tail)[0])),
            dispatch_ms=median_ms(dispatch))
    return out


def launch_variants(engine, variants: dict[str, dict], size: int = 256, reps: int = 20) -> dict:
    """The forward of the `size` decode bucket compiled once per XLA option set of `variants`
    (name -> compiler options) and run on an all-padding batch: host ms per dispatch (median) and
    ms per step with `reps` steps queued back to back (the device's pace when the host keeps up).
    Costs one compile per variant. Run with no request in flight."""
    import statistics

    import jax

    from jaxinfer.worker.programs import model_inputs
    from jaxinfer.worker.sampler import BASE_SAMPLER
    runner = engine.runner
    batch = model_inputs(jax.device_put(runner.compiler.padding_batch("decode", size,
                                                                      BASE_SAMPLER)))
    lowered = runner.programs.jitted["forward"].lower(runner.params, runner.kv_cache,
                                                      runner.last_tokens, batch)
    out = {}
    for name, options in variants.items():
        t0 = time.perf_counter()
        exe = lowered.compile(compiler_options=options or None)
        compile_s = time.perf_counter() - t0

        def step():
            _, runner.kv_cache = exe(runner.params, runner.kv_cache, runner.last_tokens, batch)
        step()
        jax.block_until_ready(runner.kv_cache)
        times = []
        t0 = time.perf_counter()
        for _ in range(reps):
            t1 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t1)
        jax.block_until_ready(runner.kv_cache)
        out[name] = dict(launch_ms=round(1e3 * statistics.median(times), 3),
                         step_ms=round(1e3 * (time.perf_counter() - t0) / reps, 3),
                         compile_s=round(compile_s, 1))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--synthetic", action="store_true",
                    help="a one-layer 64-wide model instead (the device's share kept small)")
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    import json

    import numpy as np

    from jaxinfer.engine.args import EngineArgs
    from jaxinfer.engine.llm_engine import LLMEngine
    eargs = EngineArgs(model=args.model, dtype="float32", max_num_seqs=args.num_seqs,
                       max_num_batched_tokens=max(2048, args.num_seqs), max_model_len=512,
                       num_blocks=args.num_seqs * 8 + 64, background_compile=False)
    if args.synthetic:
        import jax
        import jax.numpy as jnp

        from jaxinfer.model.config import config_from_dict
        from jaxinfer.model.transformer import init_params
        cfg = config_from_dict({
            "architectures": ["LlamaForCausalLM"], "vocab_size": 32000, "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4,
            "num_key_value_heads": 2, "max_position_embeddings": 4096, "torch_dtype": "float32"})
        engine = LLMEngine(cfg, init_params(cfg, jax.random.key(0), jnp.float32), None, eargs,
                           num_blocks=eargs.num_blocks)
        engine.warmup(progress=False)
    else:
        engine = LLMEngine.from_engine_args(eargs)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, engine.cfg.vocab_size, args.prompt_len).tolist()
               for _ in range(args.num_seqs)]
    json.dump(dict(profile_host_steps(engine, prompts, args.steps),
                   launch=launch_costs(engine, (8, args.num_seqs))), sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
