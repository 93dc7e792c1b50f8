"""DeepSeek MLA on one GPU, dummy bf16 weights: the latent-cache decode attention (the Mosaic
latent decode kernel, and the jnp path it replaced) against a plain read of the same bytes, and
DeepSeek-V2-Lite's shape through the engine.

    PYTHONUNBUFFERED=1 jaxinfer bench throughput --suite mla -- --save            # H200, ~5-8 min
    PYTHONUNBUFFERED=1 jaxinfer bench throughput --suite mla -- --parts kernel --save --merge  # ~2 min
    JAX_PLATFORMS=cpu BENCH_TINY_SHAPES=1 jaxinfer bench throughput --suite mla --  # CPU check

`--parts kernel` / `--parts engine` run one section (`--parts bs1`: the engine's batch-1 figures
alone, ~2 min); `--merge` keeps the saved record's other metrics (read from the --save directory,
else from benchmarks/results).

Metrics (all measured in this run; <key> = b64x4096 or b1x32k):
  mla_decode_<key>_frac_of_hbm
           one layer's absorbed decode attention (16 query heads x 576-wide latent, 16-token
           pages, shuffled block tables) over batch x context tokens, run by the production
           Mosaic latent decode kernel (pallas_kernels/attention/latent_decode_mosaic.py, the
           default config `t64`): latent bytes read / its time, over the best plain read rate
           of as many bytes (jaxinfer.bench.anchors' kernels, measured before the engine starts;
           all timed queued back to back; small inputs are read in turn from copies of 256 MB
           in all, in one jitted call, so none comes from L2 or runs at the host's pace).
           Goals 0.8 / 0.7;
  mla_decode_<key>_<variant>_us / _frac_of_hbm  each kernel config (`KERNEL_VARIANTS`: ring
           slot size, split count, both orientations forced; its splits and orientation in
           `mla_decode_<key>_<variant>_splits` / `_orientation`; `t64` is the production
           default, heads-minor at 16 heads), and
           `mla_decode_<key>_best_variant`;
  mla_decode_<key>_jnp_us / _jnp_frac_of_hbm   the jnp latent decode (latent_reference.py) the
           kernel replaced; mla_decode_<key>_kernel_max_err: max |kernel - jnp| over the value
           columns, over max |jnp| (both bf16);
  dsv2lite_bs1_tpot_ms   one request, 512 prompt / 256 output tokens, greedy, best of two
           (dsv2lite_bs1_prefix_hit_rate: the timed prompts' hits, 0 expected);
  dsv2lite_bs1_roofline_ms  (weights a decode token reads + its latent cache over the mean
           context) / the best plain-read rate above: weights = every param but the input
           embedding and the routed experts a token does not use (58 of 64);
  dsv2lite_c64_out_tok_s 64 requests at once, 512 / 256, with dsv2lite_c64_prefix_hit_rate;
  dsv2lite_bs1_profile   (GPU) 20 traced batch-1 decode steps (jaxinfer/bench/profile/trace_engine_step.py):
           step period, kernel-busy and idle time, kernels per step, the top kernels;
  dsv2lite_max_concurrent_32k  32,768-token sequences the engine's planned pool holds, beside
           llama3_8b_max_concurrent_32k: Llama-3-8B's 131,072 B/token over the same budget
           (0.9 x device memory - its 16.06 GB of weights - the activation bytes the V2-Lite
           engine reserved).
The timed prompts are random token ids never seen by the warm-up, so no prefix hits. On the CPU
the kernel runs in Mosaic GPU's interpreter (a smoke run, not a timing).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.bench import results_io
from jaxinfer.bench.presets import DEEPSEEK_V2_LITE as V2_LITE
from jaxinfer.bench.suites.families import run_requests

TINY = os.environ.get("BENCH_TINY_SHAPES") == "1"

TINY_OVERRIDES = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                      num_attention_heads=4, kv_lora_rank=32, qk_nope_head_dim=16,
                      qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8,
                      num_experts_per_tok=2, moe_intermediate_size=32, vocab_size=512)
LLAMA3_8B_BYTES_PER_TOKEN = 2 * 32 * 8 * 128 * 2
LLAMA3_8B_WEIGHT_BYTES = 16_060_000_000
BLOCK = 16


# Kernel configs timed side by side (LatentDecodeConfig fields; "splits": a split count per
# shape key instead of the planned one). `t64` is the production default: 4 pages (64 tokens)
# per ring slot, 128-byte swizzle (2 slots), heads-minor (S^T = K Q^T) at 16 heads
# (LatentDecodeConfig.heads_minor); both orientations are also timed forced.
KERNEL_VARIANTS = {
    "t64": {},
    "t64_heads_minor": dict(heads_minor=True),  # S^T = K Q^T, the heads on wgmma's N
    "t64_heads_major": dict(heads_minor=False),  # S = Q K^T, heads padded to wgmma's M = 64
    "t32_heads_major": dict(pages_per_step=2, swizzle=64),  # 32-token slots: 4 of them
    "t64_alt_splits": dict(splits={"b64x4096": 4, "b1x32k": 64}),  # planned: 2 / 128
    "t64_alt_splits_heads_major": dict(splits={"b64x4096": 4, "b1x32k": 64}, heads_minor=False),
    "t64_few_splits": dict(splits={"b64x4096": 1, "b1x32k": 32}),
}


def _variant(name: str, key: str, value: int, interpret: bool):
    from pallas_kernels.attention.latent_decode_mosaic import (LatentDecodeConfig,
                                                               latent_decode_mosaic)
    knobs = dict(KERNEL_VARIANTS[name])
    splits = knobs.pop("splits", {}).get(key)
    config = LatentDecodeConfig(**knobs, num_splits=splits if not TINY else splits and 2)
    return config, functools.partial(latent_decode_mosaic, value_width=value, config=config,
                                     interpret=interpret)


def plain_read_rate(nbytes: int) -> float:
    """Bytes/s of the best plain read of `nbytes` (jaxinfer.bench.anchors)."""
    from jaxinfer.bench import anchors
    mib = 1 << 20  # the read kernels reshape to rows of 8192: whole MiB (exact at full size)
    return max(anchors.read_rates(-(-nbytes // mib) * mib).values())


def decode_attention(batch: int, context: int, heads: int, latent: int, value: int,
                     key: str, variants=tuple(KERNEL_VARIANTS)) -> dict:
    """One layer's absorbed decode over a paged latent cache: the jnp path and each kernel
    variant vs the best plain read of as many bytes (jaxinfer.bench.anchors; all timed queued back
    to back). -> metrics."""
    from jaxinfer.bench import anchors
    from pallas_kernels.attention.latent_decode_mosaic import heads_minor, split_plan
    from pallas_kernels.attention.latent_reference import paged_latent_decode
    interpret = jax.devices()[0].platform == "cpu"
    timed = (functools.partial(anchors.queued_time, min_seconds=0.0, reps=1) if interpret
             else anchors.queued_time)
    pages = -(-context // BLOCK)
    read = batch * context * latent * 2
    plain = plain_read_rate(read)
    rng = np.random.default_rng(0)
    # One timed call attends over each of anchors.rotation(read) copies of the pages in turn
    # (a loop over the block tables, each copy's pages its own): b1x32k's 37.7 MB would
    # otherwise stay in L2, and its ~40 us kernel be timed at the host's pace.
    copies = 1 if interpret else anchors.rotation(read)
    cache = jnp.asarray(rng.normal(size=(1, copies * batch * pages, BLOCK, latent)), jnp.bfloat16)
    tables = jnp.asarray(rng.permutation(batch * pages).reshape(batch, pages), jnp.int32)
    lens = jnp.full((batch,), context, jnp.int32)
    q = jnp.asarray(rng.normal(size=(batch, heads, latent)), jnp.bfloat16)
    m = {"plain_read_us": read / plain * 1e6}
    kw = dict(scale=latent ** -0.5, softcap=None, window=None, sinks=None)

    def run(fn) -> tuple[float, jax.Array]:
        attend = jax.jit(lambda q, c, t, s: fn(q, c, c, t, s, **kw)[..., :value])

        @jax.jit
        def attend_copies(q, c, t, s):
            def body(i, acc):
                return acc + fn(q, c, c, t + i * batch * pages, s, **kw)[..., :value]
            return jax.lax.fori_loop(0, copies, body, jnp.zeros((*q.shape[:2], value), q.dtype))
        seconds = timed(lambda _: attend_copies(q, cache, tables, lens), None) / copies
        return seconds, attend(q, cache, tables, lens)

    t_jnp, want = run(paged_latent_decode)
    m.update(jnp_us=t_jnp * 1e6, jnp_frac_of_hbm=read / t_jnp / plain)
    want = np.asarray(want, np.float32)
    for name in variants:
        config, fn = _variant(name, key, value, interpret)
        try:
            t, got = run(fn)
        except Exception as e:  # a config that does not compile costs its keys, not the run
            m[f"{name}_error"] = f"{type(e).__name__}: {e}"[:500]
            print(f"{key} {name}: {m[f'{name}_error']}", flush=True)
            continue
        err = np.abs(np.asarray(got, np.float32) - want).max() / np.abs(want).max()
        splits = split_plan(batch, heads, latent, BLOCK, pages, config).num_splits
        tokens = config.pages_per_step * BLOCK
        m.update({f"{name}_us": t * 1e6, f"{name}_frac_of_hbm": read / t / plain,
                  f"{name}_splits": splits, f"{name}_max_err": float(err),
                  f"{name}_orientation": ("heads_minor" if heads_minor(heads, tokens, config)
                                          else "heads_major")})
    timed_ok = [n for n in variants if f"{n}_us" in m]
    if timed_ok:
        m["best_variant"] = min(timed_ok, key=lambda n: m[f"{n}_us"])
    # The production kernel's figures under the keys (None if it failed: a --merge must
    # not keep an older run's).
    m.update(us=m.get("t64_us"), frac_of_hbm=m.get("t64_frac_of_hbm"),
             kernel_max_err=m.get("t64_max_err"))
    m["plain_bytes_s"] = plain
    return m


def decode_read_bytes(cfg, context: float) -> float:
    """Bytes one batch-1 decode step reads: active weights (no input embedding, only the routed
    experts used) and the latent cache over `context` tokens."""
    h = cfg.hidden_size
    params = cfg.num_params() - cfg.vocab_size * h
    moe_layers = sum(cfg.layer_is_moe(i) for i in range(cfg.num_layers))
    params -= moe_layers * (cfg.num_experts - cfg.num_experts_per_tok) * 3 * h * \
        cfg.moe_intermediate_size
    return 2 * params + cfg.num_layers * cfg.head_dim * 2 * context


def engine_metrics(w: dict, rate: float, full: bool = True) -> dict:
    """The V2-Lite engine's figures; not `full`: batch 1 only (no c = 64, profile or pool)."""
    from jaxinfer.engine.args import EngineArgs
    from jaxinfer.engine.llm_engine import LLMEngine
    from jaxinfer.worker.kv.planner import device_memory_bytes, kv_bytes_per_block, tree_nbytes

    config = {**V2_LITE, **(TINY_OVERRIDES if TINY else {})}
    work = Path(tempfile.mkdtemp(prefix="mla-"))
    (work / "config.json").write_text(json.dumps(config))
    engine = LLMEngine.from_engine_args(EngineArgs(
        model=str(work), load_format="dummy", dtype="bfloat16", max_num_seqs=w["seqs"],
        max_num_batched_tokens=2048, max_model_len=w["prompt"] + w["out"] + 16,
        block_size=BLOCK, gpu_memory_utilization=0.9, warmup=False,
        compilation_cache_dir=None))
    cfg = engine.cfg
    rng = np.random.default_rng(0)

    def prompts(n: int, length: int) -> list[list[int]]:
        return [rng.integers(3, cfg.vocab_size, length).tolist() for _ in range(n)]

    def hit_rate(before, after) -> float:
        return round((after.hits - before.hits) / max(after.queries - before.queries, 1), 4)

    run_requests(engine, prompts(1, w["prompt"]), 16)  # warm-up: the timed step shapes
    tpots = []
    stats0 = engine.scheduler.kv_cache_stats()[-1]
    for _ in range(2):
        times = run_requests(engine, prompts(1, w["prompt"]), w["out"])["arrivals"]["q0"]
        tpots.append(1e3 * (times[-1] - times[0]) / (len(times) - 1))
    bs1_hits = hit_rate(stats0, engine.scheduler.kv_cache_stats()[-1])
    read = decode_read_bytes(cfg, w["prompt"] + w["out"] / 2)
    bs1 = {"dsv2lite_bs1_tpot_ms": round(min(tpots), 3),
           "dsv2lite_bs1_tpot_runs_ms": [round(t, 3) for t in tpots],
           "dsv2lite_bs1_roofline_ms": round(1e3 * read / rate, 3),
           "dsv2lite_bs1_read_gb": round(read / 1e9, 3),
           "dsv2lite_bs1_prefix_hit_rate": bs1_hits}
    if not full:
        return bs1
    run_requests(engine, prompts(w["seqs"], w["prompt"]), 16)
    stats0 = engine.scheduler.kv_cache_stats()[-1]
    run = run_requests(engine, prompts(w["seqs"], w["prompt"]), w["out"])
    stats = engine.scheduler.kv_cache_stats()[-1]
    n_out = sum(len(t) for t in run["arrivals"].values())
    pool_tokens = engine.num_total_blocks * BLOCK
    metrics = {
        **bs1,
        "dsv2lite_c64_out_tok_s": round(n_out / (run["end"] - run["start"]), 1),
        "dsv2lite_c64_prefix_hit_rate": hit_rate(stats0, stats),
        "dsv2lite_kv_bytes_per_token": cfg.num_layers * cfg.head_dim * 2,
        "dsv2lite_pool_tokens": pool_tokens,
        "dsv2lite_max_concurrent_32k": pool_tokens // 32768,
    }
    if jax.devices()[0].platform != "cpu":
        # Where bs1's time goes (docs/MLA.md, "batch-1 gap"): kernels per step, busy vs idle,
        # the top kernels; a diagnostic, the figures above stand without it.
        from jaxinfer.bench.profile.trace_engine_step import profile_decode_steps
        try:
            metrics["dsv2lite_bs1_profile"] = profile_decode_steps(engine,
                                                                   prompts(1, w["prompt"]))
        except Exception as e:
            metrics["dsv2lite_bs1_profile_error"] = repr(e)[:400]
        budget = 0.9 * device_memory_bytes(0.9)
        weights = tree_nbytes(engine.runner.params)
        activations = budget - weights - engine.num_total_blocks * kv_bytes_per_block(
            cfg, BLOCK, jnp.bfloat16)
        llama_room = budget - LLAMA3_8B_WEIGHT_BYTES - activations
        metrics["llama3_8b_max_concurrent_32k"] = int(
            llama_room // LLAMA3_8B_BYTES_PER_TOKEN // 32768)
        metrics["llama3_8b_kv_bytes_per_token"] = LLAMA3_8B_BYTES_PER_TOKEN
    return metrics


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", default="kernel,engine",
                        help="comma-separated sections: kernel (the decode attention), engine, "
                             "bs1 (the engine's batch-1 figures alone)")
    parser.add_argument("--merge", action="store_true",
                        help="keep the saved record's other metrics and config (from the --save "
                             "directory, else benchmarks/results)")
    parser.add_argument("--variants", default=",".join(KERNEL_VARIANTS),
                        help="kernel configs to time (of KERNEL_VARIANTS; t64 is the default's)")
    results_io.add_save_arg(parser, "mla_<gpu>")
    args = parser.parse_args(argv)
    variants = args.variants.split(",")
    if "t64" not in variants or not set(variants) <= set(KERNEL_VARIANTS):
        parser.error(f"--variants {args.variants}: t64 and others of {', '.join(KERNEL_VARIANTS)}")
    parts = set(args.parts.split(","))
    if not parts <= {"kernel", "engine", "bs1"}:
        parser.error(f"--parts {args.parts}: the sections are kernel, engine and bs1")
    w = (dict(prompt=24, out=8, seqs=4, shapes=((2, 64), (1, 128)), heads=8, latent=192,
              value=128) if TINY else
         dict(prompt=512, out=256, seqs=64, shapes=((64, 4096), (1, 32768)), heads=16,
              latent=576, value=512))
    metrics: dict = {}
    config: dict = {}
    if "kernel" in parts:
        rates = []
        for (batch, context), key in zip(w["shapes"], ("b64x4096", "b1x32k")):
            r = decode_attention(batch, context, w["heads"], w["latent"], w["value"], key,
                                 variants)
            rates.append(r.pop("plain_bytes_s"))
            metrics.update({f"mla_decode_{key}_{k}": round(v, 4) if isinstance(v, float) else v
                            for k, v in r.items()})
            print(json.dumps({key: metrics.get(f"mla_decode_{key}_frac_of_hbm")}), flush=True)
        metrics["plain_read_tb_s"] = round(max(rates) / 1e12, 4)
        config.update(decode_heads=w["heads"], latent_width=w["latent"],
                      kernel_variants={v: KERNEL_VARIANTS[v] for v in variants},
                      mla_attention="Mosaic latent decode kernel (latent_decode_mosaic.py)")
    if parts & {"engine", "bs1"}:
        if "plain_read_tb_s" not in metrics:  # the roofline's rate: the larger shape's read
            (batch, context), = w["shapes"][:1]
            metrics["plain_read_tb_s"] = round(
                plain_read_rate(batch * context * w["latent"] * 2) / 1e12, 4)
        metrics.update(engine_metrics(w, metrics["plain_read_tb_s"] * 1e12, "engine" in parts))
        config.update(workload={k: w[k] for k in ("prompt", "out", "seqs")})
    print(json.dumps(metrics, indent=1), flush=True)
    if args.save:
        name = args.name or f"mla_{results_io.device_slug()}"
        config = {"model": "DeepSeek-V2-Lite shape, dummy bf16 weights" + (" (tiny)" if TINY
                                                                           else ""),
                  "block_size": BLOCK, **config}
        if args.merge:
            for base in (Path(args.save), results_io.RESULTS_DIR):
                if (base / f"{name}.json").is_file():
                    old = results_io.load(name, base)
                    if "kernel" in parts:  # no variant of an earlier run beside this run's
                        old["metrics"] = {k: v for k, v in old["metrics"].items()
                                          if not k.startswith("mla_decode_")}
                    metrics, config = {**old["metrics"], **metrics}, {**old["config"], **config}
                    break
        results_io.save(args.save, name, config=config, metrics=metrics)


if __name__ == "__main__":
    main()
