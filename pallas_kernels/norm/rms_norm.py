"""Residual add + RMSNorm in one Triton-lowered Pallas kernel, for decode-sized row counts.

    add_rms_norm(x[R, H], residual[R, H], weight[H], *, eps) -> (x + residual, normed)

At one row XLA emits the residual add, the mean-square reduction and the scaling as three kernels
(H200, batch-1 decode of the Llama-3-8B shape: ~4.7 µs of mostly launch per norm, two norms per
layer); this is one program per row. The oracle is `norm.reference.add_rms_norm_reference` (HF's
order of operations). `add_rms_norm_triton` runs the kernel where it applies (rows <= `max_rows`, a
power-of-two hidden size: Triton block shapes) and the reference otherwise.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu_triton

from pallas_kernels.norm.reference import add_rms_norm_reference

# Measured at one row (bench_bs1_step, H200: 24 µs less per batch-1 step); at 8 rows XLA already
# emits the norm as one fusion beside the add, and the kernel is checked there for correctness only.
MAX_ROWS = 1


def _kernel(x_ref, r_ref, w_ref, h_ref, y_ref, *, eps: float):
    h = x_ref[...] + r_ref[...]
    h_ref[...] = h
    hf = h.astype(jnp.float32)
    y = hf * lax.rsqrt(jnp.mean(hf * hf, axis=-1, keepdims=True) + eps)
    y_ref[...] = w_ref[...].astype(h.dtype) * y.astype(h.dtype)


def add_rms_norm_triton(x: jax.Array, residual: jax.Array, weight: jax.Array, *, eps: float,
                        max_rows: int = MAX_ROWS,
                        interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """`add_rms_norm_reference` as one kernel (grid: one program per row) for x [R, H] with
    R <= max_rows and H a power of two; other shapes run the reference."""
    hdim = x.shape[-1]
    rows = x.size // hdim
    if rows > max_rows or hdim & (hdim - 1):
        return add_rms_norm_reference(x, residual, weight, eps=eps)
    row = pl.BlockSpec((1, hdim), lambda i: (i, 0))
    h, y = pl.pallas_call(
        functools.partial(_kernel, eps=eps),
        grid=(rows,),
        in_specs=[row, row, pl.BlockSpec((1, hdim), lambda i: (0, 0))],
        out_specs=[row, row],
        out_shape=[jax.ShapeDtypeStruct((rows, hdim), x.dtype)] * 2,
        interpret=interpret,
        compiler_params=plgpu_triton.CompilerParams(num_warps=4, num_stages=1),
    )(x.reshape(rows, hdim), residual.reshape(rows, hdim).astype(x.dtype), weight.reshape(1, hdim))
    return h.reshape(x.shape), y.reshape(x.shape)
