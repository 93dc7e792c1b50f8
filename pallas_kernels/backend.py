"""The one dispatch point for attention: which implementation runs the decode part and which the
prefill part of a step, chosen by platform and the `--attention-backend` flag.

A backend is three functions with fixed signatures (see `reference.py` for their meaning):

    write_kv(k_cache, v_cache, k[T,Hkv,D], v[T,Hkv,D], slot_mapping[T]) -> (k_cache, v_cache)
    decode(q[S,Hq,D], k_cache, v_cache, block_tables[S,M], seq_lens[S], *, scale, softcap) -> [S,Hq,D]
    prefill(q[T,Hq,D], k_cache, v_cache, query_start_loc[S+1], seq_lens[S], block_tables[S,M],
            *, scale, softcap) -> [T,Hq,D]

Kernel modules register themselves in `_BACKENDS` lazily (importing a Mosaic GPU module on a CPU
machine is fine, but compiling it is not), so adding a kernel touches this file only.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from typing import Callable

import jax
import jax.numpy as jnp

from pallas_kernels import reference
from pallas_kernels.metadata import AttentionMetadata


@dataclasses.dataclass(frozen=True)
class AttentionBackend:
    name: str
    decode: Callable
    prefill: Callable
    write_kv: Callable = reference.write_kv

    def __call__(self, q: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
                 md: AttentionMetadata, *, scale: float, softcap: float | None = None) -> jax.Array:
        """Attention for every token of the step: decode tokens first, then the ragged prefill part."""
        return _attend(self, q, k_cache, v_cache, md, scale=scale, softcap=softcap)


# A nested jit: every layer calls attention with the same shapes, so the kernels are traced and
# lowered once per step shape instead of once per layer (Mosaic GPU kernels are lowered in Python,
# which is a large part of a step's compile time; XLA inlines the call, so nothing changes at run time).
@functools.partial(jax.jit, static_argnums=0, static_argnames=("scale", "softcap"))
def _attend(backend: AttentionBackend, q, k_cache, v_cache, md: AttentionMetadata, *, scale, softcap):
    nd = md.num_decodes
    t = q.shape[0]
    parts = []
    if nd:
        parts.append(backend.decode(q[:nd], k_cache, v_cache, md.block_tables[:nd],
                                    md.seq_lens[:nd], scale=scale, softcap=softcap))
    if t > nd:
        qsl = md.query_start_loc[nd:] - nd
        parts.append(backend.prefill(q[nd:], k_cache, v_cache, qsl, md.seq_lens[nd:],
                                     md.block_tables[nd:], scale=scale, softcap=softcap))
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=0)


REFERENCE = AttentionBackend("reference", reference.paged_decode_reference,
                             reference.ragged_prefill_reference)

# name -> "module:attribute" of an AttentionBackend, imported on first use.
_BACKENDS: dict[str, str] = {}


def register(name: str, target: str) -> None:
    _BACKENDS[name] = target


def available_backends() -> list[str]:
    return ["auto", "reference", *sorted(_BACKENDS)]


def _is_hopper() -> bool:
    dev = jax.devices()[0]
    return dev.platform == "gpu" and getattr(dev, "compute_capability", "0").startswith("9")


def get_backend(name: str = "auto") -> AttentionBackend:
    """Resolve a backend name. `auto`: Mosaic GPU kernels on Hopper, Triton-lowered Pallas on other
    CUDA GPUs, the jnp reference elsewhere (CPU)."""
    if name == "auto":
        platform = jax.devices()[0].platform
        if platform == "gpu" and _is_hopper() and "mosaic" in _BACKENDS:
            name = "mosaic"
        elif platform == "gpu" and "triton" in _BACKENDS:
            name = "triton"
        else:
            name = "reference"
    if name == "reference":
        return REFERENCE
    if name not in _BACKENDS:
        raise ValueError(f"--attention-backend '{name}' is not one of: {', '.join(available_backends())}")
    module, attr = _BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), attr)


register("mosaic", "pallas_kernels.gpu_backends:MOSAIC")
register("triton", "pallas_kernels.gpu_backends:TRITON")
