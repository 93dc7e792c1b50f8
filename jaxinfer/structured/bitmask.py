"""Packed token bitmasks: int32[rows, ceil(V/32)], bit j of word i allows token 32*i + j (the layout
llguidance and xgrammar fill). `apply_token_bitmask` runs inside the jitted sampler;
`unpack_bitmask` is its numpy reference and the host's reader."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def bitmask_words(vocab_size: int) -> int:
    return -(-vocab_size // 32)


def allow_all(rows: int, vocab_size: int) -> np.ndarray:
    """A bitmask allowing every token (rows without a grammar, padding rows)."""
    return np.full((rows, bitmask_words(vocab_size)), -1, np.int32)


def apply_token_bitmask(logits: jax.Array, bitmask: jax.Array) -> jax.Array:
    """logits f32[S, V], bitmask i32[S, ceil(V/32)] -> logits with disallowed tokens at -inf."""
    s, v = logits.shape
    bits = (bitmask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1  # [S, W, 32]
    allowed = bits.reshape(s, -1)[:, :v].astype(jnp.bool_)
    return jnp.where(allowed, logits, -jnp.inf)


def unpack_bitmask(bitmask: np.ndarray, vocab_size: int) -> np.ndarray:
    """bool[S, V]: which tokens each row allows."""
    as_bytes = np.ascontiguousarray(bitmask, dtype="<i4").view(np.uint8)
    return np.unpackbits(as_bytes, axis=-1, bitorder="little")[:, :vocab_size].astype(bool)
