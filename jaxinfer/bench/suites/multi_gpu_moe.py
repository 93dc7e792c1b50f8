"""The multi-GPU suite's `moe_layouts` section: the routed experts of a MoE shape on one GPU and at
TP = 2 in both expert layouts (jaxinfer/parallel/experts.py), the all-reduce included."""

from __future__ import annotations

import functools
import json

MOE_LAYERS = 4  # distinct weights per chained call: each layer's 1.2 GB is read from HBM


def section_moe_layouts(_: dict) -> dict:
    """The routed experts of the Qwen3-30B-A3B shape (128 experts, hidden 2048, expert inter 768,
    top-8; one random router) as the engine runs them, for decode (64 tokens) and prefill (2048):
    one GPU, then TP = 2 with experts split over the GPUs ("ep") and inside every expert ("tp"),
    the all-reduce included. µs per layer over a chain of MOE_LAYERS layers (each layer's input is
    the previous one's output); the relative error of each layout against one GPU."""
    import jax
    import jax.numpy as jnp

    from jaxinfer.bench.suites.moe_engine import QWEN3_30B_A3B
    from jaxinfer.bench.kernel_prefill import bench_interleaved, rel_err
    from jaxinfer.model.config import config_from_dict
    from jaxinfer.model.kernel_table import current_platform, resolve_kernels
    from jaxinfer.parallel.kernels import shard_kernels
    from jaxinfer.parallel.sharding import ShardingPlan, build_mesh

    cfg = config_from_dict(QWEN3_30B_A3B)
    e, h, f, k = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts_per_tok
    shapes = {"w_gate": (e, h, f), "w_up": (e, h, f), "w_down": (e, f, h)}
    out: dict = {}
    for phase, tokens in (("decode", 64), ("prefill", 2048)):
        keys = jax.random.split(jax.random.key(tokens), 2)
        x0 = jax.random.normal(keys[0], (tokens, h), jnp.bfloat16)
        probs = jax.nn.softmax(x0.astype(jnp.float32) @ jax.random.normal(keys[1], (h, e)), -1)
        weights, experts = jax.lax.top_k(probs, k)
        weights = weights / weights.sum(-1, keepdims=True)
        results, calls = {}, {}
        for layout, tp in (("one", 1), ("ep", 2), ("tp", 2)):
            plan = ShardingPlan(build_mesh(tp), cfg, "tp" if layout == "one" else layout)
            rep = plan.replicated
            dispatch = shard_kernels(resolve_kernels(current_platform()), plan).routed_experts
            layers = [tuple(_normal_sharded(jax.random.key(10 * i + j), shapes[n],
                                            plan.param(("layers_0", "moe", n), shapes[n]))
                            for j, n in enumerate(shapes)) for i in range(MOE_LAYERS)]
            args = (jax.device_put(x0, rep), jax.device_put(experts, rep),
                    jax.device_put(weights, rep), layers)

            def chain(x, ex, wt, layers, dispatch=dispatch):
                for w in layers:
                    x = dispatch(x, ex, wt, w)
                return x

            fn = jax.jit(chain)
            results[layout] = jax.device_get(fn(*args))
            calls[layout] = (fn, args)
        times = bench_interleaved(calls, reps=5, inner=5)
        for layout, t in times.items():
            out[f"moe_qwen30b_{phase}_{layout}_us"] = round(t / MOE_LAYERS * 1e6, 1)
            if layout != "one":
                out[f"moe_qwen30b_{phase}_{layout}_rel_err"] = round(
                    rel_err(results[layout], results["one"]), 4)
        print(json.dumps(out), flush=True)
        del calls
    for phase in ("decode", "prefill"):
        ep, tp = out[f"moe_qwen30b_{phase}_ep_us"], out[f"moe_qwen30b_{phase}_tp_us"]
        out[f"moe_qwen30b_{phase}_best_layout"] = "ep" if ep < tp else "tp"
    return out


def _normal_sharded(key, shape, sharding):
    return _normal_fn(shape, sharding)(key)


@functools.lru_cache(maxsize=None)
def _normal_fn(shape, sharding):
    import jax
    import jax.numpy as jnp
    return jax.jit(lambda key: (jax.random.normal(key, shape, jnp.float32)
                                * shape[1] ** -0.5).astype(jnp.bfloat16), out_shardings=sharding)
