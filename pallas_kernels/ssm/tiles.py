"""Tile operations the chunked SSM kernels (gated_deltanet.py, mamba2.py) share: a chunk of a
sequence's rows loaded with the rows past its end as zeros, and the tensor-core product."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton


def dot(a, b, dtype, *, trans_a=False, trans_b=False):
    """a @ b with both operands in `dtype` (the tensor cores' input), the result in float32."""
    return pltriton.dot(a.astype(dtype), b.astype(dtype), trans_a=trans_a,
                        trans_b=trans_b).astype(jnp.float32)


def chunk_rows(ref, row0, ok):
    """Rows row0 : row0 + len(ok) of a [T] or [T, D] ref; zeros where `ok` is False (rows past
    the sequence's end, which belong to the next sequence or to padding)."""
    n = ok.shape[0]
    if len(ref.shape) == 1:
        return pltriton.load(ref.at[pl.ds(row0, n)], mask=ok, other=0)
    return pltriton.load(ref.at[pl.ds(row0, n), :], mask=ok[:, None], other=0)


def rows_past_end(x: jax.Array, chunk: int, interpret: bool) -> jax.Array:
    """x as the kernels read it: a last chunk's window runs up to chunk - 1 rows past the end of
    the packed rows. On the GPU its loads and stores are masked there, so x goes in as it is (a
    padded copy cost as much as a fifth of a prefill call). Pallas' interpreter clamps a window
    to the array instead (its rows would shift), so there x gets `chunk` zero rows."""
    if not interpret:
        return x
    return jnp.pad(x, ((0, chunk),) + ((0, 0),) * (x.ndim - 1))
