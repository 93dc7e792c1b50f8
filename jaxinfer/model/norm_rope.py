"""The layers every family shares outside attention and the MLP: RMSNorm (plain or Gemma's
(1 + w)) and rotary position embeddings (HF's rotate-half layout; cos/sin tables per position)."""

from __future__ import annotations

from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxinfer.model.config import ModelConfig, RopeConfig, rope_inv_freq
from pallas_kernels.norm.reference import add_rms_norm_reference


class RMSNorm(nn.Module):
    """RMSNorm of x; with `residual`, of x + residual, returning (x + residual, the norm) through
    `add_norm` (a backend's one-kernel add + norm, else the jnp reference). `offset` (Gemma): the
    stored weight w scales by (1 + w), in float32 before the cast back, as HF's Gemma norms do."""
    eps: float
    dtype: jnp.dtype
    add_norm: Callable | None = None
    offset: bool = False

    @nn.compact
    def __call__(self, x: jax.Array, residual: jax.Array | None = None):
        init = nn.initializers.zeros if self.offset else nn.initializers.ones
        weight = self.param("weight", init, (x.shape[-1],), self.dtype)
        if residual is not None and not self.offset:
            return (self.add_norm or add_rms_norm_reference)(x, residual, weight, eps=self.eps)
        if residual is not None:
            x = x + residual
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        if self.offset:
            y = (xf * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)
        else:
            y = weight.astype(x.dtype) * xf.astype(x.dtype)
        return y if residual is None else (x, y)


def rope_tables(cfg: ModelConfig, positions: jax.Array,
                rope: RopeConfig | None = None) -> tuple[jax.Array, jax.Array]:
    """cos/sin [..., D/2] in float32 for the given positions (of the model's rope, or `rope`);
    YaRN's attention factor multiplies both, as HF applies it."""
    rope = rope or cfg.rope
    inv_freq = jnp.asarray(rope_inv_freq(cfg, rope), jnp.float32)
    angles = positions.astype(jnp.float32)[..., None] * inv_freq
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    if rope.attention_factor != 1.0:
        cos, sin = cos * rope.attention_factor, sin * rope.attention_factor
    return cos, sin


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half RoPE (HF's non-interleaved layout). x: [..., heads, D]; cos/sin: [..., R/2]
    turning the first R dims (R < D: partial rotary, the rest pass through as HF's)."""
    xf = x.astype(jnp.float32)
    half = cos.shape[-1]
    x1, x2, rest = xf[..., :half], xf[..., half:2 * half], xf[..., 2 * half:]
    c, s = cos[..., None, :], sin[..., None, :]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s, rest], axis=-1).astype(x.dtype)
