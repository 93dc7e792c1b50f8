"""DeepSeek MLA on one GPU, dummy bf16 weights: the latent-cache decode attention against a plain
read of the same bytes, and DeepSeek-V2-Lite's shape through the engine.

    PYTHONUNBUFFERED=1 python -m benchmarks.bench_mla --save            # H200, ~5-8 min
    JAX_PLATFORMS=cpu BENCH_TINY_SHAPES=1 python -m benchmarks.bench_mla  # CPU check

Metrics (all measured in this run):
  mla_decode_b64x4096_frac_of_hbm, mla_decode_b1x32k_frac_of_hbm
           one layer's absorbed decode attention (16 query heads x 576-wide latent, 16-token
           pages, shuffled block tables) over batch x context tokens: latent bytes read / its
           time, over the best plain read rate of as many bytes (benchmarks.anchors' kernels,
           measured before the engine starts; both timed queued back to back). MLA attention
           runs a jnp paged decode (one gather of the pages + einsums:
           pallas_kernels/attention/latent_reference.py) until a Mosaic latent kernel exists,
           so expect well under the issue's 0.8 / 0.7 goals;
  dsv2lite_bs1_tpot_ms   one request, 512 prompt / 256 output tokens, greedy, best of two;
  dsv2lite_bs1_roofline_ms  (weights a decode token reads + its latent cache over the mean
           context) / the best plain-read rate above: weights = every param but the input
           embedding and the routed experts a token does not use (58 of 64);
  dsv2lite_c64_out_tok_s 64 requests at once, 512 / 256, with dsv2lite_c64_prefix_hit_rate;
  dsv2lite_max_concurrent_32k  32,768-token sequences the engine's planned pool holds, beside
           llama3_8b_max_concurrent_32k: Llama-3-8B's 131,072 B/token over the same budget
           (0.9 x device memory - its 16.06 GB of weights - the activation bytes the V2-Lite
           engine reserved).
The timed prompts are random token ids never seen by the warm-up, so no prefix hits.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import results_io
from benchmarks.bench_families import run_requests

TINY = os.environ.get("BENCH_TINY_SHAPES") == "1"

V2_LITE = {
    "architectures": ["DeepseekV2ForCausalLM"], "hidden_size": 2048, "intermediate_size": 10944,
    "kv_lora_rank": 512, "max_position_embeddings": 163840, "moe_intermediate_size": 1408,
    "moe_layer_freq": 1, "n_group": 1, "n_routed_experts": 64, "n_shared_experts": 2,
    "norm_topk_prob": False, "num_attention_heads": 16, "num_experts_per_tok": 6,
    "num_hidden_layers": 27, "num_key_value_heads": 16, "q_lora_rank": None,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-6,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707,
                     "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096,
                     "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 1.0, "scoring_func": "softmax",
    "topk_group": 1, "topk_method": "greedy", "v_head_dim": 128, "vocab_size": 102400,
    "first_k_dense_replace": 1, "torch_dtype": "bfloat16", "bos_token_id": 100000,
    "eos_token_id": 100001,
}
TINY_OVERRIDES = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                      num_attention_heads=4, kv_lora_rank=32, qk_nope_head_dim=16,
                      qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8,
                      num_experts_per_tok=2, moe_intermediate_size=32, vocab_size=512)
LLAMA3_8B_BYTES_PER_TOKEN = 2 * 32 * 8 * 128 * 2
LLAMA3_8B_WEIGHT_BYTES = 16_060_000_000
BLOCK = 16


def decode_attention(batch: int, context: int, heads: int, latent: int, value: int) -> dict:
    """One layer's absorbed decode over a paged latent cache vs the best plain read of as many
    bytes (benchmarks.anchors; both timed queued back to back)."""
    from benchmarks import anchors
    from jaxinfer.model.mla import latent_backend
    from pallas_kernels.attention.backend import REFERENCE
    backend = latent_backend(REFERENCE)
    pages = -(-context // BLOCK)
    read = batch * context * latent * 2
    mib = 1 << 20  # the read kernels reshape to rows of 8192: whole MiB (exact at full size)
    plain = max(anchors.read_rates(-(-read // mib) * mib).values())
    rng = np.random.default_rng(0)
    cache = jnp.asarray(rng.normal(size=(1, batch * pages, BLOCK, latent)), jnp.bfloat16)
    tables = jnp.asarray(rng.permutation(batch * pages).reshape(batch, pages), jnp.int32)
    lens = jnp.full((batch,), context, jnp.int32)
    q = jnp.asarray(rng.normal(size=(batch, heads, latent)), jnp.bfloat16)
    attend = jax.jit(lambda q, c, t, s: backend.decode(q, c, c, t, s, scale=0.1, softcap=None,
                                                       window=None, sinks=None)[..., :value])
    t_mla = anchors.queued_time(lambda _: attend(q, cache, tables, lens), None)
    return {"mla_s": t_mla, "plain_s": read / plain, "frac": read / t_mla / plain,
            "plain_bytes_s": plain}


def decode_read_bytes(cfg, context: float) -> float:
    """Bytes one batch-1 decode step reads: active weights (no input embedding, only the routed
    experts used) and the latent cache over `context` tokens."""
    h = cfg.hidden_size
    params = cfg.num_params() - cfg.vocab_size * h
    moe_layers = sum(cfg.layer_is_moe(i) for i in range(cfg.num_layers))
    params -= moe_layers * (cfg.num_experts - cfg.num_experts_per_tok) * 3 * h * \
        cfg.moe_intermediate_size
    return 2 * params + cfg.num_layers * cfg.head_dim * 2 * context


def engine_metrics(w: dict, rate: float) -> dict:
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

    run_requests(engine, prompts(1, w["prompt"]), 16)  # warm-up: the timed step shapes
    run_requests(engine, prompts(w["seqs"], w["prompt"]), 16)
    tpots = []
    for _ in range(2):
        times = run_requests(engine, prompts(1, w["prompt"]), w["out"])["arrivals"]["q0"]
        tpots.append(1e3 * (times[-1] - times[0]) / (len(times) - 1))
    read = decode_read_bytes(cfg, w["prompt"] + w["out"] / 2)
    stats0 = engine.scheduler.kv_cache_stats()[-1]
    run = run_requests(engine, prompts(w["seqs"], w["prompt"]), w["out"])
    stats = engine.scheduler.kv_cache_stats()[-1]
    n_out = sum(len(t) for t in run["arrivals"].values())
    pool_tokens = engine.num_total_blocks * BLOCK
    metrics = {
        "dsv2lite_bs1_tpot_ms": round(min(tpots), 3),
        "dsv2lite_bs1_tpot_runs_ms": [round(t, 3) for t in tpots],
        "dsv2lite_bs1_roofline_ms": round(1e3 * read / rate, 3),
        "dsv2lite_bs1_read_gb": round(read / 1e9, 3),
        "dsv2lite_c64_out_tok_s": round(n_out / (run["end"] - run["start"]), 1),
        "dsv2lite_c64_prefix_hit_rate": round((stats.hits - stats0.hits)
                                              / max(stats.queries - stats0.queries, 1), 4),
        "dsv2lite_kv_bytes_per_token": cfg.num_layers * cfg.head_dim * 2,
        "dsv2lite_pool_tokens": pool_tokens,
        "dsv2lite_max_concurrent_32k": pool_tokens // 32768,
    }
    if jax.devices()[0].platform != "cpu":
        budget = 0.9 * device_memory_bytes()
        weights = tree_nbytes(engine.runner.params)
        activations = budget - weights - engine.num_total_blocks * kv_bytes_per_block(
            cfg, BLOCK, jnp.bfloat16)
        llama_room = budget - LLAMA3_8B_WEIGHT_BYTES - activations
        metrics["llama3_8b_max_concurrent_32k"] = int(
            llama_room // LLAMA3_8B_BYTES_PER_TOKEN // 32768)
        metrics["llama3_8b_kv_bytes_per_token"] = LLAMA3_8B_BYTES_PER_TOKEN
    return metrics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    results_io.add_save_arg(parser, "mla_<gpu>")
    args = parser.parse_args()
    w = (dict(prompt=24, out=8, seqs=4, shapes=((4, 64), (1, 256)), heads=4, latent=40, value=32)
         if TINY else dict(prompt=512, out=256, seqs=64, shapes=((64, 4096), (1, 32768)),
                           heads=16, latent=576, value=512))
    metrics: dict = {}
    rates = []
    for (batch, context), key in zip(w["shapes"], ("b64x4096", "b1x32k")):
        r = decode_attention(batch, context, w["heads"], w["latent"], w["value"])
        rates.append(r["plain_bytes_s"])
        metrics[f"mla_decode_{key}_frac_of_hbm"] = round(r["frac"], 4)
        metrics[f"mla_decode_{key}_us"] = round(r["mla_s"] * 1e6, 1)
        metrics[f"mla_decode_{key}_plain_read_us"] = round(r["plain_s"] * 1e6, 1)
        print(json.dumps({key: metrics[f"mla_decode_{key}_frac_of_hbm"]}), flush=True)
    rate = max(rates)
    metrics["plain_read_tb_s"] = round(rate / 1e12, 4)
    metrics.update(engine_metrics(w, rate))
    print(json.dumps(metrics, indent=1), flush=True)
    if args.save:
        name = args.name or f"mla_{results_io.device_slug()}"
        results_io.save(args.save, name, config={
            "model": "DeepSeek-V2-Lite shape, dummy bf16 weights" + (" (tiny)" if TINY else ""),
            "decode_heads": w["heads"], "latent_width": w["latent"], "block_size": BLOCK,
            "workload": {k: w[k] for k in ("prompt", "out", "seqs")},
            "mla_attention": "jnp latent decode (no Mosaic latent kernel yet)"},
            metrics=metrics)


if __name__ == "__main__":
    main()
