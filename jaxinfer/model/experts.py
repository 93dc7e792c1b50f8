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
                   biases=None, gpu: bool | None = None, hopper: bool | None = None) -> jax.Array:
    """x [T, H]; experts int32[T, k] and weights f32[T, k] from the router; w (w_gate [E', H, F'],
    w_up [E', H, F'], w_down [E', F', H]) holding experts first_expert .. first_expert + E' - 1
    (first_expert may be traced); scales: their per-output-channel scales [E', out] when the stacks
    are 8-bit (jaxinfer/model/quant), else None; impl, gpu, hopper: `moe_experts`' (--moe-impl and
    the platform); glu, biases (gate, up [E', F']): gpt-oss's activation and biases. Returns sum
    over the token's held experts of weight * expert(x), [T, H] in x's dtype."""
    t, k = experts.shape
    held = w[0].shape[0]
    local = experts - first_expert
    mine = (local >= 0) & (local < held)
    flat = jnp.where(mine, local, held).reshape(-1)  # rows of other devices' experts sort last
    order = jnp.argsort(flat, stable=True)
    xs = x[order // k]  # rows grouped by expert
    group_sizes = jnp.bincount(flat, length=held).astype(jnp.int32)  # the `held` ids dropped
    # A token's k experts are distinct, so no expert gets more than T rows.
    ys = moe_experts(xs, w, group_sizes, max_group_size=t, scales=scales, impl=impl, glu=glu,
                     biases=biases, gpu=gpu, hopper=hopper)
    # Back to token order by a gather through the inverse permutation (an int32 scatter of T * k
    # ids) rather than a scatter of the [T * k, H] rows: XLA fuses the gather into the weighted sum.
    rank = jnp.zeros_like(order).at[order].set(jnp.arange(t * k, dtype=order.dtype))
    ys = ys[rank].reshape(t, k, -1)
    ys = jnp.where(mine[..., None], ys.astype(jnp.float32), 0.0)  # rows past the groups: undefined
    return jnp.einsum("tkh,tk->th", ys, weights).astype(x.dtype)


@dataclasses.dataclass(frozen=True)
class RoutedExperts:
    """The kernel table's routed-experts slot on one device: `routed_experts` with --moe-impl and
    the platform bound once per engine."""
    impl: str = "auto"
    gpu: bool = False
    hopper: bool = False

    def __call__(self, x, experts, weights, w, scales=None, first_expert=0, *, glu=None,
                 biases=None) -> jax.Array:
        return routed_experts(x, experts, weights, w, scales, first_expert, self.impl, glu=glu,
                              biases=biases, gpu=self.gpu, hopper=self.hopper)
