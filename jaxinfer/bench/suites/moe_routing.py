"""The routing section of jaxinfer/bench/suites/moe.py: one MoE layer's router and dispatch, fused
(the Pallas kernel of pallas_kernels/moe/routing_kernel.py) against unfused (`route`, then the
argsort / bincount / inverse permutation of `sorted_dispatch`), from the hidden states (the gate
GEMM runs before both) to what the grouped matmul takes: weights, experts, rows per expert and the
row permutation both ways (DeepSeek's shared experts among them, as served on one GPU:
model/shared_experts.py). Per model shape at its token counts: the kernel where it fits
(`fits`: its tiles' shared-memory bound; past it no fused figure), so the figures place the
model's default switch to the sort (`MAX_TOKENS`). DeepSeek-V3: 256 experts, sigmoid scores with
a correction bias (random, the same on both sides) and the best 4 of 8 groups, top-8, at 1, 8
and 64 tokens. A step whose two dispatches differ is reported, not timed.
BENCH_TINY_SHAPES=1 (a CPU smoke run): tiny shapes, the kernel in its interpreter."""

from __future__ import annotations

import os
import time

TINY = os.environ.get("BENCH_TINY_SHAPES") == "1"
# experts, hidden, top-k, shared experts (in the stacks, as served on one GPU), and the routing
# rule's config fields beside them.
ROUTING_SHAPES = {
    "qwen3_30b_a3b": (8 if TINY else 128, 64 if TINY else 2048, 8 if not TINY else 2, 0,
                      dict(norm_topk_prob=True)),
    "deepseek_v2_lite": (8 if TINY else 64, 64 if TINY else 2048, 6 if not TINY else 2, 2,
                         dict(norm_topk_prob=False, routed_scaling_factor=1.0)),
    # (MLA's 1e-20 in the renormalisation left out: the bench config has no attention.)
    "deepseek_v3": (16 if TINY else 256, 64 if TINY else 7168, 8 if not TINY else 2, 1,
                    dict(router_scoring="sigmoid", score_correction_bias=True, n_group=8,
                         topk_group=4, norm_topk_prob=True, routed_scaling_factor=2.5)),
}
ROUTING_TOKENS = (1, 8, 64) if TINY else (1, 8, 64, 256, 2048)
# Token counts per model where it differs from ROUTING_TOKENS: DeepSeek-V3's decode steps.
MODEL_TOKENS = {"deepseek_v3": (1, 8, 64)}


def _config(experts: int, hidden: int, top_k: int, fields: dict):
    from jaxinfer.model.config import ModelConfig, RopeConfig

    return ModelConfig(architecture="routing-bench", vocab_size=8, hidden_size=hidden,
                       intermediate_size=8, num_layers=1, num_heads=1, num_kv_heads=1, head_dim=8,
                       rms_norm_eps=1e-6, rope=RopeConfig(), max_position_embeddings=8,
                       num_experts=experts, num_experts_per_tok=top_k, **fields)


def routing_section(deadline: float, save=lambda res: None) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxinfer.bench.kernel_prefill import bench_interleaved
    from jaxinfer.model.experts import inverse_permutation, sorted_dispatch
    from jaxinfer.model.kernel_table import current_platform
    from jaxinfer.model.routing import Router, route, with_shared
    from pallas_kernels.moe.routing_kernel import (MAX_TOKENS, TOKEN_LIMIT, fits,
                                                  shared_memory_bytes)

    start = time.perf_counter()
    fused_router = Router(fused=True, interpret=current_platform().interpret,
                          max_tokens=TOKEN_LIMIT)
    res: dict = {"max_tokens": MAX_TOKENS, "token_limit": TOKEN_LIMIT}
    for model, (e, h, k, shared, fields) in ROUTING_SHAPES.items():
        cfg = _config(e, h, k, dict(fields, n_shared_experts=shared))
        key = jax.random.key(0)
        gate = (jax.random.normal(key, (h, e), jnp.float32) * h ** -0.5).astype(jnp.bfloat16)
        bias = None
        if cfg.score_correction_bias:
            bias = jax.random.normal(jax.random.key(1), (e,), jnp.float32) * 1e-2

        def logits_of(x):
            return jnp.dot(x, gate, preferred_element_type=jnp.float32)

        @jax.jit
        def unfused(x):
            weights, experts = with_shared(*route(cfg, logits_of(x), bias), e, shared)
            sizes, order, rank = sorted_dispatch(experts, e + shared)
            return weights, experts, sizes, order, rank

        @jax.jit
        def fused(x):
            weights, experts, (sizes, rank) = fused_router(cfg, logits_of(x), bias, shared)
            return weights, experts, sizes, inverse_permutation(rank), rank

        for t in MODEL_TOKENS.get(model, ROUTING_TOKENS):
            if time.perf_counter() - start > deadline:
                res[f"{model}_t{t}"] = "skipped: deadline"
                continue
            x = jax.random.normal(jax.random.key(t), (t, h), jnp.float32).astype(jnp.bfloat16)
            calls = {"unfused": (unfused, (x,))}
            row: dict = {"tokens": t}
            if fits(t, e):
                row["fused_shared_memory_bound"] = shared_memory_bytes(t, e)
                got, want = fused(x), unfused(x)
                same = all(np.array_equal(np.asarray(a), np.asarray(b))
                           for a, b in zip(got[1:], want[1:]))
                row["dispatch_identical"] = same
                row["weights_max_abs_diff"] = float(jnp.max(jnp.abs(got[0] - want[0])))
                if same:
                    calls["fused"] = (fused, (x,))
            times = bench_interleaved(calls)
            row.update({f"{name}_us": round(s * 1e6, 2) for name, s in times.items()})
            if "fused_us" in row:
                row["speedup"] = round(row["unfused_us"] / row["fused_us"], 2)
            res[f"{model}_t{t}"] = row
            print(model, row, flush=True)
            save(res)
    return res

