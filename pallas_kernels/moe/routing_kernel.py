"""The MoE router and its dispatch in one Pallas kernel: router logits [T, E] in; each token's k
experts, their weights, every routed row's place in the expert-sorted order and the rows per expert
out. No sort: at the few tokens it takes (`TOKEN_LIMIT`), the counting sort is two small matmuls of
one-hots inside the kernel.

What it computes is `jaxinfer.model.routing.route` (the reference, which says which family scores
how) followed by the stable sort by expert that `jaxinfer.model.experts.sorted_dispatch` does:

  - top-k: k rounds of a row max; among equal values the lower expert index wins, as
    `jax.lax.top_k` breaks ties, so both choose the same experts on constructed ties.
  - rank[t, j]: where row t * k + j lands once rows are sorted stably by expert = the rows before
    its expert's group (an exclusive prefix sum over experts) plus the earlier tokens routed to the
    same expert (an exclusive prefix sum over tokens). A token's k experts are distinct, so its own
    other rows never count. Both prefix sums are matmuls of 0/1 matrices (exact in bf16 with f32
    accumulation), which tensor cores run where a scan would be a serial loop.

The grouped matmul's tile table (`grouped_matmul_mosaic.tile_table`) is a function of the rows
per expert, built from them by a compare-and-sum (no sort), so the kernel hands over those and
the tables are identical to the sort's.

The gate matmul stays a GEMM before the kernel: it is a weight read of H x E that the model's
GEMM path already streams at the read roofline, and inside this single-program kernel it would
read the router weights on one SM.

Shapes are padded to powers of two (Triton's block shapes) and at least 16 (its dot's): experts
past E score -inf and are never chosen, tokens past T are left out of the counts.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu_triton

# Tokens per step the kernel can take (one program holds [T, E] tiles, a [T, T] prefix matrix).
TOKEN_LIMIT = 256
# Tokens per step the model routes by the kernel by default (above: the sort): decode buckets and
# small prefill chunks; `jaxinfer bench kernels --only moe` (routing section) times both sides.
MAX_TOKENS = 64
# Tokens x experts one program holds on a GPU: 64 x 128 (Qwen3-30B-A3B) compiled and ran on an
# H100 (moe_h100.json, routing); 256 x 128 asked 288 KiB of shared memory, over the 227 KiB there.
MAX_CELLS = 64 * 128
# One program's threads share the [T, E] tiles (64 x 256 floats for DeepSeek-V3): 16 warps keep
# each thread's share of the few live tiles within its registers.
NUM_WARPS = 16


@dataclasses.dataclass(frozen=True)
class RoutingSpec:
    """One family's routing rule (static): k experts per token scored by "softmax" or "sigmoid"
    (`topk_then_softmax`: softmax over the k best logits, gpt-oss); `bias`: a score correction
    added for the choice only (DeepSeek-V3); group-limited choice among the `topk_group` best of
    `n_group` groups (a group's score: its best expert's for softmax, its two best's sum for
    sigmoid); weights renormalised over the k when `norm_topk_prob` (denominator + `norm_eps`),
    then times `scaling`. `shared`: always-on experts E .. E + shared - 1 (shared experts stored
    after the routed ones), routed to by every token with weight 1 after its k."""
    k: int
    scoring: str = "softmax"
    topk_then_softmax: bool = False
    bias: bool = False
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = False
    norm_eps: float = 0.0
    scaling: float = 1.0
    shared: int = 0


def _pow2(n: int, floor: int = 16) -> int:
    return max(floor, 1 << (n - 1).bit_length())


def _keep_best_groups(spec: RoutingSpec, choice, col, num_experts: int):
    """`choice` outside each token's topk_group best groups set to 0 (softmax) or -inf (sigmoid),
    as the reference's `_keep_best_groups`; groups of equal score: the lower index wins."""
    size = num_experts // spec.n_group
    members, scores = [], []
    for g in range(spec.n_group):
        in_g = (col >= g * size) & (col < (g + 1) * size)
        v = jnp.where(in_g, choice, -jnp.inf)
        best = jnp.max(v, axis=1, keepdims=True)
        if spec.scoring == "sigmoid":  # the two best, counting a repeated best twice
            first = jnp.min(jnp.where(v == best, col, choice.shape[1]), axis=1, keepdims=True)
            best = best + jnp.max(jnp.where(col == first, -jnp.inf, v), axis=1, keepdims=True)
        members.append(in_g)
        scores.append(best)
    rows = choice.shape[0]
    taken = [jnp.zeros((rows, 1), bool) for _ in range(spec.n_group)]
    keep = jnp.zeros(choice.shape, bool)
    for _ in range(spec.topk_group):
        best = jnp.full((rows, 1), -jnp.inf, jnp.float32)
        pick = jnp.full((rows, 1), spec.n_group, jnp.int32)
        for g in range(spec.n_group):  # ascending, strictly better: the lower index keeps ties
            better = ~taken[g] & ((scores[g] > best) | (pick == spec.n_group))
            best = jnp.where(better, scores[g], best)
            pick = jnp.where(better, g, pick)
        for g in range(spec.n_group):
            chosen = pick == g
            taken[g] = taken[g] | chosen
            keep = keep | (chosen & members[g])
    masked = -jnp.inf if spec.scoring == "sigmoid" else 0.0
    return jnp.where(keep | (col >= num_experts), choice, masked)


def _routing_kernel(logits_ref, bias_ref, weights_ref, experts_ref, rank_ref, sizes_ref, *,
                    spec: RoutingSpec, tokens: int, num_experts: int):
    x = logits_ref[...].astype(jnp.float32)  # [Tp, Ep]
    tp, ep = x.shape
    kp = weights_ref.shape[1]
    col = jax.lax.broadcasted_iota(jnp.int32, (tp, ep), 1)
    real = col < num_experts
    x = jnp.where(real, x, -jnp.inf)
    if spec.topk_then_softmax:
        scores = x
    elif spec.scoring == "sigmoid":
        scores = jax.nn.sigmoid(x)
    else:
        e = jnp.exp(x - jnp.max(x, axis=1, keepdims=True))
        scores = e / jnp.sum(e, axis=1, keepdims=True)
    choice = scores
    if spec.bias:
        choice = choice + bias_ref[...].astype(jnp.float32)
    choice = jnp.where(real, choice, -jnp.inf)
    if spec.n_group > 1:
        choice = _keep_best_groups(spec, choice, col, num_experts)

    kcol = jax.lax.broadcasted_iota(jnp.int32, (tp, kp), 1)
    row_real = jax.lax.broadcasted_iota(jnp.int32, (tp, ep), 0) < tokens
    taken = jnp.zeros((tp, ep), bool)
    counts = jnp.zeros((tp, ep), jnp.float32)
    picked, ids = [], []
    for _ in range(spec.k):
        best = jnp.max(jnp.where(taken, -jnp.inf, choice), axis=1, keepdims=True)
        hit = (choice == best) & ~taken
        idx = jnp.min(jnp.where(hit, col, ep), axis=1, keepdims=True)  # [Tp, 1]
        hot = col == idx
        taken = taken | hot
        counts = counts + jnp.where(hot & row_real, 1.0, 0.0)
        ids.append(idx)
        picked.append(jnp.sum(jnp.where(hot, scores, 0.0), axis=1, keepdims=True))

    if spec.topk_then_softmax:  # picked[0] is the largest logit
        picked = [jnp.exp(p - picked[0]) for p in picked]
    total = functools.reduce(lambda a, b: a + b, picked)
    if spec.topk_then_softmax:
        picked = [p / total for p in picked]
    elif spec.norm_topk_prob:
        picked = [p / (total + spec.norm_eps) if spec.norm_eps else p / total for p in picked]
    if not spec.topk_then_softmax:
        picked = [p * spec.scaling for p in picked]
    for s in range(spec.shared):
        idx = jnp.full((tp, 1), num_experts + s, jnp.int32)
        counts = counts + jnp.where((col == idx) & row_real, 1.0, 0.0)
        ids.append(idx)
        picked.append(jnp.ones((tp, 1), jnp.float32))

    # Exclusive prefix sums as 0/1 matmuls: over tokens ([Tp, Tp] strictly lower) and experts.
    r = jax.lax.broadcasted_iota(jnp.int32, (tp, tp), 0)
    c = jax.lax.broadcasted_iota(jnp.int32, (tp, tp), 1)
    lower = jnp.where(c < r, 1.0, 0.0).astype(jnp.bfloat16)
    hot_counts = counts.astype(jnp.bfloat16)
    earlier = jnp.dot(lower, hot_counts, preferred_element_type=jnp.float32)  # [Tp, Ep]
    re = jax.lax.broadcasted_iota(jnp.int32, (ep, ep), 0)
    ce = jax.lax.broadcasted_iota(jnp.int32, (ep, ep), 1)
    upper = jnp.where(re < ce, 1.0, 0.0).astype(jnp.bfloat16)
    before = jnp.dot(hot_counts, upper, preferred_element_type=jnp.float32)  # [Tp, Ep]
    starts = jnp.sum(before, axis=0, keepdims=True)  # [1, Ep]
    sizes_ref[...] = jnp.sum(counts, axis=0, keepdims=True).astype(jnp.int32)
    place = starts + earlier

    weights = jnp.zeros((tp, kp), jnp.float32)
    experts = jnp.zeros((tp, kp), jnp.int32)
    rank = jnp.zeros((tp, kp), jnp.int32)
    for j in range(spec.k + spec.shared):
        here = kcol == j
        weights = jnp.where(here, picked[j], weights)
        experts = jnp.where(here, ids[j], experts)
        slot = jnp.sum(jnp.where(col == ids[j], place, 0.0), axis=1, keepdims=True)
        rank = jnp.where(here, slot.astype(jnp.int32), rank)
    weights_ref[...] = weights
    experts_ref[...] = experts
    rank_ref[...] = rank


def fused_route(logits: jax.Array, spec: RoutingSpec, bias: jax.Array | None = None, *,
                interpret: bool = False):
    """logits f32[T, E] (T <= TOKEN_LIMIT), bias f32[E] when `spec.bias` -> (weights f32[T, k'],
    experts int32[T, k'], group_sizes int32[E'], rank int32[T * k']) with k' = k + spec.shared
    and E' = E + spec.shared: rank[t * k' + j] is row t * k' + j's place in the rows sorted
    stably by expert."""
    t, e = logits.shape
    if t > TOKEN_LIMIT:
        raise ValueError(f"fused_route takes at most {TOKEN_LIMIT} tokens, got {t}")
    if spec.n_group > 1 and e % spec.n_group:
        raise ValueError(f"{e} experts do not split into {spec.n_group} groups")
    k = spec.k + spec.shared
    tp, ep, kp = _pow2(t), _pow2(e + spec.shared), _pow2(k, 1)
    padded = jnp.zeros((tp, ep), jnp.float32).at[:t, :e].set(logits.astype(jnp.float32))
    b = jnp.zeros((1, ep), jnp.float32)
    if spec.bias:
        b = b.at[0, :e].set(bias.astype(jnp.float32))
    weights, experts, rank, sizes = pl.pallas_call(
        functools.partial(_routing_kernel, spec=spec, tokens=t, num_experts=e),
        out_shape=(jax.ShapeDtypeStruct((tp, kp), jnp.float32),
                   jax.ShapeDtypeStruct((tp, kp), jnp.int32),
                   jax.ShapeDtypeStruct((tp, kp), jnp.int32),
                   jax.ShapeDtypeStruct((1, ep), jnp.int32)),
        interpret=interpret,
        compiler_params=plgpu_triton.CompilerParams(num_warps=NUM_WARPS, num_stages=1),
    )(padded, b)
    return (weights[:t, :k], experts[:t, :k], sizes[0, :e + spec.shared],
            rank[:t, :k].reshape(-1))
