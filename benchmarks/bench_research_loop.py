"""The engine inside a research loop: rollouts with logprobs, weight updates in place, sleep/wake.

    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/bench_research_loop.py [--save [DIR]]
    JAX_PLATFORMS=cpu PYTHONPATH=. python benchmarks/bench_research_loop.py --tiny   # CPU check

Default: a Llama-3-8B-shaped model (random bf16 weights, `--load-format dummy`) on one GPU, then:
  rollouts        --num-prompts prompts x --output-len tokens (random prompts of --input-len,
                  temperature 1, no EOS), plain `generate` against `generate` with logprobs=0 plus
                  `to_rollout_batch` (the arrays RL code trains on), alternated, best of --repeats,
                  after an untimed plain run of --untimed-len tokens (which compiles whatever
                  warm-up left out: with `--engine '{"warmup": false}'` only the step shapes this
                  workload uses; with a step budget holding every prompt, `"max_num_batched_tokens":
                  32768`, the sequences decode in lockstep: two forward shapes in all); the prefix
                  cache is off, so every run prefills the same way;
  update_weights  from a params pytree already on the device (a bf16 copy of the weights: what a
                  trainer holding bf16 params hands over) and from host numpy (the same weights
                  fetched to the host), each timed to the new weights being ready on the device;
                  the engine's weights are checked to equal what was handed over;
  sleep / wake    device memory in use before and after `sleep()`, and the `wake()` time;
and counts the XLA compilations after the untimed run (0: the updates recompiled nothing).
`--tiny`: the demo model in float32 at a tiny size, to check the script on a CPU.
`--save` writes research_loop_<gpu>.json with llama8b_update_weights_device_s,
llama8b_update_weights_host_s and rollout_logprobs_over_plain (the ratio of throughputs), after
each phase (a run cut short keeps the phases it finished).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import results_io  # noqa: E402
from benchmarks.bench_engine_gpu import LLAMA3_8B  # noqa: E402
from jaxinfer.engine.llm import LLM  # noqa: E402
from jaxinfer.engine.rollout import to_rollout_batch  # noqa: E402
from jaxinfer.sampling_params import SamplingParams  # noqa: E402


T0 = time.perf_counter()
UPDATE_RESERVE_S = 25  # the update and sleep/wake phases at the 8B shape (two host updates)


def bytes_in_use() -> int | None:
    stats = jax.devices()[0].memory_stats()
    return stats.get("bytes_in_use") if stats else None


def live_bytes() -> int:
    return sum(a.nbytes for a in jax.live_arrays() if not a.is_deleted())


def timed_update(llm: LLM, params) -> float:
    t0 = time.perf_counter()
    llm.update_weights(params)
    jax.block_until_ready(llm.engine.runner.params)
    return time.perf_counter() - t0


def same_weights(engine_params, expected) -> bool:
    """The first and last few leaves are equal (fetched whole: slicing on the device would compile)."""
    a, b = jax.tree.leaves(engine_params), jax.tree.leaves(expected)
    return all(np.array_equal(np.asarray(x), np.asarray(y))
               for x, y in zip(a[:3] + a[-3:], b[:3] + b[-3:]))


def rollout_tok_s(llm: LLM, prompts, params: SamplingParams, as_arrays: bool) -> float:
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    if as_arrays:
        batch = to_rollout_batch(outs, max_completion_len=params.max_tokens)
        assert batch.logprobs is not None and batch.completion_mask.all()
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="the demo model, tiny sizes (CPU check)")
    ap.add_argument("--num-prompts", type=int, default=None)
    ap.add_argument("--input-len", type=int, default=None)
    ap.add_argument("--output-len", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--untimed-len", type=int, default=None,
                    help="tokens per prompt of the untimed first run (default: a quarter of "
                         "--output-len; 2 covers every shape when the sequences decode in lockstep)")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="wall seconds the whole run may take: rollout repeats stop early to "
                         f"leave {UPDATE_RESERVE_S} s for the update and sleep phases")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.55,
                    help="KV cache budget: leaves room for a second copy of the weights")
    ap.add_argument("--engine", default="{}",
                    help="engine flags (JSON) over the defaults, e.g. a --compilation-cache-dir "
                         "and the shapes another benchmark's engine compiled, to start warm")
    results_io.add_save_arg(ap, "research_loop_<gpu>")
    args = ap.parse_args()
    n = args.num_prompts or (8 if args.tiny else 256)
    in_len = args.input_len or (16 if args.tiny else 128)
    out_len = args.output_len or (16 if args.tiny else 256)

    compiles = [0]
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, *_, **__: compiles.__setitem__(0, compiles[0] + (
            event == "/jax/core/compile/backend_compile_duration")))
    if args.tiny:
        model, prefix = "checkpoints/demo-target", "demo"
        engine_kw = dict(dtype="float32", max_model_len=in_len + out_len + 16, num_blocks=64,
                         max_num_seqs=n, max_num_batched_tokens=256, warmup=True)
    else:
        model_dir = Path(tempfile.mkdtemp()) / "llama3-8b-shape"
        model_dir.mkdir()
        (model_dir / "config.json").write_text(json.dumps(LLAMA3_8B))
        model, prefix = str(model_dir), "llama8b"
        engine_kw = dict(dtype="bfloat16", load_format="dummy", max_model_len=in_len + out_len + 16,
                         max_num_seqs=n, max_num_batched_tokens=2048,
                         gpu_memory_utilization=args.gpu_memory_utilization, warmup=True)
    # Every bucket compiled before the timings (and the compile count) start. No prefix cache: the
    # runs repeat the same prompts, and cache hits would change every run after the first.
    engine_kw.update(background_compile=False, enable_prefix_caching=False,
                     **json.loads(args.engine))
    t0 = time.perf_counter()
    llm = LLM(model=model, **engine_kw)
    start_s = time.perf_counter() - t0
    engine = llm.engine
    print(f"engine ready in {start_s:.1f} s ({compiles[0]} compilations)", flush=True)
    metrics: dict = {"engine_start_s": round(start_s, 1)}

    def save() -> None:
        if args.save:
            name = args.name or ("research_loop_" + ("tiny_" if args.tiny else "")
                                 + results_io.device_slug())
            results_io.save(args.save, name, metrics=metrics, config=dict(
                model=prefix, num_prompts=n, input_len=in_len, output_len=out_len,
                repeats=args.repeats, engine=engine_kw))

    # -- rollouts with logprobs vs plain generate -----------------------------------------------
    vocab = engine.cfg.vocab_size
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, vocab, in_len).tolist() for _ in range(n)]
    base = dict(temperature=1.0, max_tokens=out_len, ignore_eos=True, seed=0)
    plain_p, lp_p = SamplingParams(**base), SamplingParams(**base, logprobs=0)
    t0 = time.perf_counter()
    # Untimed and shorter: the same step shapes as the timed runs (the same prefill schedule, no
    # prefix-cache hits, sequences finishing in the same order), so it compiles what they use.
    untimed_len = args.untimed_len or max(out_len // 4, 1)
    rollout_tok_s(llm, prompts, SamplingParams(**{**base, "max_tokens": untimed_len}), False)
    metrics["untimed_first_run_s"] = round(time.perf_counter() - t0, 1)
    after_warmup = compiles[0]
    plain, rollout, host_ms = [], [], {"plain": [], "logprobs": []}
    rep_s = 0.0  # the last repeat's duration
    for i in range(args.repeats):
        if args.budget_s and (time.perf_counter() - T0 + 1.2 * rep_s + UPDATE_RESERVE_S
                              > args.budget_s) and i:
            print(f"stopping after {i} repeat(s): --budget-s {args.budget_s}", flush=True)
            break
        rep_s = -time.perf_counter()
        for label, params, runs in (("plain", plain_p, plain), ("logprobs", lp_p, rollout)):
            steps, host_s = engine.stats.steps, engine.stats.host_s
            runs.append(rollout_tok_s(llm, prompts, params, label == "logprobs"))
            host_ms[label].append(round(1e3 * (engine.stats.host_s - host_s)
                                        / max(engine.stats.steps - steps, 1), 2))
        rep_s += time.perf_counter()
    ratio = max(rollout) / max(plain)
    print(f"{n} prompts x {out_len} tokens: plain generate {max(plain):.0f} tok/s, with logprobs "
          f"+ to_rollout_batch {max(rollout):.0f} tok/s: ratio {ratio:.3f} (host ms/step "
          f"{host_ms})", flush=True)
    metrics.update({"rollout_logprobs_over_plain": round(ratio, 4),
                    "rollout_tok_s": round(max(rollout), 1), "plain_tok_s": round(max(plain), 1),
                    "rollout_runs_tok_s": [round(x, 1) for x in rollout],
                    "plain_runs_tok_s": [round(x, 1) for x in plain],
                    "host_ms_per_step": host_ms})
    save()

    # -- update_weights: from the device, then from host numpy --------------------------------
    # The loaded weights as a trainer would hold them: a copy on the device and one in host numpy.
    host = jax.device_get(engine.runner.params)
    on_device = jax.device_put(engine.runner.params, may_alias=False)  # (a copy, no compile)
    jax.block_until_ready(on_device)
    device_s = [timed_update(llm, on_device) for _ in range(args.repeats + 1)]
    ok_device = same_weights(engine.runner.params, on_device)
    del on_device
    metrics.update({f"{prefix}_update_weights_device_s": round(min(device_s), 4),
                    "update_device_runs_s": [round(s, 4) for s in device_s],
                    "update_device_median_s": round(statistics.median(device_s), 4)})
    save()
    host_s = [timed_update(llm, host) for _ in range(args.repeats)]
    ok_host = same_weights(engine.runner.params, host)
    del host
    print(f"update_weights from the device: {min(device_s):.3f} s (runs {device_s}), weights "
          f"{'match' if ok_device else 'DIFFER'}; from host numpy: {min(host_s):.3f} s "
          f"(runs {host_s}), weights {'match' if ok_host else 'DIFFER'}", flush=True)
    metrics.update({f"{prefix}_update_weights_host_s": round(min(host_s), 4),
                    "update_host_runs_s": [round(s, 4) for s in host_s],
                    "weights_match_after_update": ok_device and ok_host,
                    "weights_gib": round(sum(a.nbytes for a in jax.tree.leaves(
                        engine.runner.params)) / 2**30, 3)})
    save()

    # -- sleep / wake ---------------------------------------------------------------------------
    in_use, live = bytes_in_use(), live_bytes()
    engine.sleep()
    freed = (in_use - bytes_in_use()) if in_use is not None else None
    freed_live = live - live_bytes()
    t0 = time.perf_counter()
    engine.wake()
    jax.block_until_ready(engine.runner.kv_cache)
    wake_s = time.perf_counter() - t0
    # Usable after wake (all the prompts, two tokens: the step shapes already compiled).
    rollout_tok_s(llm, prompts, SamplingParams(**{**base, "max_tokens": 2, "logprobs": 0}), True)
    kv_gib = sum(a.nbytes for a in jax.tree.leaves(engine.runner.kv_cache)) / 2**30
    recompiled = compiles[0] - after_warmup
    print(f"sleep freed {freed_live / 2**30:.2f} GiB of live arrays (KV cache {kv_gib:.2f} GiB)"
          + (f", allocator in use -{freed / 2**30:.2f} GiB" if freed is not None else "")
          + f"; wake {wake_s:.3f} s; compilations after the first run: {recompiled}", flush=True)
    metrics.update({
        "sleep_freed_live_gib": round(freed_live / 2**30, 3),
        "sleep_freed_allocator_gib": None if freed is None else round(freed / 2**30, 3),
        "kv_cache_gib": round(kv_gib, 3), "wake_s": round(wake_s, 4),
        "compilations_after_first_run": recompiled})
    save()


if __name__ == "__main__":
    main()
