"""Embedding throughput: 512-token inputs at batch 256 through the engine's pooling requests
(prefill only, last-token pooling), against the prefill matmul roofline measured in the same run.

    jaxinfer bench throughput --suite embeddings -- [--shape qwen3_0_6b|llama3_8b] [--save [DIR]]
    BENCH_TINY_SHAPES=1 jaxinfer bench throughput --suite embeddings -- --save   # CPU smoke, tiny shapes

Random bf16 weights of the shape (`--load-format dummy`), token-id inputs. One batch of 256 inputs
compiles the steps; a second batch of other random inputs is timed (pooling requests never take
prefix-cache hits: `prefix_hit_rate` 0). An embedding step is one large prefill: `--step-tokens`
(default 16384, 32 inputs) per step, no decode, the pooled sums made on the device.

The roofline is the model's own linear layers alone: every layer's projections (q, k, v, o, gate,
up, down; attention and the embedding lookup left out) as one jitted chain of matmuls over a
step's tokens at the model's shapes, queued back to back (one product timed alone measures its
launch and the clock ramp; jaxinfer/bench/anchors.py), median of 5: `roofline_tokens_s` = step
tokens / that time. Metrics:
`embed_inputs_s`, `embed_512_tokens_s`, `roofline_tokens_s`, `embed_over_roofline` (goal >= 0.7),
`matmul_tflop_s` (the anchor's rate; `matmul_tflops_best`: the best plain bf16 product of
jaxinfer/bench/anchors.py, for comparison), `steps`, `tokens_per_step`, `host_ms_per_step` (the
engine's host phases), `sync_gaps` (steps the device waited for), `prefix_hit_rate`. The record
is embeddings_<device>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.bench import anchors, results_io
from jaxinfer.bench.presets import LLAMA3_8B

QWEN3_EMBEDDING_0_6B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 1024,
    "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16,
    "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151669,
    "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "tie_word_embeddings": True, "torch_dtype": "bfloat16"}
TINY = {
    "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "vocab_size": 512, "max_position_embeddings": 1024, "rms_norm_eps": 1e-6,
    "torch_dtype": "float32"}
SHAPES = {"qwen3_0_6b": QWEN3_EMBEDDING_0_6B, "llama3_8b": LLAMA3_8B}


def linear_layers_s(cfg, tokens: int, dtype) -> float:
    """Seconds of every layer's linear layers over `tokens` tokens at the model's shapes: per layer
    x @ W_qkv, (its q part) @ W_o, @ W_gate_up, (its gate part) @ W_down, chained through the
    layers (one layer's random weights reused: the same FLOPs and shapes, 1/L of the memory), each
    call's output the next one's input, queued back to back (jaxinfer/bench/anchors.py)."""
    h, d, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, qkv = cfg.num_heads * d, (cfg.num_heads + 2 * cfg.num_kv_heads) * d
    experts = cfg.num_experts_per_tok if cfg.num_experts else 1
    keys = jax.random.split(jax.random.key(0), 5)

    def weight(k, shape):
        return (jax.random.normal(k, shape, jnp.float32) / np.sqrt(shape[0])).astype(dtype)
    w = (weight(keys[0], (h, qkv)), weight(keys[1], (q, h)),
         weight(keys[2], (h, 2 * inter * experts)), weight(keys[3], (inter * experts, h)))
    x = jax.random.normal(keys[4], (tokens, h), jnp.float32).astype(dtype)

    @jax.jit
    def layers(x, w_qkv, w_o, w_gu, w_down):
        for _ in range(cfg.num_layers):
            a = (x @ w_qkv)[:, :q] @ w_o
            x = (a @ w_gu)[:, :inter * experts] @ w_down
        return x
    return anchors.queued_time(lambda x: layers(x, *w), x)


def matmul_params(cfg) -> int:
    """Parameters every token multiplies by in its linear layers (attention and MLP projections;
    MoE: the routed experts a token uses)."""
    h, d = cfg.hidden_size, cfg.head_dim
    attn = h * d * (2 * cfg.num_heads + 2 * cfg.num_kv_heads)
    experts = cfg.num_experts_per_tok if cfg.num_experts else 1
    return cfg.num_layers * (attn + 3 * h * cfg.intermediate_size * experts)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3_0_6b")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--step-tokens", type=int, default=16384, help="--max-num-batched-tokens")
    ap.add_argument("--backend", default="mosaic")
    results_io.add_save_arg(ap, "embeddings_<device>")
    args = ap.parse_args(argv)
    tiny = os.environ.get("BENCH_TINY_SHAPES") == "1"
    from jaxinfer.engine.metrics import EngineStats
    from jaxinfer.frontends.llm import LLM
    from jaxinfer.model.config import load_config

    batch, length = (16, 64) if tiny else (args.batch, args.input_len)
    shape = TINY if tiny else SHAPES[args.shape]
    work = Path(tempfile.mkdtemp(prefix="bench_embeddings_"))
    (work / "config.json").write_text(json.dumps(shape))
    opts = dict(model=str(work), load_format="dummy", dtype="float32" if tiny else "bfloat16",
                attention_backend="reference" if tiny else args.backend,
                max_num_seqs=min(batch, 256), max_num_batched_tokens=512 if tiny else args.step_tokens,
                max_model_len=2 * length, compilation_cache_dir=str(work / "cache"),
                warmup=False, background_compile=False)  # the untimed first batch compiles its shapes
    # The anchors first: the engine then takes most of the device memory for its KV cache.
    if not tiny:
        anchors.warm_up()
    best_mm = anchors.matmul_rates(((512, 512, 512),) if tiny else anchors.matmul_rates.__defaults__[0])
    step_tokens = opts["max_num_batched_tokens"]
    anchor_s = linear_layers_s(load_config(work), step_tokens, jnp.float32 if tiny else jnp.bfloat16)
    llm = LLM(**opts)
    cfg = llm.engine.cfg
    rng = np.random.default_rng(0)

    def inputs() -> list[list[int]]:
        return rng.integers(0, cfg.vocab_size, (batch, length)).tolist()

    t0 = time.perf_counter()
    llm.embed(inputs(), use_tqdm=False)  # compiles; other inputs are timed below
    warm_s = time.perf_counter() - t0
    timed = inputs()
    steps0 = llm.engine.runner.num_dispatches
    llm.engine.stats = EngineStats()  # the timed batch's host phases alone
    t0 = time.perf_counter()
    out = llm.embed(timed, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    steps = llm.engine.runner.num_dispatches - steps0
    assert len(out) == batch and all(np.isfinite(v).all() for v in out)
    roofline = step_tokens / anchor_s
    tokens_s = batch * length / elapsed
    metrics = dict(embed_inputs_s=round(batch / elapsed, 2), embed_512_tokens_s=round(tokens_s, 1),
                   roofline_tokens_s=round(roofline, 1), embed_over_roofline=round(tokens_s / roofline, 3),
                   matmul_tflop_s=round(2 * matmul_params(cfg) * step_tokens / anchor_s / 1e12, 3),
                   matmul_tflops_best=round(max(best_mm.values()) / 1e12, 2),
                   matmul_shape_best=max(best_mm, key=best_mm.get),
                   steps=steps, tokens_per_step=round(batch * length / max(steps, 1), 1),
                   host_ms_per_step=llm.engine.stats.breakdown_ms(),
                   sync_gaps=llm.engine.stats.sync_gaps,
                   elapsed_s=round(elapsed, 3), warmup_s=round(warm_s, 1), prefix_hit_rate=0.0)
    print(json.dumps(metrics, indent=1), flush=True)
    if args.save:
        results_io.save(args.save, args.name or f"embeddings_{results_io.device_slug()}",
                        config=dict(shape="tiny" if tiny else args.shape, batch=batch, input_len=length,
                                    pooling="last", engine=opts), metrics=metrics)


if __name__ == "__main__":
    main()
