"""The engine inside a research loop: rollouts with logprobs, weight updates in place, sleep/wake.

    PYTHONUNBUFFERED=1 jaxinfer bench throughput --suite research-loop -- [--save [DIR]]
    JAX_PLATFORMS=cpu jaxinfer bench throughput --suite research-loop -- --tiny   # CPU check

Default: a Llama-3-8B-shaped model (random bf16 weights, `--load-format dummy`) on one GPU, then
the --parts (default updates,rollouts,sleep; each saved as it finishes, so a run cut short keeps
the parts it finished):
  updates         update_weights from a params pytree already on the device (a bf16 copy of the
                  weights: what a trainer holding bf16 params hands over) and from host numpy (the
                  same weights fetched to the host), each timed to the new weights being ready on
                  the device; the engine's weights are checked to equal what was handed over, and
                  the compilations the updates caused are counted;
  rollouts        --num-prompts prompts x --output-len tokens (random prompts of --input-len,
                  temperature 1, no EOS), plain `generate` against `generate` with logprobs=0 plus
                  `to_rollout_batch` (the arrays RL code trains on), alternated, best of --repeats,
                  after an untimed plain run of --untimed-len tokens (which compiles whatever
                  warm-up left out: with `--engine '{"warmup": false}'` only the step shapes this
                  workload uses; with a step budget holding every prompt, `"max_num_batched_tokens":
                  32768`, the sequences decode in lockstep: two forward shapes in all); the prefix
                  cache is off, so every run prefills the same way; host ms per step of each kind
                  (schedule + build + dispatch, and the output processing);
  sleep           device memory in use before and after `sleep()`, the `wake()` time, and a short
                  rollout after it;
and counts the XLA compilations after the untimed run (with --parts rollouts,updates,sleep, 0
says that the updates made the rollout after them recompile nothing).
`--tiny`: the demo model in float32 at a tiny size, to check the script on a CPU.
`--save` writes research_loop_<gpu>.json with llama8b_update_weights_device_s,
llama8b_update_weights_host_s and rollout_logprobs_over_plain (the ratio of throughputs).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

from jaxinfer.bench import results_io
from jaxinfer.bench.presets import LLAMA3_8B
from jaxinfer.frontends.llm import LLM
from jaxinfer.engine.rollout import to_rollout_batch
from jaxinfer.sampling_params import SamplingParams


T0 = time.perf_counter()
# The parts, in the default order: updates first, as their figures are the quickest to take and
# so land even when --budget-s runs short.
PARTS = ("updates", "rollouts", "sleep")
# What the parts after the rollouts take at the 8B shape (two host updates; wake and one 2-token
# rollout): the rollout repeats leave them this much of --budget-s.
RESERVE_S = {"updates": 15, "sleep": 10}


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


def main(argv: list[str] | None = None) -> None:
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
                         "leave the parts after them their time")
    ap.add_argument("--parts", default=",".join(PARTS),
                    help="the parts to run, in this order (default: %(default)s; "
                         "rollouts,updates,sleep checks that a rollout after the updates "
                         "compiles nothing)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.55,
                    help="KV cache budget: leaves room for a second copy of the weights")
    ap.add_argument("--engine", default="{}",
                    help="engine flags (JSON) over the defaults, e.g. a --compilation-cache-dir "
                         "and the shapes another benchmark's engine compiled, to start warm")
    results_io.add_save_arg(ap, "research_loop_<gpu>")
    args = ap.parse_args(argv)
    parts = args.parts.split(",")
    if not parts or set(parts) - set(PARTS) or len(set(parts)) < len(parts):
        ap.error(f"--parts: a comma-separated list of distinct parts from {','.join(PARTS)}")
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
                repeats=args.repeats, parts=parts, engine=engine_kw))

    vocab = engine.cfg.vocab_size
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, vocab, in_len).tolist() for _ in range(n)]
    base = dict(temperature=1.0, max_tokens=out_len, ignore_eos=True, seed=0)
    after_warmup = None
    for i, part in enumerate(parts):
        if part == "updates":
            updates(llm, args, prefix, compiles, metrics)
        elif part == "rollouts":
            after_warmup = rollouts(llm, args, prompts, base, compiles, metrics,
                                    reserve_s=sum(RESERVE_S[p] for p in parts[i + 1:]))
        else:
            sleep_wake(llm, prompts, base, metrics)
        if after_warmup is not None:
            metrics["compilations_after_first_run"] = compiles[0] - after_warmup
        save()
    if after_warmup is not None:
        print(f"compilations after the first rollout run: {compiles[0] - after_warmup}",
              flush=True)

def updates(llm: LLM, args, prefix: str, compiles: list[int], metrics: dict) -> None:
    """update_weights from the device, then from host numpy; the weights checked after each."""
    engine = llm.engine
    before = compiles[0]
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
    host_s = [timed_update(llm, host) for _ in range(args.repeats)]
    ok_host = same_weights(engine.runner.params, host)
    del host
    print(f"update_weights from the device: {min(device_s):.3f} s (runs {device_s}), weights "
          f"{'match' if ok_device else 'DIFFER'}; from host numpy: {min(host_s):.3f} s "
          f"(runs {host_s}), weights {'match' if ok_host else 'DIFFER'}", flush=True)
    metrics.update({f"{prefix}_update_weights_host_s": round(min(host_s), 4),
                    "update_host_runs_s": [round(s, 4) for s in host_s],
                    "weights_match_after_update": ok_device and ok_host,
                    "update_compilations": compiles[0] - before,
                    "weights_gib": round(sum(a.nbytes for a in jax.tree.leaves(
                        engine.runner.params)) / 2**30, 3)})


def rollouts(llm: LLM, args, prompts, base: dict, compiles: list[int], metrics: dict,
             reserve_s: float) -> int:
    """Plain generate against generate with logprobs=0 plus to_rollout_batch, alternated, best of
    --repeats after an untimed run. Returns the compilation count after the untimed run."""
    engine = llm.engine
    n, out_len = len(prompts), base["max_tokens"]
    plain_p, lp_p = SamplingParams(**base), SamplingParams(**base, logprobs=0)
    t0 = time.perf_counter()
    # Untimed and shorter: the same step shapes as the timed runs (the same prefill schedule, no
    # prefix-cache hits, sequences finishing in the same order), so it compiles what they use.
    untimed_len = args.untimed_len or max(out_len // 4, 1)
    rollout_tok_s(llm, prompts, SamplingParams(**{**base, "max_tokens": untimed_len}), False)
    metrics["untimed_first_run_s"] = round(time.perf_counter() - t0, 1)
    after_warmup = compiles[0]
    plain, rollout = [], []
    host_ms, process_ms = {"plain": [], "logprobs": []}, {"plain": [], "logprobs": []}
    rep_s = 0.0  # the last repeat's duration
    for i in range(args.repeats):
        if args.budget_s and (time.perf_counter() - T0 + 1.2 * rep_s + reserve_s
                              > args.budget_s) and i:
            print(f"stopping after {i} repeat(s): --budget-s {args.budget_s}", flush=True)
            break
        rep_s = -time.perf_counter()
        for label, params, runs in (("plain", plain_p, plain), ("logprobs", lp_p, rollout)):
            st = engine.stats
            steps, host_s, processed, process_s = st.steps, st.host_s, st.processed, st.process_s
            runs.append(rollout_tok_s(llm, prompts, params, label == "logprobs"))
            host_ms[label].append(round(1e3 * (st.host_s - host_s) / max(st.steps - steps, 1), 2))
            # The output side (tokens -> sequences, logprobs kept): where logprobs cost host time.
            process_ms[label].append(round(1e3 * (st.process_s - process_s)
                                           / max(st.processed - processed, 1), 2))
        rep_s += time.perf_counter()
    ratio = max(rollout) / max(plain)
    print(f"{n} prompts x {out_len} tokens: plain generate {max(plain):.0f} tok/s, with logprobs "
          f"+ to_rollout_batch {max(rollout):.0f} tok/s: ratio {ratio:.3f} (host ms/step "
          f"{host_ms}, output processing ms/step {process_ms})", flush=True)
    metrics.update({"rollout_logprobs_over_plain": round(ratio, 4),
                    "rollout_tok_s": round(max(rollout), 1), "plain_tok_s": round(max(plain), 1),
                    "rollout_runs_tok_s": [round(x, 1) for x in rollout],
                    "plain_runs_tok_s": [round(x, 1) for x in plain],
                    "host_ms_per_step": host_ms, "process_ms_per_step": process_ms})
    return after_warmup


def sleep_wake(llm: LLM, prompts, base: dict, metrics: dict) -> None:
    """Device memory freed by sleep(), the wake() time, and a rollout after it."""
    engine = llm.engine
    in_use, live = bytes_in_use(), live_bytes()
    engine.sleep()
    freed = (in_use - bytes_in_use()) if in_use is not None else None
    freed_live = live - live_bytes()
    t0 = time.perf_counter()
    engine.wake()
    jax.block_until_ready(engine.runner.kv_cache)
    wake_s = time.perf_counter() - t0
    # Usable after wake (all the prompts, two tokens: the step shapes already compiled when the
    # rollouts ran).
    rollout_tok_s(llm, prompts, SamplingParams(**{**base, "max_tokens": 2, "logprobs": 0}), True)
    kv_gib = sum(a.nbytes for a in jax.tree.leaves(engine.runner.kv_cache)) / 2**30
    print(f"sleep freed {freed_live / 2**30:.2f} GiB of live arrays (KV cache {kv_gib:.2f} GiB)"
          + (f", allocator in use -{freed / 2**30:.2f} GiB" if freed is not None else "")
          + f"; wake {wake_s:.3f} s", flush=True)
    metrics.update({
        "sleep_freed_live_gib": round(freed_live / 2**30, 3),
        "sleep_freed_allocator_gib": None if freed is None else round(freed / 2**30, 3),
        "kv_cache_gib": round(kv_gib, 3), "wake_s": round(wake_s, 4)})

if __name__ == "__main__":
    main()
