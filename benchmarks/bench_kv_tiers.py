"""The host KV tier and long contexts at Llama-3-8B shape (dummy bf16 weights), one H200:

    python -m benchmarks.bench_kv_tiers --part multiturn --save          # ~4 min
    python -m benchmarks.bench_kv_tiers --part long --save --merge       # ~3 min, same record
    JAX_PLATFORMS=cpu BENCH_TINY_SHAPES=1 python -m benchmarks.bench_kv_tiers --part all  # CPU

`multiturn`: N conversations x T turns in G groups; each group shares a system prompt, each turn
sends the conversation so far (system prompt, every earlier question and answer) plus a new
question, and all conversations' turn t run together. Lengths are drawn like ShareGPT chat
(lognormal, medians ~ the dataset's: question 120 tokens (sigma 0.8), answer 220 (sigma 0.6),
each clipped to [16, 4x median]); answers are generated with max_tokens = the drawn length
(ignore_eos). The device pool is sized down (`--num-blocks`) so the working set of prefixes (every
conversation's last history) is >= 3x it: without the tier most turns recompute their history.
The same workload runs twice, `--kv-offload` on and off, each after a warm-up round on other
prompts (never re-timed): TTFT p50/p99, output tok/s, device and host prefix hit rates.
`kv_host_restore_gbps`: the tier's own host -> device copy (its host blocks, device_put as the
engine does it) of 512 MiB, beside `pinned_h2d_gbps`, one plain pinned host array of the same size
device_put in the same run; `kv_host_restore_engine_gbps`: the engine's loads, bytes over
dispatch-to-seen-landed (bounded by the host's poll, once per step).

`long`: one 131,071-token prompt (llama3 RoPE scaling, factor 8 over 8k) through chunked prefill
(8,192-token chunks), then 64 decode steps at that context (the same request, max_tokens 65):
`prefill_128k_ttft_s` against
`prefill_128k_roofline_s` = (2 x params x tokens + causal attention 2 x 2 x layers x heads x
head_dim x tokens^2 / 2) FLOPs over the bf16 matmul rate measured here (8192^3), and
`decode_b1x128k_tpot_ms` against `decode_b1x128k_roofline_ms` = (weights + 128k tokens of KV)
bytes over the HBM read rate measured here (a 4 GiB sum).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks import results_io
from benchmarks.bench_engine_gpu import LLAMA3_8B

TINY = os.environ.get("BENCH_TINY_SHAPES") == "1"
NAME = "kv_tiers_h200"
LONG = 8 * 16 - 1 if TINY else 131071
ROPE_LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
TINY_SHAPE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
              "vocab_size": 512, "torch_dtype": "float32"}
# Workload: (groups, conversations, turns, system prompt tokens, device pool blocks of 16).
WORK = (2, 8, 3, 32, 16) if TINY else (4, 32, 4, 1024, 896)
QUESTION, ANSWER = ((12, 0.8), (16, 0.6)) if TINY else ((120, 0.8), (220, 0.6))


def model_dir(max_len: int) -> str:
    cfg = {**LLAMA3_8B, "max_position_embeddings": max_len, "rope_scaling": ROPE_LLAMA3,
           **(TINY_SHAPE if TINY else {})}
    d = Path(tempfile.mkdtemp(prefix="kv-tiers-"))
    (d / "config.json").write_text(json.dumps(cfg))
    return str(d)


def make_engine(max_len: int, **kw):
    from jaxinfer.engine.args import EngineArgs
    from jaxinfer.engine.llm_engine import LLMEngine
    opts = dict(model=model_dir(max_len), load_format="dummy",
                dtype="float32" if TINY else "bfloat16", max_model_len=max_len, block_size=16,
                compilation_cache_dir=None, warmup=False, gpu_memory_utilization=0.9)
    return LLMEngine.from_engine_args(EngineArgs(**{**opts, **kw}))


def draw(rng, median_sigma) -> int:
    median, sigma = median_sigma
    return int(np.clip(rng.lognormal(np.log(median), sigma), 16 if not TINY else 4, 4 * median))


def run_batch(engine, prompts: dict[str, tuple[list[int], int]]) -> dict:
    """All at once, greedy, ignore_eos: per request (ttft s, output tokens)."""
    from jaxinfer.sampling_params import SamplingParams
    added, first, outs = {}, {}, {}
    for rid, (p, n) in prompts.items():
        added[rid] = time.perf_counter()
        engine.add_request(rid, p, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    while engine.has_unfinished_requests():
        for o in engine.step():
            now = time.perf_counter()
            first.setdefault(o.request_id, now)
            outs[o.request_id] = list(o.outputs[0].token_ids)
    return {rid: (first[rid] - added[rid], outs[rid]) for rid in prompts}


def conversations(engine, seed: int) -> dict:
    """The multi-turn workload (module docstring); TTFTs, output tokens, wall time, hit rates."""
    groups, n, turns, system, _ = WORK
    vocab = engine.cfg.vocab_size
    rng = np.random.default_rng(seed)
    sys_prompts = [rng.integers(3, vocab, system).tolist() for _ in range(groups)]
    hist = {c: list(sys_prompts[c % groups]) for c in range(n)}
    st = engine.scheduler.kv.stats
    q0, h0, hh0 = st.queries, st.hits, st.host_hits
    ttfts, out_tokens, t0 = [], 0, time.perf_counter()
    for t in range(turns):
        batch = {}
        for c in range(n):
            hist[c] += rng.integers(3, vocab, draw(rng, QUESTION)).tolist()
            batch[f"s{seed}c{c}t{t}"] = (list(hist[c]), draw(rng, ANSWER))
        for rid, (ttft, toks) in run_batch(engine, batch).items():
            ttfts.append(ttft)
            out_tokens += len(toks)
            hist[int(rid.split("c")[1].split("t")[0])] += toks
    wall = time.perf_counter() - t0
    q = max(st.queries - q0, 1)
    working_set = groups * system + sum(len(h) - system for h in hist.values())  # (unique)
    return dict(ttft_p50_ms=round(1e3 * float(np.percentile(ttfts, 50)), 1),
                ttft_p99_ms=round(1e3 * float(np.percentile(ttfts, 99)), 1),
                out_tok_s=round(out_tokens / wall, 1), wall_s=round(wall, 2),
                device_hit_rate=round((st.hits - h0) / q, 4),
                host_hit_rate=round((st.host_hits - hh0) / q, 4),
                working_set_tokens=working_set)


def restore_rates(engine) -> dict:
    """The tier's host -> device copy of its own host blocks vs one plain pinned array."""
    import jax
    import jax.numpy as jnp
    store = engine.host_kv
    blocks = [a for a in map(store.slot_array, range(store.num_slots)) if a is not None]
    want = max(1, min(len(blocks), (64 if TINY else 512 << 20) // store.block_bytes))
    blocks = blocks[:want]
    nbytes = len(blocks) * store.block_bytes

    def best(fn):
        runs = []
        for _ in range(5):
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            runs.append(time.perf_counter() - t0)
        return min(runs)

    device = [b.sharding.with_memory_kind("device") for b in blocks]
    tier_s = best(lambda: jax.device_put(blocks, device))
    plain = jax.device_put(jnp.zeros(nbytes // 2, jnp.bfloat16),
                           device[0].with_memory_kind(store.host_kind))
    plain_s = best(lambda: jax.device_put(plain, device[0]))
    engine_gbps = store.bytes_to_device / max(store.load_seconds, 1e-9) / 1e9
    return dict(kv_host_restore_gbps=round(nbytes / tier_s / 1e9, 2),
                pinned_h2d_gbps=round(nbytes / plain_s / 1e9, 2),
                kv_host_restore_over_pinned=round(plain_s / tier_s, 3),
                kv_host_restore_engine_gbps=round(engine_gbps, 2), restore_bytes=nbytes)


def part_multiturn() -> dict:
    groups, n, turns, system, num_blocks = WORK
    max_len = 8192 if not TINY else 256
    out = {}
    for offload in (True, False):
        engine = make_engine(max_len, num_blocks=num_blocks, kv_offload=offload,
                             kv_host_gib=0.01 if TINY else 32, max_num_seqs=n,
                             max_num_batched_tokens=256 if TINY else 4096)
        if engine.host_kv is not None:  # the tier's gather / scatter shapes
            engine.runner.replace_kv_cache(engine.host_kv.warmup)
        conversations(engine, seed=1)  # warm-up: compiles the step shapes; never re-timed
        r = conversations(engine, seed=2)
        tag = "offload" if offload else "no_offload"
        out.update({f"multiturn_{k}_{tag}": v for k, v in r.items()})
        if offload:
            out.update(restore_rates(engine))
            out["kv_host_used_blocks"] = engine.scheduler.kv.host.num_used_slots
        out["device_pool_tokens"] = num_blocks * 16
        del engine
        gc.collect()
    out["multiturn_working_set_over_pool"] = round(
        out["multiturn_working_set_tokens_offload"] / out["device_pool_tokens"], 2)
    out["multiturn_ttft_p50_ratio"] = round(out["multiturn_ttft_p50_ms_offload"]
                                            / out["multiturn_ttft_p50_ms_no_offload"], 3)
    out["multiturn_out_tok_s_ratio"] = round(out["multiturn_out_tok_s_offload"]
                                             / out["multiturn_out_tok_s_no_offload"], 3)
    return out


def rates() -> tuple[float, float]:
    """(HBM read bytes/s from a 4 GiB sum, bf16 matmul FLOP/s from 8192^3), best of 5."""
    import jax
    import jax.numpy as jnp

    def best(fn, *args):
        jax.block_until_ready(fn(*args))
        runs = []
        for _ in range(5):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            runs.append(time.perf_counter() - t0)
        return min(runs)
    size, m = (1 << 22, 256) if TINY else (1 << 31, 8192)
    x = jnp.ones((size,), jnp.bfloat16)
    bw = x.nbytes / best(jax.jit(lambda a: jnp.sum(a, dtype=jnp.float32)), x)
    del x
    a = jnp.ones((m, m), jnp.bfloat16)
    return bw, 2 * m ** 3 / best(jax.jit(lambda p, q: p @ q), a, a)


def part_long() -> dict:
    from jaxinfer.parallel.sharding import per_device_bytes
    max_len = LONG + 1 + 64
    chunk = 64 if TINY else 8192
    engine = make_engine(max_len, num_blocks=-(-max_len // 16) + 8, max_num_seqs=2,
                         max_num_batched_tokens=chunk, long_prefill_chunk=chunk,
                         enable_prefix_caching=False)
    cfg, vocab = engine.cfg, engine.cfg.vocab_size
    rng = np.random.default_rng(0)
    run_batch(engine, {"warm": (rng.integers(3, vocab, 2 * chunk + 5).tolist(), 8)})
    # One request: its first token is the prefill's (TTFT), the next 64 decode at 128k context.
    from jaxinfer.sampling_params import SamplingParams
    t0 = time.perf_counter()
    engine.add_request("long", rng.integers(3, vocab, LONG).tolist(),
                       SamplingParams(temperature=0.0, max_tokens=65, ignore_eos=True))
    times = []
    while engine.has_unfinished_requests():
        for o in engine.step():
            times += [time.perf_counter()] * len(o.outputs[0].new_token_ids)
    ttft = times[0] - t0
    tpot = (times[-1] - times[0]) / (len(times) - 1)
    weights = per_device_bytes(engine.runner.params)
    bw, flops = rates()
    n_params = weights / (4 if TINY else 2)
    attn = 2 * 2 * cfg.num_layers * cfg.num_heads * cfg.head_dim * LONG ** 2 / 2
    prefill_flops = 2 * n_params * LONG + attn
    kv = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2 * LONG
    return dict(prefill_128k_tokens=LONG, prefill_128k_ttft_s=round(ttft, 3),
                prefill_128k_roofline_s=round(prefill_flops / flops, 3),
                prefill_128k_over_roofline=round(ttft / (prefill_flops / flops), 3),
                decode_b1x128k_tpot_ms=round(1e3 * tpot, 3),
                decode_b1x128k_roofline_ms=round(1e3 * (weights + kv) / bw, 3),
                decode_b1x128k_over_roofline=round(tpot / ((weights + kv) / bw), 3),
                hbm_tb_s=round(bw / 1e12, 3), matmul_tflop_s=round(flops / 1e12, 1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", choices=("multiturn", "long", "all"), default="all")
    p.add_argument("--merge", action="store_true",
                   help="add this run's metrics to the saved record instead of replacing it")
    results_io.add_save_arg(p, NAME)
    args = p.parse_args()
    if TINY:  # (a stuck CPU check shows where)
        import faulthandler
        faulthandler.dump_traceback_later(600, exit=True)
    metrics = {}
    if args.part in ("multiturn", "all"):
        metrics.update(part_multiturn())
        print(json.dumps(metrics), flush=True)
    if args.part in ("long", "all"):
        metrics.update(part_long())
    print(json.dumps(metrics, indent=1), flush=True)
    if args.save:
        name = args.name or (NAME if not TINY else "kv_tiers_tiny")
        config = dict(model="Llama-3-8B shape, dummy bf16, llama3 RoPE x8", block_size=16,
                      multiturn=dict(zip(("groups", "conversations", "turns", "system_tokens",
                                          "device_blocks"), WORK)),
                      question_lognormal=QUESTION, answer_lognormal=ANSWER, long_tokens=LONG,
                      tiny=TINY)
        if args.merge:
            try:
                old = results_io.load(name, args.save)
                metrics = {**old["metrics"], **metrics}
                config = {**old["config"], **config}
            except FileNotFoundError:
                pass
        results_io.save(args.save, name, config=config, metrics=metrics)


if __name__ == "__main__":
    main()
