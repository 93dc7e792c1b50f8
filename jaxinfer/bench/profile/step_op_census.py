"""What one batch-1 decode step is made of: the primitives of the jitted step's jaxpr (every
nested call expanded, as it runs), for DeepSeek-V2-Lite's shape beside a Llama-3-8B shape with
the same layer count, both with the H200's kernel table (`resolve_kernels` for a Hopper GPU: the
Mosaic backend's latent / paged decode, the Triton add + RMSNorm, two-row GEMMs; the Mosaic
grouped matmul for the experts, which `--moe-impl auto` picks at batch 1 on Hopper). Traced on
the CPU with abstract weights (nothing is allocated).

    python -m jaxinfer.bench.profile.step_op_census [--context 768] [--json]

The count is a proxy for launched kernels: on the GPU, XLA fuses elementwise ops into their
neighbours but gives (nearly) every matmul, reduction, gather / scatter, sort / top-k and Pallas
call a kernel of its own.
"""

from __future__ import annotations

import argparse
import collections
import json

# One launched kernel each (a Pallas call; a Mosaic GPU kernel is an mpmd_map): not expanded.
_KERNELS = ("pallas_call", "mpmd_map")
KINDS = {
    "matmul": ("dot_general", "ragged_dot", "ragged_dot_general"),
    "pallas": _KERNELS,
    "sort/top-k": ("sort", "top_k", "argsort", "cumsum", "cumlogsumexp", "cummax", "cummin"),
    "gather/scatter": ("gather", "scatter", "scatter-add", "scatter_add", "dynamic_slice",
                       "dynamic_update_slice"),
    "reduce": ("reduce_sum", "reduce_max", "reduce_min", "argmax", "argmin", "reduce_and",
               "reduce_or", "reduce_prod"),
    "layout": ("concatenate", "transpose", "pad", "rev"),
}
KIND_OF = {p: k for k, ps in KINDS.items() for p in ps}
# Structure, not work: their bodies are counted instead.
_CALLS = ("pjit", "jit", "closed_call", "core_call", "custom_jvp_call", "custom_vjp_call",
          "remat", "checkpoint", "shard_map", "custom_vjp_call_jaxpr")


def count(jaxpr, counts: collections.Counter) -> None:
    """Primitives of `jaxpr`, sub-jaxprs expanded once per call (loop bodies once)."""
    from jax.extend import core
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        subs = list(core.jaxprs_in_params(eqn.params))
        if name in _KERNELS or not subs:
            counts[name] += 1
            continue
        if name not in _CALLS:
            counts[name] += 1  # cond / while: the control op itself, then its bodies
        for sub in subs:
            count(sub, counts)


def census(raw: dict, context: int) -> dict:
    import jax
    import jax.numpy as jnp

    from jaxinfer.model.config import config_from_dict
    from jaxinfer.model.transformer import forward, param_shapes
    from jaxinfer.worker.kv.device_cache import kv_block_shapes
    from jaxinfer.model.kernel_table import Platform, resolve_kernels
    from pallas_kernels.attention.metadata import AttentionMetadata
    cfg = config_from_dict(raw)
    # The H200's table, whatever this machine is (only traced), the experts on the kernel.
    kernels = resolve_kernels(Platform("gpu", (9, 0)), attention="mosaic", moe="mosaic")
    block = 16
    blocks = -(-context // block)
    params = param_shapes(cfg, jnp.bfloat16)
    k_shape, v_shape = kv_block_shapes(cfg, cfg.num_kv_heads, blocks, block)
    kv = tuple((jax.ShapeDtypeStruct(k_shape, jnp.bfloat16),
                jax.ShapeDtypeStruct(v_shape, jnp.bfloat16)) for _ in range(cfg.num_layers))
    i32 = jnp.int32
    md = AttentionMetadata(jax.ShapeDtypeStruct((1,), i32), jax.ShapeDtypeStruct((2,), i32),
                           jax.ShapeDtypeStruct((1,), i32),
                           jax.ShapeDtypeStruct((1, blocks), i32), num_decodes=1)
    ids = jax.ShapeDtypeStruct((1,), i32)
    jaxpr = jax.make_jaxpr(lambda p, t, pos, kv, md: forward(p, cfg, t, pos, kv, md, kernels))(
        params, ids, ids, kv, md)
    counts: collections.Counter = collections.Counter()
    count(jaxpr.jaxpr, counts)
    kinds = collections.Counter()
    for prim, n in counts.items():
        kinds[KIND_OF.get(prim, "elementwise/other")] += n
    heavy = sum(n for k, n in kinds.items() if k != "elementwise/other")
    return dict(layers=cfg.num_layers, total=sum(counts.values()), non_elementwise=heavy,
                non_elementwise_per_layer=round(heavy / cfg.num_layers, 1),
                kinds=dict(kinds.most_common()),
                primitives=dict(counts.most_common()))


def main() -> None:
    from jaxinfer.bench.presets import DEEPSEEK_V2_LITE as V2_LITE
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=768, help="tokens in the cache")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    llama = dict(architectures=["LlamaForCausalLM"], hidden_size=4096, intermediate_size=14336,
                 num_hidden_layers=V2_LITE["num_hidden_layers"], num_attention_heads=32,
                 num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0,
                 max_position_embeddings=8192, torch_dtype="bfloat16")
    out = {"dsv2lite": census(V2_LITE, args.context),
           "llama3_8b_shape_27_layers": census(llama, args.context)}
    if args.json:
        print(json.dumps(out, indent=1))
        return
    for name, c in out.items():
        print(f"{name}: {c['layers']} layers, {c['total']} primitives, "
              f"{c['non_elementwise']} non-elementwise ({c['non_elementwise_per_layer']} a layer)")
        print("   ", ", ".join(f"{k} {n}" for k, n in c["kinds"].items()))
        print("   ", ", ".join(f"{k} {n}" for k, n in list(c["primitives"].items())[:24]))


if __name__ == "__main__":
    main()
