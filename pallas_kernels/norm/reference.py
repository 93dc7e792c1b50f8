"""Pure-jnp residual add + RMSNorm: the CPU path and the oracle `rms_norm`'s kernel is tested against."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def add_rms_norm_reference(x: jax.Array, residual: jax.Array, weight: jax.Array, *,
                           eps: float) -> tuple[jax.Array, jax.Array]:
    """(x + residual, RMSNorm(x + residual) * weight) in HF's order of operations: the add in the
    input dtype, the normalisation in float32, cast back before the weight multiplies it."""
    h = x + residual
    hf = h.astype(jnp.float32)
    y = hf * jax.lax.rsqrt(jnp.mean(hf * hf, axis=-1, keepdims=True) + eps)
    return h, weight.astype(h.dtype) * y.astype(h.dtype)
