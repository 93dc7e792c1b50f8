"""Routed experts after the router: rows sorted by expert, the grouped-matmul SwiGLU
(`pallas_kernels.moe.grouped_matmul.moe_experts`), rows put back in token order and summed with their
routing weights.

`routed_experts` runs on whatever experts it is handed: all of them (one device), every expert's
slice of the intermediate size (tensor parallelism inside the experts: the result is a partial sum)
or a contiguous range of whole experts starting at `first_expert` (expert parallelism: rows routed
elsewhere contribute zero). jaxinfer/parallel/experts.py runs it per device under `shard_map` and
sums the partial results over the devices. `RoutedExperts` is the kernel table's slot for it on
one device.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels.moe.grouped_matmul import moe_experts


def routed_experts(x: jax.Array, experts: jax.Array, weights: jax.Array,
                   w: tuple[jax.Array, jax.Array, jax.Array], scales=None,
                   first_expert=0, impl: str = "auto", *, glu=None,
                   biases=None, gpu: bool | None = None, hopper: bool | None = None,
                   dispatch=None) -> jax.Array:
    """x [T, H]; experts int32[T, k] and weights f32[T, k] from the router; w (w_gate [E', H, F'],
    w_up [E', H, F'], w_down [E', F', H]) holding experts first_expert .. first_expert + E' - 1
    (first_expert may be traced); scales: their per-output-channel scales [E', out] when the stacks
    are 8-bit (jaxinfer/model/quant), else None; impl, gpu, hopper: `moe_experts`' (--moe-impl and
    the platform); glu, biases (gate, up [E', F']): gpt-oss's activation and biases; dispatch:
    the fused router's (group_sizes, rank) when it saw the same E' experts, else None (sorted
    here). Returns sum over the token's held experts of weight * expert(x), [T, H] in x's dtype."""
    t, k = experts.shape
    held = w[0].shape[0]
    local = experts - first_expert
    mine = (local >= 0) & (local < held)
    if dispatch is None:
        group_sizes, order, rank = sorted_dispatch(jnp.where(mine, local, held), held)
    else:  # the fused router's: the permutation from its inverse, an int32 scatter, no sort
        group_sizes, rank = dispatch
        order = inverse_permutation(rank)
    xs = x[order // k]  # rows grouped by expert
    # A token's k experts are distinct, so no expert gets more than T rows.
    ys = moe_experts(xs, w, group_sizes, max_group_size=t, scales=scales, impl=impl, glu=glu,
                     biases=biases, gpu=gpu, hopper=hopper)
    # Back to token order by a gather through the inverse permutation rather than a scatter of the
    # [T * k, H] rows: XLA fuses the gather into the weighted sum.
    ys = ys[rank].reshape(t, k, -1)
    ys = jnp.where(mine[..., None], ys.astype(jnp.float32), 0.0)  # rows past the groups: undefined
    return jnp.einsum("tkh,tk->th", ys, weights).astype(x.dtype)


def inverse_permutation(permutation: jax.Array) -> jax.Array:
    """p -> q with q[p[i]] = i: an int32 scatter of len(p) ids."""
    n = permutation.shape[0]
    return jnp.zeros_like(permutation).at[permutation].set(jnp.arange(n, dtype=permutation.dtype))


def sorted_dispatch(experts: jax.Array, num_experts: int):
    """experts int32[T, k] (ids >= num_experts: rows sorted last, counted nowhere) ->
    (group_sizes int32[num_experts], order: the rows sorted stably by expert, rank: its inverse,
    row t * k + j's place in that order). The unfused reference of the fused router's dispatch."""
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)
    group_sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    return group_sizes, order, inverse_permutation(order)


@dataclasses.dataclass(frozen=True)
class RoutedExperts:
    """The kernel table's routed-experts slot on one device: `routed_experts` with --moe-impl and
    the platform bound once per engine."""
    impl: str = "auto"
    gpu: bool = False
    hopper: bool = False

    def __call__(self, x, experts, weights, w, scales=None, first_expert=0, *, glu=None,
                 biases=None, dispatch=None) -> jax.Array:
        return routed_experts(x, experts, weights, w, scales, first_expert, self.impl, glu=glu,
                              biases=biases, gpu=self.gpu, hopper=self.hopper, dispatch=dispatch)
