"""The host KV tier and long contexts at Llama-3-8B shape (dummy bf16 weights), one H200:

    jaxinfer bench throughput --suite kv-tiers -- --part multiturn --save --merge  # ~4 min
    jaxinfer bench throughput --suite kv-tiers -- --part long --save --merge       # ~3 min, same record
    JAX_PLATFORMS=cpu BENCH_TINY_SHAPES=1 jaxinfer bench throughput --suite kv-tiers -- --part all  # CPU

`multiturn`: N conversations x T turns in G groups, served by C clients; each group shares a
system prompt, each turn sends the conversation so far (system prompt, every earlier question and
answer) plus a new question. A client sends its next turn when its last one finished, taking
turns round-robin over the conversations (every conversation's turn t before any turn t + 1), so
between two turns of one conversation the other N - 1 conversations each take a turn: the device
pool (`--num-blocks`) holds the C turns in flight, but the working set of prefixes (every
conversation's history) is >= 3x it, so without the tier a turn finds its history evicted and
recomputes it. (All N at once instead would make the run capacity-bound: N histories in flight
do not fit the pool whatever the tier does.) Lengths are drawn like ShareGPT chat (lognormal,
medians ~ the dataset's: question 120 tokens (sigma 0.8), answer 220 (sigma 0.6), clipped to
[16, 4x median] and [16, 2x median]); answers are generated with max_tokens = the drawn length
(ignore_eos). The same workload runs twice, `--kv-offload` on and off, each engine with every step
bucket compiled before it starts (the second loads the first one's from a shared executable
cache: a shape compiled lazily inside one timed run and loaded by the other made the tier look
seconds slower) and after a warm-up run of a quarter of the workload on other prompts (never
re-timed): TTFT p50/p99, output tok/s, device and host prefix hit
rates (one lookup per admission), `prefill_over_prompt` (prompt tokens actually computed over
prompt tokens sent: what the hits saved, preemptions' recomputation included) and preemptions.
`kv_host_restore_gbps`: the tier's own host -> device copy (~512 MiB of its host pieces, one
batched device_put as the engine's loads do it), beside `pinned_h2d_gbps`, one plain pinned host
array of the same size device_put in the same run; `kv_host_piece_blocks_mean`: blocks per host
piece. `kv_host_restore_engine_gbps`: the timed run's loads, the pieces' bytes over their
copies' time (dispatch to the copy done, timed by a thread waiting on each step's batch: the
compute queued ahead of a copy included); `kv_host_copy_ms_mean`: that time per step's batch.

`long`: one 131,071-token prompt (llama3 RoPE scaling, factor 8 over 8k) through chunked prefill
(8,192-token chunks), then 64 decode steps at that context (the same request, max_tokens 65):
`prefill_128k_ttft_s` against `prefill_128k_roofline_s` = (2 x the weights a token multiplies
with x tokens + causal attention 2 x 2 x layers x heads x head_dim x tokens^2 / 2) FLOPs over
the best bf16 matmul rate, and `decode_b1x128k_tpot_ms` against `decode_b1x128k_roofline_ms` =
(weights a token reads + 128k tokens of KV) bytes over the best HBM read rate; both rates from
jaxinfer.bench.anchors (best of several kernels, queued), measured first, before any engine takes
the device's memory.
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

from jaxinfer.bench import results_io
from jaxinfer.bench.presets import LLAMA3_8B

TINY = os.environ.get("BENCH_TINY_SHAPES") == "1"
NAME = "kv_tiers_h200"
LONG = 8 * 16 - 1 if TINY else 131071
ROPE_LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
TINY_SHAPE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
              "vocab_size": 512, "torch_dtype": "float32"}
# Workload: (groups, conversations, turns, clients, system prompt tokens, device pool blocks of
# 16): a working set >= 3x the pool, the clients' turns in flight well inside it.
WORK = (2, 24, 3, 4, 32, 48) if TINY else (4, 64, 4, 8, 1024, 1792)
QUESTION, ANSWER = ((12, 0.8), (16, 0.6)) if TINY else ((120, 0.8), (220, 0.6))
# Answers are clipped at 2x their median (12 % of draws): a turn lasts as long as its longest
# answer's decode, and 4x made the run twice as long for the same meaning.
ANSWER_TOP = 2


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


def draw(rng, median_sigma, top: float = 4) -> int:
    median, sigma = median_sigma
    return int(np.clip(rng.lognormal(np.log(median), sigma), 16 if not TINY else 4, top * median))


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


def count_prefill_tokens(engine) -> list[int]:
    """A one-item list the engine's scheduler adds each step's prefill tokens to: prompt tokens
    actually computed (a prefix hit, device or host, skips its tokens; a preemption recomputes)."""
    counter, schedule = [0], engine.scheduler.schedule

    def counting():
        out = schedule()
        counter[0] += sum(e.num_tokens for e in out.prefills)
        return out
    engine.scheduler.schedule = counting
    return counter


def conversations(engine, seed: int, scale: int = 1) -> dict:
    """The multi-turn workload (module docstring; `scale` > 1: 1/scale of the conversations, a
    warm-up); TTFTs, output tokens, wall time, hit rates, prompt tokens computed over prompt
    tokens sent, preemptions."""
    from jaxinfer.sampling_params import SamplingParams
    groups, n, turns, clients, system, _ = WORK
    n //= scale
    vocab = engine.cfg.vocab_size
    prefilled = getattr(engine, "_bench_prefilled", None)
    if prefilled is None:
        prefilled = engine._bench_prefilled = count_prefill_tokens(engine)
    p0, pre0, sent = prefilled[0], engine.scheduler.num_preemptions, 0
    rng = np.random.default_rng(seed)
    sys_prompts = [rng.integers(3, vocab, system).tolist() for _ in range(groups)]
    hist = {c: list(sys_prompts[c % groups]) for c in range(n)}
    todo = [(c, t) for t in range(turns) for c in range(n)]  # round-robin over conversations
    st = engine.scheduler.kv.stats
    q0, h0, hh0 = st.queries, st.hits, st.host_hits
    ttfts, out_tokens, added, in_flight = [], 0, {}, {}

    def send() -> bool:
        """The next turn of a conversation not in flight (n >> clients: the next in order)."""
        i = next((i for i, (c, _) in enumerate(todo) if c not in in_flight.values()), None)
        if i is None:
            return False
        c, t = todo.pop(i)
        hist[c] += rng.integers(3, vocab, draw(rng, QUESTION)).tolist()
        rid = f"s{seed}c{c}t{t}"
        in_flight[rid], added[rid] = c, time.perf_counter()
        engine.add_request(rid, list(hist[c]), SamplingParams(
            temperature=0.0, max_tokens=draw(rng, ANSWER, ANSWER_TOP), ignore_eos=True))
        nonlocal sent
        sent += len(hist[c])
        return True

    t0 = time.perf_counter()
    while len(in_flight) < clients and todo and send():
        pass
    while in_flight:
        for o in engine.step():
            if o.request_id in added and o.outputs[0].token_ids:
                ttfts.append(time.perf_counter() - added.pop(o.request_id))
            if o.finished:
                toks = list(o.outputs[0].token_ids)
                hist[in_flight.pop(o.request_id)] += toks
                out_tokens += len(toks)
                while len(in_flight) < clients and todo and send():
                    pass
    wall = time.perf_counter() - t0
    q = max(st.queries - q0, 1)
    working_set = groups * system + sum(len(h) - system for h in hist.values())  # (unique)
    return dict(ttft_p50_ms=round(1e3 * float(np.percentile(ttfts, 50)), 1),
                ttft_p99_ms=round(1e3 * float(np.percentile(ttfts, 99)), 1),
                out_tok_s=round(out_tokens / wall, 1), wall_s=round(wall, 2),
                device_hit_rate=round((st.hits - h0) / q, 4),
                host_hit_rate=round((st.host_hits - hh0) / q, 4),
                prefill_over_prompt=round((prefilled[0] - p0) / sent, 4),
                preemptions=engine.scheduler.num_preemptions - pre0,
                working_set_tokens=working_set)


def restore_rates(engine) -> dict:
    """The tier's host -> device copy of its own host pieces (~512 MiB of them, slot order, one
    batched device_put as the engine's loads do it) vs one plain pinned array of the same bytes."""
    import jax
    import jax.numpy as jnp
    store = engine.host_kv
    store.flush()  # (every piece in host memory)
    pieces, blocks, want = [], 0, 64 if TINY else (512 << 20) // store.block_bytes
    all_pieces = store.host_arrays()
    for a in all_pieces:
        if blocks >= want:
            break
        pieces.append(a)
        blocks += a.shape[0]
    nbytes = blocks * store.block_bytes

    def best(fn):
        runs = []
        for _ in range(5):
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            runs.append(time.perf_counter() - t0)
        return min(runs)

    device = [a.sharding.with_memory_kind("device") for a in pieces]
    tier_s = best(lambda: jax.device_put(pieces, device))
    plain = jax.device_put(jnp.zeros(nbytes // 2, jnp.bfloat16),
                           device[0].with_memory_kind(store.host_kind))
    plain_s = best(lambda: jax.device_put(plain, device[0]))
    return dict(kv_host_restore_gbps=round(nbytes / tier_s / 1e9, 2),
                pinned_h2d_gbps=round(nbytes / plain_s / 1e9, 2),
                kv_host_restore_over_pinned=round(plain_s / tier_s, 3), restore_bytes=nbytes,
                kv_host_piece_blocks_mean=round(
                    sum(a.shape[0] for a in all_pieces) / max(len(all_pieces), 1), 1))


def load_counters(store) -> tuple[int, float, int]:
    """Host bytes copied to the device, their copies' seconds, and the step batches they took."""
    return store.bytes_copied_to_device, sum(store.copy_seconds), len(store.copy_seconds)


def part_multiturn(tiers: tuple[bool, ...] = (True, False)) -> dict:
    groups, n, turns, clients, system, num_blocks = WORK
    max_len = 8192 if not TINY else 256
    cache_dir = tempfile.mkdtemp(prefix="kv-tiers-xla-")  # the second engine loads the first's
    out = {}
    for offload in tiers:
        engine = make_engine(max_len, num_blocks=num_blocks, kv_offload=offload,
                             kv_host_gib=0.01 if TINY else 24, max_num_seqs=clients,
                             max_num_batched_tokens=256 if TINY else 4096,
                             compilation_cache_dir=cache_dir, warmup=True,
                             background_compile=False)
        if engine.host_kv is not None:  # the tier's gather / scatter shapes
            engine.runner.replace_kv_cache(engine.host_kv.warmup)
        # Warm-up on other prompts (the tier's copies, the timer thread); never re-timed.
        t0 = time.perf_counter()
        conversations(engine, seed=1, scale=4)
        store = engine.host_kv
        before = load_counters(store) if store is not None else None
        t1 = time.perf_counter()
        r = conversations(engine, seed=2)
        print(f"multiturn offload={offload}: warm-up {t1 - t0:.0f} s, timed "
              f"{time.perf_counter() - t1:.0f} s", flush=True)
        tag = "offload" if offload else "no_offload"
        out.update({f"multiturn_{k}_{tag}": v for k, v in r.items()})
        if store is not None:
            time.sleep(0.1)  # (the copy timer thread's last entries)
            nbytes, copy_s, batches = (x - y for x, y in zip(load_counters(store), before))
            # the timed run's loads: bytes over their copies' time (dispatch -> copy done, a
            # thread waiting on each step's batch)
            out["kv_host_restore_engine_gbps"] = round(nbytes / max(copy_s, 1e-9) / 1e9, 2)
            out["kv_host_copy_ms_mean"] = round(1e3 * copy_s / max(batches, 1), 2)
            out["kv_host_load_batches"] = batches
            out.update(restore_rates(engine))
            used = out["kv_host_used_blocks"] = engine.scheduler.kv.host.num_used_slots
            # host memory the pieces hold over the slots in use (> 1: pieces evicted in part)
            out["kv_host_alive_over_used"] = round(
                sum(a.shape[0] for a in store.host_arrays()) / max(used, 1), 3)
        out["device_pool_tokens"] = num_blocks * 16
        del engine, store
        gc.collect()
        print(json.dumps({k: v for k, v in out.items() if k.endswith(tag)}), flush=True)
    if len(tiers) < 2:
        return out
    out["multiturn_working_set_over_pool"] = round(
        out["multiturn_working_set_tokens_offload"] / out["device_pool_tokens"], 2)
    out["multiturn_ttft_p50_ratio"] = round(out["multiturn_ttft_p50_ms_offload"]
                                            / out["multiturn_ttft_p50_ms_no_offload"], 3)
    out["multiturn_out_tok_s_ratio"] = round(out["multiturn_out_tok_s_offload"]
                                             / out["multiturn_out_tok_s_no_offload"], 3)
    return out


def anchor_rates() -> dict:
    """jaxinfer.bench.anchors' best read and matmul rates, measured before any engine takes memory."""
    from jaxinfer.bench import anchors
    r = anchors.measure(tiny=TINY)
    return dict(hbm_tb_s=r["read_tbps"], hbm_read_kernel=r["read_kernel"],
                matmul_tflop_s=r["matmul_tflops"], matmul_shape=r["matmul_shape"])


def part_long(rates: dict) -> dict:
    from jaxinfer.bench.suites.families import decode_read_bytes
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
    bw, flops = rates["hbm_tb_s"] * 1e12, rates["matmul_tflop_s"] * 1e12
    # Prefill: 2 FLOPs per weight a token multiplies with (not the input embedding table) per
    # token, plus causal attention (QK^T and PV over half the square).
    n_params = cfg.num_params() - (0 if cfg.tie_word_embeddings
                                   else cfg.vocab_size * cfg.hidden_size)
    attn = 2 * 2 * cfg.num_layers * cfg.num_heads * cfg.head_dim * LONG ** 2 / 2
    prefill_flops = 2 * n_params * LONG + attn
    # Decode at the 128k context: the weights a token reads and every layer's KV (bf16; fp32 on
    # the CPU check's tiny float32 model: its bytes only matter to the smoke run).
    decode_bytes = decode_read_bytes(cfg, LONG + 32) * (2 if TINY else 1)
    return dict(prefill_128k_tokens=LONG, prefill_128k_ttft_s=round(ttft, 3),
                prefill_128k_roofline_s=round(prefill_flops / flops, 3),
                prefill_128k_over_roofline=round(ttft / (prefill_flops / flops), 3),
                decode_b1x128k_tpot_ms=round(1e3 * tpot, 3),
                decode_b1x128k_roofline_ms=round(1e3 * decode_bytes / bw, 3),
                decode_b1x128k_over_roofline=round(tpot / (decode_bytes / bw), 3), **rates)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", choices=("multiturn", "long", "all"), default="all")
    p.add_argument("--tiers", choices=("both", "on", "off"), default="both",
                   help="multiturn: run the tier on, off or both (the ratios need both)")
    p.add_argument("--merge", action="store_true",
                   help="add this run's metrics to the saved record instead of replacing it")
    results_io.add_save_arg(p, NAME)
    args = p.parse_args(argv)
    if TINY:  # (a stuck CPU check shows where)
        import faulthandler
        faulthandler.dump_traceback_later(600, exit=True)
    metrics = {}
    # The rooflines' anchors first: before any engine takes 90 % of the device memory.
    rates = anchor_rates() if args.part in ("long", "all") else None
    if args.part in ("multiturn", "all"):
        metrics.update(part_multiturn({"both": (True, False), "on": (True,),
                                       "off": (False,)}[args.tiers]))
        print(json.dumps(metrics), flush=True)
    if args.part in ("long", "all"):
        metrics.update(part_long(rates))
    print(json.dumps(metrics, indent=1), flush=True)
    if args.save:
        name = args.name or (NAME if not TINY else "kv_tiers_tiny")
        config = dict(model="Llama-3-8B shape, dummy bf16, llama3 RoPE x8", block_size=16,
                      multiturn=dict(zip(("groups", "conversations", "turns", "clients",
                                          "system_tokens", "device_blocks"), WORK)),
                      question_lognormal=QUESTION, answer_lognormal=ANSWER,
                      answer_max_over_median=ANSWER_TOP, long_tokens=LONG,
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
