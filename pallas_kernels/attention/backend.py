"""The one dispatch point for paged attention: which implementation runs the decode part and which
the prefill part of a step, by the `--attention-backend` name (jaxinfer/model/kernel_table.py
decides "auto" from the platform and puts the backend in the model's kernel table).

A backend is three functions with fixed signatures (see `reference.py` for their meaning):

    write_kv(k_cache, v_cache, k[T,Hkv,D], v[T,Hkv,D], slot_mapping[T]) -> (k_cache, v_cache)
    decode(q[S,Hq,D], k_cache, v_cache, block_tables[S,M], seq_lens[S],
           *, scale, softcap, window, sinks) -> [S,Hq,D]
    prefill(q[T,Hq,D], k_cache, v_cache, query_start_loc[S+1], seq_lens[S], block_tables[S,M],
            *, scale, softcap, window, sinks) -> [T,Hq,D]

The attention variants, the same keywords on every backend and wrapper:
- `softcap: float | None` (static): scores = softcap * tanh(scores / softcap) after the scale,
  before masking (Gemma 2);
- `window: int | None` (static): a query at position p sees keys at p - window < j <= p (HF's
  sliding window); None = full causal;
- `sinks: float32[Hq] | None` (traced): one learned logit per query head added to the softmax
  denominator, its probability dropped (gpt-oss);
- `chunk: int | None` (static, the wrapper's only): a query at p sees keys p - p % chunk <= j <= p
  (Llama 4's chunked local layers). A backend whose kernels take it says `chunked_local`; the
  others run those layers on the reference's decode and prefill (correct, not fast).

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

from pallas_kernels.attention import reference
from pallas_kernels.attention.metadata import AttentionMetadata


@dataclasses.dataclass(frozen=True)
class AttentionBackend:
    name: str
    decode: Callable
    prefill: Callable
    write_kv: Callable = reference.write_kv
    # Mixed steps (a static num_decodes of 0: any prefill chunk in the step) send their leading
    # one-token sequences to `decode` too, found on the device. Worth it for kernels: the prefill
    # kernel gives each such row a whole query tile per *query* head (Hq/Hkv times the K/V reads of
    # the decode kernel, and a 128-row matmul for one row). The reference gains nothing from it.
    split_mixed_steps: bool = False
    # Whether `decode` and `prefill` take the `chunk` keyword (the module docstring).
    chunked_local: bool = False

    def __call__(self, q: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
                 md: AttentionMetadata, *, scale: float, softcap: float | None = None,
                 window: int | None = None, sinks: jax.Array | None = None,
                 chunk: int | None = None) -> jax.Array:
        """Attention for every token of the step: decode tokens first, then the ragged prefill part."""
        backend = self
        if chunk is not None and not self.chunked_local:
            backend = dataclasses.replace(self, decode=reference.paged_decode_reference,
                                          prefill=reference.ragged_prefill_reference,
                                          split_mixed_steps=False, chunked_local=True)
        return _attend(backend, q, k_cache, v_cache, md, sinks, scale=scale, softcap=softcap,
                       window=window, chunk=chunk)

    def for_layer(self, i: int) -> "AttentionBackend":
        """The backend layer i calls: the same for every layer (`kv_quant.FP8KVAttention` gives
        each layer its own scales)."""
        return self


# A nested jit: every layer calls attention with the same shapes, so the kernels are traced and
# lowered once per step shape instead of once per layer (Mosaic GPU kernels are lowered in Python,
# which is a large part of a step's compile time; XLA inlines the call, so nothing changes at run time).
@functools.partial(jax.jit, static_argnums=0,
                   static_argnames=("scale", "softcap", "window", "chunk"))
def _attend(backend: AttentionBackend, q, k_cache, v_cache, md: AttentionMetadata, sinks, *,
            scale, softcap, window, chunk=None):
    variant = dict(scale=scale, softcap=softcap, window=window, sinks=sinks)
    if chunk is not None:
        variant["chunk"] = chunk
    nd = md.num_decodes
    t = q.shape[0]
    if nd == 0 and backend.split_mixed_steps and md.num_seqs:
        return _attend_mixed(backend, q, k_cache, v_cache, md, **variant)
    parts = []
    if nd:
        parts.append(backend.decode(q[:nd], k_cache, v_cache, md.block_tables[:nd],
                                    md.seq_lens[:nd], **variant))
    if t > nd:
        qsl = md.query_start_loc[nd:] - nd
        parts.append(backend.prefill(q[nd:], k_cache, v_cache, qsl, md.seq_lens[nd:],
                                     md.block_tables[nd:], **variant))
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=0)


def _attend_mixed(backend: AttentionBackend, q, k_cache, v_cache, md: AttentionMetadata,
                  **variant):
    """A mixed step whose decode count is only known on the device: the leading run of one-token
    sequences (the scheduler puts decodes first; a one-token prefill chunk there is the same
    attention) goes to `decode`, every later sequence to `prefill`. Both kernels run on static
    shapes: `decode` sees all S rows with the others' lengths set to 0 (empty work items), `prefill`
    sees the decode sequences as empty ones starting where the first prefill token is."""
    s = md.num_seqs
    qsl = md.query_start_loc
    one_token = (qsl[1:] - qsl[:-1]) == 1
    num_decodes = jnp.sum(jnp.cumprod(one_token.astype(jnp.int32)))
    is_decode = jnp.arange(s) < num_decodes  # sequence i < num_decodes owns token i
    decoded = backend.decode(q[:s], k_cache, v_cache, md.block_tables,
                             jnp.where(is_decode, md.seq_lens, 0), **variant)
    prefilled = backend.prefill(q, k_cache, v_cache, jnp.maximum(qsl, num_decodes), md.seq_lens,
                                md.block_tables, **variant)
    head = jnp.where(is_decode[:, None, None], decoded, prefilled[:s])
    return jnp.concatenate([head, prefilled[s:]], axis=0)


REFERENCE = AttentionBackend("reference", reference.paged_decode_reference,
                             reference.ragged_prefill_reference, chunked_local=True)

# name -> "module:attribute" of an AttentionBackend, imported on first use.
_BACKENDS: dict[str, str] = {}


def register(name: str, target: str) -> None:
    _BACKENDS[name] = target


def registered() -> list[str]:
    """The registered kernel backends' names (the reference is always there)."""
    return sorted(_BACKENDS)


def available_backends() -> list[str]:
    return ["auto", "reference", *sorted(_BACKENDS)]


def get_backend(name: str) -> AttentionBackend:
    """The backend registered as `name` ("auto" is the kernel table's to decide)."""
    if name == "reference":
        return REFERENCE
    if name not in _BACKENDS:
        raise ValueError(f"--attention-backend '{name}' is not one of: {', '.join(available_backends())}")
    module, attr = _BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), attr)


register("mosaic", "pallas_kernels.attention.gpu_backends:MOSAIC")
register("triton", "pallas_kernels.attention.gpu_backends:TRITON")
