"""One token's small matmuls kept as GEMMs on the GPU.

XLA's GPU algebraic simplifier rewrites a dot one of whose operands is a vector (after size-1
dimensions are dropped: one token's activations) into a broadcast multiply and a reduce when the
product has fewer than 10M multiply-adds (gpu_algebraic_simplifier.cc,
ShouldStrengthReduceDotToReduce). The multiply's fusion writes the whole [K, N] product to HBM and
the reduce reads it back. At DeepSeek-V2-Lite's hidden size 2,048 that is q_proj, o_proj,
kv_a_proj, the shared experts, the router and the absorbed per-head products: on the H200 these
fusions took 2.7 ms of a 5.4 ms batch-1 decode step (the record's `dsv2lite_bs1_profile`), each
5-20 us where the weight read alone is 1-8 us. Llama-3-8B's projections are all above the
threshold and stay GEMMs.

Computing such a product on two rows (the token twice) keeps it a dot; the optimization barrier
stops the simplifier from moving the slice that drops the copy back into the dot. Only on GPUs
(the kernel table's `gemm_rows` slot: `gemm_rows` there, `plain_rows` elsewhere, where the
rewrite does not apply and one row stays one row).
"""

from __future__ import annotations

import math
from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

# Products below this many multiply-adds with a vector operand are strength-reduced by XLA GPU.
XLA_STRENGTH_REDUCE_BELOW = 10_000_000


Rows = Callable[[Callable[[jax.Array], jax.Array], jax.Array, int, int], jax.Array]


def gemm_rows(matmul: Callable[[jax.Array], jax.Array], x: jax.Array, tokens: int,
              macs: int) -> jax.Array:
    """matmul(x) for x of `tokens` tokens along its leading dims (any other dims the product's
    batch dims), run on the token twice when there is one and XLA GPU would strength-reduce the
    product (`macs` multiply-adds below the threshold)."""
    if tokens != 1 or macs >= XLA_STRENGTH_REDUCE_BELOW:
        return matmul(x)
    y = jax.lax.optimization_barrier(matmul(jnp.concatenate([x, x])))
    return y[:1]


def plain_rows(matmul: Callable[[jax.Array], jax.Array], x: jax.Array, tokens: int,
               macs: int) -> jax.Array:
    """`gemm_rows`' signature, matmul(x) as it is (off the GPU)."""
    return matmul(x)


def dot(x: jax.Array, w: jax.Array, rows: Rows = plain_rows, **kwargs) -> jax.Array:
    """jnp.dot(x [..., K], w [K, N], **kwargs) through `rows` (the kernel table's `gemm_rows`)."""
    return rows(lambda a: jnp.dot(a, w, **kwargs), x, math.prod(x.shape[:-1]),
                x.shape[-1] * w.shape[-1])


class Dense(nn.Dense):
    """nn.Dense (the same params) whose one-token products go through `rows` (the kernel table's
    `gemm_rows`: GEMMs on the GPU)."""
    rows: Rows = plain_rows

    def __call__(self, inputs: jax.Array) -> jax.Array:
        return self.rows(super().__call__, inputs, math.prod(inputs.shape[:-1]),
                         inputs.shape[-1] * self.features)
