"""FP8 KV cache: quantize on write, per-layer K and V scales applied around the attention kernels.

A cached K row is stored as k / k_scale in float8_e4m3fn, saturated to ±448 (e4m3fn has no
infinity: an unsaturated overflow would become NaN); it stands for k8 · k_scale, and V likewise.
The scales never reach a kernel:

    q · (k8 · ks) = (q · ks) · k8          Σ_j p_j (v8_j · vs) = vs · Σ_j p_j v8_j

so a layer's attention multiplies q by its k scale before attending and the output by its v scale
after, and every kernel (and the jnp reference) only reads fp8 pages and widens them to 16 or 32
bits, which is exact: every e4m3 value is a float16, bfloat16 and float32 value. Calibrated scales
are powers of two (`kv_scales.py`), so both products are exact too. Keeping the scales out of the
kernels keeps one traced kernel for all layers: the nested jit of `backend.py` is keyed on the
backend and the softmax scale, which every layer shares.

Wrapping order: `FP8KVAttention(backend)` is what the model is given; `for_layer(i)` returns the
layer's `FP8LayerAttention`, whose `write_kv` and `__call__` have the backend's signatures.
Prefix caching, copy-on-write and block copies move whole fp8 blocks and need nothing from here.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

FP8_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))


def is_fp8(dtype) -> bool:
    return jnp.dtype(dtype) in FP8_DTYPES


def fp8_max(dtype) -> float:
    """Largest finite value of an fp8 type (448 for e4m3fn, 57344 for e5m2)."""
    return float(jnp.finfo(dtype).max)


def quantize(x: jax.Array, scale, dtype=jnp.float8_e4m3fn) -> jax.Array:
    """x / scale rounded to `dtype`, saturated to its finite range."""
    top = fp8_max(dtype)
    return jnp.clip(x.astype(jnp.float32) / scale, -top, top).astype(dtype)


def dequantize(x8: jax.Array, scale, dtype=jnp.float32) -> jax.Array:
    return (x8.astype(jnp.float32) * scale).astype(dtype)


def _scaled(x: jax.Array, s: float) -> jax.Array:
    return x if s == 1.0 else (x.astype(jnp.float32) * s).astype(x.dtype)


@dataclasses.dataclass(frozen=True)
class FP8LayerAttention:
    """One layer's attention over an fp8 cache with static scales (hashable: part of the step's
    compile key)."""
    inner: Any  # AttentionBackend or ShardedAttention
    k_scale: float
    v_scale: float

    @property
    def name(self) -> str:
        return self.inner.name

    def write_kv(self, k_cache, v_cache, k, v, slot_mapping):
        return self.inner.write_kv(k_cache, v_cache, quantize(k, self.k_scale, k_cache.dtype),
                                   quantize(v, self.v_scale, v_cache.dtype), slot_mapping)

    def __call__(self, q, k_cache, v_cache, md, *, scale: float, softcap: float | None = None,
                 window: int | None = None, sinks: jax.Array | None = None,
                 chunk: int | None = None):
        # The k scale sits in q, so scores (and the softcap and sinks that act on them) are as
        # with a bf16 cache.
        out = self.inner(_scaled(q, self.k_scale), k_cache, v_cache, md, scale=scale,
                         softcap=softcap, window=window, sinks=sinks, chunk=chunk)
        return _scaled(out, self.v_scale)


@dataclasses.dataclass(frozen=True)
class FP8KVAttention:
    """The model-level backend of an fp8 cache: per layer i, k_scales[i] and v_scales[i]."""
    inner: Any
    k_scales: tuple[float, ...]
    v_scales: tuple[float, ...]

    @property
    def name(self) -> str:
        return f"{self.inner.name}/fp8kv"

    def for_layer(self, i: int) -> FP8LayerAttention:
        return FP8LayerAttention(self.inner.for_layer(i), self.k_scales[i], self.v_scales[i])
