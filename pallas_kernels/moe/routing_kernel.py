"""The MoE router and its dispatch in one Pallas kernel: router logits [T, E] in; each token's k
experts, their weights, every routed row's place in the expert-sorted order and the rows per expert
out. No sort: at the few tokens it takes, the counting sort is small matmuls of one-hots inside
the kernel.

What it computes is `jaxinfer.model.routing.route` (the reference, which says which family scores
how) followed by the stable sort by expert that `jaxinfer.model.experts.sorted_dispatch` does:

  - top-k: k rounds of a row max; among equal values the lower expert index wins, as
    `jax.lax.top_k` breaks ties, so both choose the same experts on constructed ties.
  - rank[t, j]: where row t * k + j lands once rows are sorted stably by expert = the rows before
    its expert's group (an exclusive prefix sum over experts) plus the earlier tokens routed to the
    same expert (an exclusive prefix sum over tokens). A token's k experts are distinct, so its own
    other rows never count. Both prefix sums are matmuls of 0/1 matrices (exact in bf16 with f32
    accumulation), which tensor cores run where a scan would be a serial loop.
  - shared experts (ids E .. E + S - 1, every token, weight 1) sort after all T * k routed rows:
    their places and counts are closed forms, so they take no columns of the tiles.

Tiles: the program walks [TOKEN_TILE, EXPERT_TILE] tiles of the logits (unrolled). A row's top-k
and group choice reduce over its expert tiles; the token prefix carries each expert tile's column
counts from one token tile to the next; the expert prefix carries each tile's total to the next.
So the dots' operands, which Triton stages in shared memory, are tile-sized and their sum
(`shared_memory_bytes`) is bounded by the tile count, asserted against SHARED_MEMORY_BUDGET.

The grouped matmul's tile table (`grouped_matmul_mosaic.tile_table`) is a function of the rows
per expert, built from them by a compare-and-sum (no sort), so the kernel hands over those and
the tables are identical to the sort's.

The gate matmul stays a GEMM before the kernel: it is a weight read of H x E that the model's
GEMM path already streams at the read roofline, and inside this single-program kernel it would
read the router weights on one SM.

Tile sides are powers of two (Triton's block shapes) and at least 16 (its dot's): experts past E
score -inf and are never chosen, tokens past T are left out of the counts.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu_triton

# Tokens per step the kernel takes at most (with few experts; `fits` decides per shape).
TOKEN_LIMIT = 256
# Tokens per step the model routes by the kernel by default (above: the sort): decode buckets and
# small prefill chunks; `jaxinfer bench kernels --only moe` (routing section) times both sides.
MAX_TOKENS = 64
# Tile sides: equal sides minimise the dots' bytes per cell (see `shared_memory_bytes`).
TOKEN_TILE = 64
EXPERT_TILE = 64
# Shared memory one Hopper block may use (227 KiB of the SM's 228).
SHARED_MEMORY_BUDGET = 227 * 1024
# One program's threads share the tiles (64 x 256 floats for DeepSeek-V3): 16 warps keep each
# thread's share of the few live tiles within its registers.
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


@dataclasses.dataclass(frozen=True)
class TilePlan:
    """How T tokens x E experts split into tiles: `token_tiles` of `token_tile` rows, `expert_tiles`
    of `expert_tile` columns (covering the routed experts), `size_tiles` of those covering the
    routed and shared experts' counts."""
    token_tile: int
    token_tiles: int
    expert_tile: int
    expert_tiles: int
    size_tiles: int


def _pow2(n: int, floor: int = 16) -> int:
    return max(floor, 1 << (n - 1).bit_length())


def tile_plan(tokens: int, experts: int, shared: int = 0) -> TilePlan:
    tt, te = min(_pow2(tokens), TOKEN_TILE), min(_pow2(experts), EXPERT_TILE)
    return TilePlan(tt, -(-tokens // tt), te, -(-experts // te), -(-(experts + shared) // te))


def shared_memory_bytes(tokens: int, experts: int) -> int:
    """Upper bound of the shared memory the kernel asks for: every (token tile, expert tile) pair
    runs two bf16 dots, lower[tt, tt] @ counts[tt, te] (token prefix) and counts[tt, te] @
    upper[te, te] (expert prefix), each operand counted as its own buffer, none reused (the
    untiled kernel at 256 x 128 asked 288 KiB on an H100, exactly these operands' sum), plus one
    f32 tile of scratch for a layout conversion or a cross-warp reduction (op-local, the largest
    counted once). 64 x 256 (DeepSeek-V3 decode): 144 KiB."""
    plan = tile_plan(tokens, experts)
    tt, te = plan.token_tile, plan.expert_tile
    operands = plan.token_tiles * plan.expert_tiles * 2 * (tt * tt + 2 * tt * te + te * te)
    return operands + tt * te * 4


def fits(tokens: int, experts: int) -> bool:
    """Whether one program routes T tokens over E routed experts within SHARED_MEMORY_BUDGET."""
    return tokens <= TOKEN_LIMIT and shared_memory_bytes(tokens, experts) <= SHARED_MEMORY_BUDGET


def _group_scores(spec: RoutingSpec, choice, cols, num_experts: int):
    """Each group's score [Tt, 1] (its best choice; sigmoid: its two best, a repeated best counted
    twice, summed in that order as the reference's top-2 sum) and its columns per tile, from the
    tiles it overlaps."""
    size = num_experts // spec.n_group
    big = len(cols) * cols[0].shape[1]
    scores, members = [], []
    for g in range(spec.n_group):
        lo, hi = g * size, (g + 1) * size
        tiles = [j for j, c in enumerate(cols) if lo < (j + 1) * c.shape[1] and j * c.shape[1] < hi]
        member = {j: (cols[j] >= lo) & (cols[j] < hi) for j in tiles}
        v = {j: jnp.where(member[j], choice[j], -jnp.inf) for j in tiles}
        best = functools.reduce(jnp.maximum, [jnp.max(v[j], axis=1, keepdims=True) for j in tiles])
        if spec.scoring == "sigmoid":
            first = functools.reduce(jnp.minimum, [
                jnp.min(jnp.where(v[j] == best, cols[j], big), axis=1, keepdims=True)
                for j in tiles])
            best = best + functools.reduce(jnp.maximum, [
                jnp.max(jnp.where(cols[j] == first, -jnp.inf, v[j]), axis=1, keepdims=True)
                for j in tiles])
        scores.append(best)
        members.append(member)
    return scores, members


def _keep_best_groups(spec: RoutingSpec, choice, cols, num_experts: int):
    """`choice` tiles outside each token's topk_group best groups set to 0 (softmax) or -inf
    (sigmoid), as the reference's `_keep_best_groups`; groups of equal score: the lower index
    wins."""
    scores, members = _group_scores(spec, choice, cols, num_experts)
    rows = choice[0].shape[0]
    taken = [jnp.zeros((rows, 1), bool) for _ in range(spec.n_group)]
    keep = [c >= num_experts for c in cols]
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
            for j, member in members[g].items():
                keep[j] = keep[j] | (chosen & member)
    masked = -jnp.inf if spec.scoring == "sigmoid" else 0.0
    return [jnp.where(kp, c, masked) for kp, c in zip(keep, choice)]


def _choose(spec: RoutingSpec, x, bias, cols, num_experts: int):
    """One token tile's choice from its logit tiles x[j] [Tt, Te]: the k expert ids [Tt, 1] in
    order, their weights (before renormalisation) and the one-hot tiles of the chosen."""
    if spec.topk_then_softmax:
        scores = x
    elif spec.scoring == "sigmoid":
        scores = [jax.nn.sigmoid(xj) for xj in x]
    else:
        top = functools.reduce(jnp.maximum, [jnp.max(xj, axis=1, keepdims=True) for xj in x])
        e = [jnp.exp(xj - top) for xj in x]
        total = functools.reduce(jnp.add, [jnp.sum(ej, axis=1, keepdims=True) for ej in e])
        scores = [ej / total for ej in e]
    choice = [jnp.where(c < num_experts, s + b if spec.bias else s, -jnp.inf)
              for s, b, c in zip(scores, bias, cols)]
    if spec.n_group > 1:
        choice = _keep_best_groups(spec, choice, cols, num_experts)

    big = len(cols) * cols[0].shape[1]
    taken = [jnp.zeros(c.shape, bool) for c in cols]
    ids, picked = [], []
    for _ in range(spec.k):
        free = [jnp.where(tk, -jnp.inf, c) for tk, c in zip(taken, choice)]
        best = functools.reduce(jnp.maximum, [jnp.max(f, axis=1, keepdims=True) for f in free])
        idx = functools.reduce(jnp.minimum, [
            jnp.min(jnp.where((c == best) & ~tk, col, big), axis=1, keepdims=True)
            for c, tk, col in zip(choice, taken, cols)])  # [Tt, 1]
        hot = [col == idx for col in cols]
        taken = [tk | h for tk, h in zip(taken, hot)]
        ids.append(idx)
        picked.append(functools.reduce(jnp.add, [
            jnp.sum(jnp.where(h, s, 0.0), axis=1, keepdims=True) for h, s in zip(hot, scores)]))
    return ids, picked, taken


def _weigh(spec: RoutingSpec, picked):
    if spec.topk_then_softmax:  # picked[0] is the largest logit
        e = [jnp.exp(p - picked[0]) for p in picked]
        total = functools.reduce(jnp.add, e)
        return [p / total for p in e]
    if spec.norm_topk_prob:
        total = functools.reduce(jnp.add, picked)
        picked = [p / (total + spec.norm_eps) if spec.norm_eps else p / total for p in picked]
    return [p * spec.scaling for p in picked]


def _routing_kernel(logits_ref, bias_ref, weights_ref, experts_ref, rank_ref, sizes_ref, *,
                    spec: RoutingSpec, plan: TilePlan, tokens: int, num_experts: int):
    tt, te = plan.token_tile, plan.expert_tile
    kp = weights_ref.shape[1]
    cols = [jax.lax.broadcasted_iota(jnp.int32, (tt, te), 1) + j * te
            for j in range(plan.expert_tiles)]
    bias = [bias_ref[:, pl.ds(j * te, te)].astype(jnp.float32) for j in range(plan.expert_tiles)]
    r = jax.lax.broadcasted_iota(jnp.int32, (tt, tt), 0)
    lower = jnp.where(jax.lax.broadcasted_iota(jnp.int32, (tt, tt), 1) < r, 1.0,
                      0.0).astype(jnp.bfloat16)
    re = jax.lax.broadcasted_iota(jnp.int32, (te, te), 0)
    upper = jnp.where(re < jax.lax.broadcasted_iota(jnp.int32, (te, te), 1), 1.0,
                      0.0).astype(jnp.bfloat16)

    # Per expert tile: tokens of earlier token tiles routed to each expert (the token prefix's
    # carry), and the rows before each expert from the experts of this tile (the expert prefix).
    carry = [jnp.zeros((1, te), jnp.float32) for _ in range(plan.expert_tiles)]
    within = [jnp.zeros((1, te), jnp.float32) for _ in range(plan.expert_tiles)]
    chosen = []  # per token tile: (ids, weights, each row's earlier tokens on its expert)
    for i in range(plan.token_tiles):
        rows = pl.ds(i * tt, tt)
        x = [jnp.where(cols[j] < num_experts,
                       logits_ref[rows, pl.ds(j * te, te)].astype(jnp.float32), -jnp.inf)
             for j in range(plan.expert_tiles)]
        ids, picked, taken = _choose(spec, x, bias, cols, num_experts)
        real = jax.lax.broadcasted_iota(jnp.int32, (tt, te), 0) + i * tt < tokens
        earlier = []
        for j in range(plan.expert_tiles):
            counts = jnp.where(taken[j] & real, 1.0, 0.0)
            hot = counts.astype(jnp.bfloat16)
            earlier.append(jnp.dot(lower, hot, preferred_element_type=jnp.float32) + carry[j])
            within[j] = within[j] + jnp.sum(jnp.dot(hot, upper, preferred_element_type=jnp.float32),
                                            axis=0, keepdims=True)
            carry[j] = carry[j] + jnp.sum(counts, axis=0, keepdims=True)
        slots = [functools.reduce(jnp.add, [
            jnp.sum(jnp.where(cols[j] == idx, earlier[j], 0.0), axis=1, keepdims=True)
            for j in range(plan.expert_tiles)]) for idx in ids]
        chosen.append((ids, _weigh(spec, picked), slots))

    # carry now holds the rows per routed expert; starts: the rows of all lower experts.
    starts, before = [], jnp.zeros((1, 1), jnp.float32)
    for j in range(plan.expert_tiles):
        starts.append(within[j] + before)
        before = before + jnp.sum(carry[j], axis=1, keepdims=True)
    for j in range(plan.size_tiles):
        col = jax.lax.broadcasted_iota(jnp.int32, (1, te), 1) + j * te
        shared_col = (col >= num_experts) & (col < num_experts + spec.shared)
        routed = carry[j] if j < plan.expert_tiles else jnp.zeros((1, te), jnp.float32)
        sizes_ref[:, pl.ds(j * te, te)] = jnp.where(shared_col, tokens, routed).astype(jnp.int32)

    kcol = jax.lax.broadcasted_iota(jnp.int32, (tt, kp), 1)
    for i, (ids, picked, slots) in enumerate(chosen):
        token = jax.lax.broadcasted_iota(jnp.int32, (tt, 1), 0) + i * tt
        weights = jnp.zeros((tt, kp), jnp.float32)
        experts = jnp.zeros((tt, kp), jnp.int32)
        rank = jnp.zeros((tt, kp), jnp.int32)
        for j, (idx, w, slot) in enumerate(zip(ids, picked, slots)):
            start = functools.reduce(jnp.add, [
                jnp.sum(jnp.where(cols[m] == idx, starts[m], 0.0), axis=1, keepdims=True)
                for m in range(plan.expert_tiles)])
            here = kcol == j
            weights = jnp.where(here, w, weights)
            experts = jnp.where(here, idx, experts)
            rank = jnp.where(here, (start + slot).astype(jnp.int32), rank)
        for s in range(spec.shared):  # after all T * k routed rows, then by shared expert, token
            here = kcol == spec.k + s
            weights = jnp.where(here, 1.0, weights)
            experts = jnp.where(here, num_experts + s, experts)
            rank = jnp.where(here, tokens * spec.k + s * tokens + token, rank)
        rows = pl.ds(i * tt, tt)
        weights_ref[rows, :] = weights
        experts_ref[rows, :] = experts
        rank_ref[rows, :] = rank


def fused_route(logits: jax.Array, spec: RoutingSpec, bias: jax.Array | None = None, *,
                interpret: bool = False):
    """logits f32[T, E] (`fits(T, E)`), bias f32[E] when `spec.bias` -> (weights f32[T, k'],
    experts int32[T, k'], group_sizes int32[E'], rank int32[T * k']) with k' = k + spec.shared
    and E' = E + spec.shared: rank[t * k' + j] is row t * k' + j's place in the rows sorted
    stably by expert."""
    t, e = logits.shape
    if t > TOKEN_LIMIT:
        raise ValueError(f"fused_route takes at most {TOKEN_LIMIT} tokens, got {t}")
    if not fits(t, e):
        raise ValueError(f"fused_route at {t} tokens x {e} experts would ask "
                         f"{shared_memory_bytes(t, e)} bytes of shared memory, over "
                         f"SHARED_MEMORY_BUDGET = {SHARED_MEMORY_BUDGET}")
    if spec.n_group > 1 and e % spec.n_group:
        raise ValueError(f"{e} experts do not split into {spec.n_group} groups")
    plan = tile_plan(t, e, spec.shared)
    k = spec.k + spec.shared
    tp, ep, kp = plan.token_tile * plan.token_tiles, plan.expert_tile * plan.expert_tiles, _pow2(k, 1)
    padded = jnp.zeros((tp, ep), jnp.float32).at[:t, :e].set(logits.astype(jnp.float32))
    b = jnp.zeros((1, ep), jnp.float32)
    if spec.bias:
        b = b.at[0, :e].set(bias.astype(jnp.float32))
    weights, experts, rank, sizes = pl.pallas_call(
        functools.partial(_routing_kernel, spec=spec, plan=plan, tokens=t, num_experts=e),
        out_shape=(jax.ShapeDtypeStruct((tp, kp), jnp.float32),
                   jax.ShapeDtypeStruct((tp, kp), jnp.int32),
                   jax.ShapeDtypeStruct((tp, kp), jnp.int32),
                   jax.ShapeDtypeStruct((1, plan.expert_tile * plan.size_tiles), jnp.int32)),
        interpret=interpret,
        compiler_params=plgpu_triton.CompilerParams(num_warps=NUM_WARPS, num_stages=1),
    )(padded, b)
    return (weights[:t, :k], experts[:t, :k], sizes[0, :e + spec.shared],
            rank[:t, :k].reshape(-1))
