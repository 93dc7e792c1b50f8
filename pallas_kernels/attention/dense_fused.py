"""Dense causal attention for training through `jax.nn.dot_product_attention`: cuDNN's fused
(flash) kernel on NVIDIA GPUs, forward and backward, never materialising the [L, L] scores.

The jnp reference (`causal_attention_reference`) computes the scores in float32 and keeps them for
the backward pass: at the demo target's 32 x 1024-token batches that is 0.8 GB per layer written,
masked, normalised and read again several times per step, most of a training step's time
(checkpoints/README.md). cuDNN takes bf16/fp16 q/k/v with grouped KV heads; the variants it has no
mask for here (soft-cap, sinks, sliding windows, chunks) and float32 inputs stay on the reference.
`implementation="xla"` is JAX's unfused composition, the same math on any platform (what the CPU
tests compare with the reference).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from pallas_kernels.attention.reference import causal_attention_reference

IMPLEMENTATIONS = ("cudnn", "xla")


def fused_causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, scale: float,
                           softcap: float | None = None, window: int | None = None,
                           sinks: jax.Array | None = None, implementation: str = "cudnn",
                           chunk: int | None = None) -> jax.Array:
    """`causal_attention_reference`'s contract: q [B, L, Hq, D], k/v [B, L, Hkv, D] -> [B, L, Hq, D]."""
    half = q.dtype in (jnp.bfloat16, jnp.float16)
    if softcap is not None or sinks is not None or window is not None or chunk is not None or (
            implementation == "cudnn" and not half):
        return causal_attention_reference(q, k, v, scale=scale, softcap=softcap, window=window,
                                          sinks=sinks, chunk=chunk)
    return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=True,
                                        implementation=implementation)


def with_fused_dense(kernels, implementation: str = "cudnn"):
    """`kernels` (the model's kernel table, jaxinfer/model/kernel_table.py) whose dense attention
    slot (`train_forward`) is `fused_causal_attention`."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"dense attention '{implementation}' is not one of {IMPLEMENTATIONS}")
    return dataclasses.replace(
        kernels, dense_attention=functools.partial(fused_causal_attention,
                                                   implementation=implementation))
