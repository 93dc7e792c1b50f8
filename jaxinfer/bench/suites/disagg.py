"""Prefill/decode disaggregation on two GPUs against two colocated replicas, one process, one run.

    PYTHONUNBUFFERED=1 jaxinfer bench throughput --suite disagg -- [--concurrency 32,64]
        [--input-len 4096] [--output-len 256] [--deadline-s 190] [--save [DIR]]
    jaxinfer bench throughput --suite disagg -- --tiny   # the whole script on 2 CPU devices

A Llama-3-8B-shaped model (dummy bf16 weights, mosaic kernels). Parts, in order; the JSON record
is rewritten after each, and a part that would not fit in what is left of --deadline-s is skipped:
  anchor     `jax.device_put` of a contiguous bf16 buffer GPU 0 -> GPU 1, the size of one
             prompt's KV: the device-to-device copy rate the transfer is judged against;
  transfer   the engine's own transfer of one prompt's blocks (gather on GPU 0, device_put,
             donated scatter into the cache on GPU 1), and its copy alone;
  disagg_cN  the disaggregated engine (prefill on GPU 0, decode on GPU 1): N clients in a closed
             loop, each sending --requests-per-client requests of random prompts one after the
             other (ignore_eos, greedy); an untimed pass of N requests (512 in / 8 out), then the
             timed one: ITL and TTFT p50/p99 (per client-visible token), output tok/s. Both
             engines' background bucket compiles are waited for first (steady state);
  dp2_cN     two colocated replicas (DataParallelEngine), one per GPU, on the same weights and the
             same KV pool size per GPU (the disaggregated engine sleeps meanwhile), same workload.
The disaggregated engine's warm-up compiles both engines' step buckets side by side (max-num-seqs =
the largest concurrency) into an executable cache in a temporary directory; the colocated
replicas, on the same meshes, load theirs from it.
Writes disagg_<device>x2.json (name, date, commit, machine, command, config, metrics).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import tempfile
import time
from pathlib import Path

from jaxinfer.bench import results_io
from jaxinfer.bench.presets import LLAMA3_8B
from jaxinfer.bench.timed_window import TimedWindow
from jaxinfer.paths import REPO_ROOT


# What --tiny changes: the demo model shape on 2 CPU devices, the jnp reference attention.
TINY = dict(input_len=64, output_len=8, concurrency="4,8", backend="reference", requests_per_client=2,
            max_num_batched_tokens=128, deadline_s=1800.0)
WARM_IN, WARM_OUT = 512, 8  # the untimed pass before each timed one: N requests of this shape


def percentiles(values: list[float]) -> tuple[float | None, float | None]:
    import numpy as np
    if not values:
        return None, None
    return (round(1e3 * float(np.percentile(values, 50)), 3),
            round(1e3 * float(np.percentile(values, 99)), 3))


def closed_loop(engine, prompts: list[list[int]], params, concurrency: int, tag: str) -> dict:
    """`concurrency` clients, each sending its next prompt when its previous request finished."""
    queue = list(enumerate(prompts))
    active, added, times = set(), {}, {}
    window = TimedWindow(engine)
    t0 = time.perf_counter()
    while queue or active:
        while queue and len(active) < concurrency:
            i, prompt = queue.pop(0)
            rid = f"{tag}-{i}"
            engine.add_request(rid, prompt, params)
            added[rid] = time.perf_counter()
            active.add(rid)
        outs = engine.step()
        now = time.perf_counter()
        for out in outs:
            n = sum(len(c.new_token_ids) for c in out.outputs)
            times.setdefault(out.request_id, []).extend([now] * n)
            if out.finished:
                active.discard(out.request_id)
    elapsed = time.perf_counter() - t0
    while engine.has_unfinished_requests():  # the overlapped step after the last finish
        engine.step()
    ttft = [times[rid][0] - added[rid] for rid in added if rid in times]
    itl = [b - a for ts in times.values() for a, b in zip(ts, ts[1:])]
    # first -> second token: the disaggregated engine's hand-over (KV transfer) is in this gap
    second = [ts[1] - ts[0] for ts in times.values() if len(ts) > 1]
    tokens = sum(len(ts) for ts in times.values())
    # prompt tokens over the span until the last first token: the prefill rate when it limits
    first_span = max(ts[0] for ts in times.values()) - t0
    (ttft50, ttft99), (itl50, itl99) = percentiles(ttft), percentiles(itl)
    return {"itl_p50_ms": itl50, "itl_p99_ms": itl99, "ttft_p50_ms": ttft50, "ttft_p99_ms": ttft99,
            "second_token_gap_p50_ms": percentiles(second)[0],
            "second_token_gap_p99_ms": percentiles(second)[1],
            "out_tok_s": round(tokens / elapsed, 1), "wall_s": round(elapsed, 2),
            "prompt_tok_s_to_last_first_token": round(sum(map(len, prompts)) / first_span, 1),
            "requests": len(added), "out_tokens": tokens, **window.figures()}


def measure_transfer(engine, num_blocks: int, reps: int = 10) -> dict:
    """The engine's transfer of `num_blocks` blocks beside a plain device_put of as many bytes."""
    import jax
    import jax.numpy as jnp
    t, ids = engine.transfer, list(range(num_blocks))
    src, dst_dev = engine.prefill.runner.kv_cache, engine.decode.runner.plan.mesh.devices.flat[0]

    def timed(fn) -> float:
        fn()  # compiles
        best = float("inf")
        for _ in range(reps):
            start = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - start)
        return best

    nbytes = t.send(src, ids).nbytes
    whole = timed(lambda: setattr(engine.decode.runner, "kv_cache", jax.block_until_ready(
        t.receive(engine.decode.runner.kv_cache, t.send(src, ids), ids))))
    copy = timed(lambda: jax.block_until_ready(t.send(src, ids)))
    landed = jax.block_until_ready(t.send(src, ids))
    scatter = timed(lambda: setattr(engine.decode.runner, "kv_cache", jax.block_until_ready(
        t.receive(engine.decode.runner.kv_cache, landed, ids))))
    plain = jnp.ones((nbytes // 2,), jnp.bfloat16, device=engine.prefill.runner.plan.mesh.devices.flat[0])
    anchor = timed(lambda: jax.block_until_ready(jax.device_put(plain, dst_dev)))
    gbps = round(nbytes / whole / 1e9, 1)
    return {"kv_transfer_bytes_per_prompt": nbytes, "kv_transfer_ms": round(1e3 * whole, 3),
            "kv_transfer_gbps": gbps, "kv_transfer_copy_only_gbps": round(nbytes / copy / 1e9, 1),
            "kv_transfer_scatter_ms": round(1e3 * scatter, 3),
            "device_put_anchor_gbps": round(nbytes / anchor / 1e9, 1),
            "kv_transfer_over_anchor": round(anchor / whole, 3)}


def all_compiled(engines) -> float:
    """Wait until every engine's background bucket compiles are done: the timed passes measure
    steady state, not steps padded into a larger bucket beside compiles holding the host (issue
    27). -> seconds waited."""
    t0 = time.perf_counter()
    for e in engines:
        if e.runner.compiler is not None:
            e.runner.compiler.wait()
    return round(time.perf_counter() - t0, 1)


def _engines(engine) -> dict:
    """The LLMEngines inside a disaggregated or data-parallel engine, by role."""
    if hasattr(engine, "replicas"):
        return {f"replica{i}": e for i, e in enumerate(engine.replicas)}
    return {"prefill": engine.prefill, "decode": engine.decode}


def fresh_stats(engine) -> None:
    """Zero the host-time counters before a timed pass."""
    from jaxinfer.frontends.disaggregated import DriverStats
    from jaxinfer.engine.metrics import EngineStats
    for e in _engines(engine).values():
        e.stats = EngineStats()
    if hasattr(engine, "driver"):
        engine.driver = DriverStats()


def host_phases(engine, tag: str) -> dict:
    """Where the host's time went during a timed pass: each engine's step phases (ms per step:
    schedule, build, launch, wait for tokens, process) and, for the disaggregated engine, its
    driver's phases per driver step (jaxinfer/frontends/disaggregated.py DriverStats). A driver spending
    most of its time in one engine's phase while the other engine's device idles is the stall."""
    out = {f"{tag}_host_{role}": {"steps": e.stats.steps, **e.stats.breakdown_ms()}
           for role, e in _engines(engine).items()}
    if hasattr(engine, "driver"):
        out[f"{tag}_driver"] = engine.driver.per_step_ms()
    return out


def colocated(disagg, args):
    """Two colocated replicas on the disaggregated engine's devices, its weights and pool size."""
    from jaxinfer.disagg.args import role_args
    from jaxinfer.engine.llm_engine import LLMEngine
    from jaxinfer.frontends.data_parallel import DataParallelEngine
    replica_args = role_args(args, "decode")
    return DataParallelEngine([
        LLMEngine(e.cfg, e.runner.params, e.tokenizer, replica_args,
                  num_blocks=e.num_total_blocks, plan=e.runner.plan)
        for e in (disagg.prefill, disagg.decode)])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", default="32,64")
    ap.add_argument("--input-len", type=int, default=4096)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--requests-per-client", type=int, default=2)
    ap.add_argument("--deadline-s", type=float, default=190.0)
    ap.add_argument("--backend", default="mosaic")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048,
                    help="step token budget, also the prefill chunk")
    ap.add_argument("--tiny", action="store_true", help="demo-model shape on 2 CPU devices")
    results_io.add_save_arg(ap)
    a = ap.parse_args(argv)
    start = time.perf_counter()
    if a.tiny:
        os.environ["JAX_PLATFORMS"] = "cpu"
        os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
        for k, v in TINY.items():
            setattr(a, k, v)
    import jax
    import numpy as np

    from jaxinfer.engine.args import EngineArgs
    from jaxinfer.sampling_params import SamplingParams
    concurrencies = [int(c) for c in a.concurrency.split(",")]
    work = Path(tempfile.mkdtemp(prefix="jaxinfer-disagg-"))
    if a.tiny:
        model = str(REPO_ROOT / "checkpoints" / "demo-target")
    else:
        (work / "llama8b").mkdir()
        (work / "llama8b" / "config.json").write_text(json.dumps(LLAMA3_8B))
        model = str(work / "llama8b")
    block, seq_len = 16, a.input_len + a.output_len
    blocks = max(concurrencies) * -(-seq_len // block) + 512
    args = EngineArgs(
        model=model, load_format="dummy", dtype="bfloat16", disaggregate=True,
        attention_backend=a.backend, max_num_seqs=max(concurrencies),
        max_num_batched_tokens=a.max_num_batched_tokens, long_prefill_chunk=a.max_num_batched_tokens,
        max_model_len=seq_len, num_blocks=blocks, block_size=block, warmup=False,
        compilation_cache_dir=str(work / "executables"),
        # single decode steps: the engine's default loop (8 steps a call for <= 8 sequences)
        # delivers tokens 8 at a time, which makes the ITL percentiles describe the bursts
        decode_steps_per_call=1)
    config = {"model": "Llama-3-8B shape" if not a.tiny else "demo-target", "weights": "dummy",
              "dtype": "bfloat16", "attention_backend": a.backend, "input_len": a.input_len,
              "output_len": a.output_len, "concurrency": concurrencies,
              "requests_per_client": a.requests_per_client, "num_blocks_per_gpu": blocks,
              "max_num_batched_tokens": a.max_num_batched_tokens,
              "long_prefill_chunk": a.max_num_batched_tokens, "decode_steps_per_call": 1,
              "disaggregated": "prefill GPU 0 + decode GPU 1, one process",
              "colocated": "DataParallelEngine, one replica per GPU, same weights and pool size",
              "jax": jax.__version__}
    metrics: dict = {}
    name = a.name or f"disagg_{results_io.device_slug()}x2"

    def save(part: str, got: dict) -> None:
        metrics.update(got)
        metrics[f"part_s/{part}"] = round(time.perf_counter() - part_t0, 1)
        print(f"== {part}: {json.dumps(got)}", flush=True)
        if a.save:
            results_io.save(a.save, name, config=config, metrics=metrics)

    def left() -> float:
        return a.deadline_s - (time.perf_counter() - start)

    from jaxinfer.frontends.disaggregated import DisaggregatedEngine
    part_t0 = time.perf_counter()
    disagg = DisaggregatedEngine.from_engine_args(args)
    loaded = time.perf_counter() - part_t0
    warm = disagg.warmup(progress=False)
    ready = {"disagg_decode_buckets_ready_at_start": disagg.decode.runner.compiler.num_ready}
    ready["disagg_compile_wait_s"] = all_compiled((disagg.prefill, disagg.decode))
    save("startup", {"disagg_weights_s": round(loaded, 1), "disagg_warmup_s": round(warm, 1),
                     **ready})
    part_t0 = time.perf_counter()
    save("transfer", measure_transfer(disagg, -(-a.input_len // block)))
    rng = np.random.default_rng(0)
    params = SamplingParams(max_tokens=a.output_len, temperature=0, ignore_eos=True)
    dp = None
    for c in concurrencies:
        prompts = [rng.integers(0, disagg.cfg.vocab_size, a.input_len).tolist()
                   for _ in range(c * a.requests_per_client)]
        warm_prompts = [rng.integers(0, disagg.cfg.vocab_size, min(WARM_IN, a.input_len)).tolist()
                        for _ in range(c)]
        for kind in ("disagg", "dp2"):
            part_t0 = time.perf_counter()
            # the first concurrency's passes, scaled; plus the colocated replicas' set-up
            done = metrics.get(f"run_s/{kind}_c{concurrencies[0]}", 0) * c / concurrencies[0]
            if left() < max(done + 10, 20):
                save(f"{kind}_c{c}", {f"{kind}_c{c}_skipped": "call deadline"})
                continue
            if kind == "disagg":
                if dp is not None:
                    dp.sleep()
                    disagg.wake()
                engine = disagg
            else:
                disagg.sleep()
                if dp is None:
                    dp = colocated(disagg, args)
                    metrics["dp2_warmup_s"] = round(dp.warmup(progress=False), 1)
                    metrics["dp2_compile_wait_s"] = all_compiled(dp.replicas)
                else:
                    dp.wake()
                engine = dp
            run_t0 = time.perf_counter()
            closed_loop(engine, warm_prompts, dataclasses.replace(params, max_tokens=WARM_OUT), c,
                        f"warm{c}")
            fresh_stats(engine)
            got = closed_loop(engine, prompts, params, c, f"timed{c}")
            metrics[f"run_s/{kind}_c{c}"] = round(time.perf_counter() - run_t0, 1)
            out = {f"{kind}_c{c}_{k}": v for k, v in got.items()}
            out.update(host_phases(engine, f"{kind}_c{c}"))
            if kind == "disagg":
                tm = disagg.transfer_metrics
                moved, secs = tm.transfer_bytes._value.get(), tm.transfer_seconds._sum.get()
                out[f"disagg_c{c}_engine_transfer_gbps_host_polled"] = round(moved / secs / 1e9, 1)
                if got["itl_p50_ms"]:
                    out[f"disagg_c{c}_itl_p99_over_p50"] = round(got["itl_p99_ms"]
                                                                 / got["itl_p50_ms"], 2)
            elif f"disagg_c{c}_out_tok_s" in metrics:
                out[f"disagg_over_dp2_c{c}_out_tok_s"] = round(
                    metrics[f"disagg_c{c}_out_tok_s"] / got["out_tok_s"], 3)
            save(f"{kind}_c{c}", out)
    print(json.dumps(metrics, indent=1))


if __name__ == "__main__":
    main()
