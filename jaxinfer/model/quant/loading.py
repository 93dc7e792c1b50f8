"""Quantized params on the device, from any source of weights.

Every quantized param (a linear's `weight` [out, in], or an expert stack [E, in, out]) is placed on
its devices as the checkpoint stores it, then `finalize` turns it into the stored form the model
runs (8-bit values + float32 scales per output channel) inside one jitted call, on its shards:

- an FP8/int8 checkpoint with per-channel scales: the values and scales as they are;
- per-tensor scales (transformers' FP8, compressed-tensors' tensor strategy): the same values, the
  scale repeated per channel;
- 2-D block scales (`weight_block_size`, DeepSeek-style `weight_scale_inv`): dequantized in float32,
  then re-quantized per channel (one extra rounding of each value to e4m3);
- bf16/f16/f32 weights (`--quantization` on an unquantized checkpoint, dummy and orbax weights):
  quantized per channel.

A row-parallel shard holds part of each channel's inputs; the channel maximum is a reduction XLA
runs across the shards, so the scales do not depend on the tensor-parallel size.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxinfer.errors import CheckpointError
from jaxinfer.model.quant.layers import scale_name
from jaxinfer.model.quant.ops import STORAGE, quantize

Key = tuple[str, ...]


def quantized_keys(expected: dict[Key, jax.ShapeDtypeStruct]) -> dict[Key, Key]:
    """weight param path -> its scale param path, for every quantized param of the tree."""
    return {key: key[:-1] + (scale_name(key[-1]),) for key in expected
            if key[:-1] + (scale_name(key[-1]),) in expected}


def reduce_axis(key: Key) -> int:
    """The input axis of a quantized param: [out, in] linears -1, [E, in, out] expert stacks -2."""
    return -1 if key[-1] == "weight" else -2


def unquantized_key(key: Key, quantized: dict[Key, Key]) -> Key:
    """Where an unquantized tree holds the same param: a quantized linear's weight is the [in, out]
    `kernel` there (a norm's `weight` is itself)."""
    return key[:-1] + ("kernel",) if key in quantized and key[-1] == "weight" else key


def _block_scales(scale: jax.Array, out_in: tuple[int, int]) -> jax.Array:
    """Block scales [..., ceil(N/bn), ceil(K/bk)] expanded to [..., N, K]; the block sizes are the
    powers of two the grid implies (checkpoints use 128 x 128)."""
    (n, k), (sn, sk) = out_in, scale.shape[-2:]
    bn, bk = (1 << max(0, math.ceil(math.log2(d / s))) for d, s in ((n, sn), (k, sk)))
    if -(-n // bn) != sn or -(-k // bk) != sk:
        raise CheckpointError(f"block scales of shape {list(scale.shape)} do not tile a "
                              f"[{n}, {k}] weight")
    full = jnp.repeat(jnp.repeat(scale, bn, axis=-2), bk, axis=-1)
    return full[..., :n, :k]


def _scale_like(scale: jax.Array, w_shape: tuple[int, ...], axis: int) -> tuple[jax.Array, bool]:
    """A checkpoint's scales broadcastable against the weight (param layout), and whether they are
    per channel or coarser (then the stored values are kept as they are)."""
    lead = w_shape[:-2]
    per_tensor = math.prod(lead)
    out_axis = -2 if axis == -1 else -1
    channels = w_shape[out_axis]
    s = scale.astype(jnp.float32)
    if s.size == per_tensor:
        return s.reshape(*lead, 1, 1), True
    if s.size == per_tensor * channels:
        return jnp.expand_dims(s.reshape(*lead, channels), axis), True
    out_in = (w_shape[-2], w_shape[-1]) if axis == -1 else (w_shape[-1], w_shape[-2])
    full = _block_scales(s.reshape(*lead, *s.shape[-2:]), out_in)
    return (full if axis == -1 else jnp.swapaxes(full, -1, -2)), False


def finalize(weight: jax.Array, scale: np.ndarray | None, mode: str, axis: int,
             out_shardings=None) -> tuple[jax.Array, jax.Array]:
    """(8-bit values, float32 per-channel scales) from a weight as its source stores it and the
    source's scales (None: an unquantized weight)."""
    if out_shardings is not None and all(sh is None for sh in out_shardings):
        out_shardings = None
    return _finalize_fn(mode, axis, scale is None, out_shardings)(weight, scale)


@functools.lru_cache(maxsize=None)
def _finalize_fn(mode: str, axis: int, unscaled: bool, out_shardings):
    storage = jnp.dtype(STORAGE[mode])

    def run(w, scale):
        if unscaled:
            return quantize(w, mode, axis)
        s, channelwise = _scale_like(scale, w.shape, axis)
        if channelwise and w.dtype == storage:
            return w, jnp.squeeze(jnp.broadcast_to(s, _channel_shape(w.shape, axis)), axis)
        return quantize(w.astype(jnp.float32) * s, mode, axis)
    return jax.jit(run, out_shardings=out_shardings)


def _channel_shape(w_shape: tuple[int, ...], axis: int) -> tuple[int, ...]:
    shape = list(w_shape)
    shape[axis] = 1
    return tuple(shape)


def transposed_sharding(sharding, ndim: int):
    """The sharding of the transposed array ([in, out] for [out, in]) under the same mesh."""
    if not isinstance(sharding, NamedSharding):
        return sharding
    spec = tuple(sharding.spec) + (None,) * (ndim - len(sharding.spec))
    return NamedSharding(sharding.mesh, P(*spec[::-1]))


def quantize_unquantized(flat: dict[Key, jax.Array], expected: dict[Key, jax.ShapeDtypeStruct],
                         mode: str, shardings: dict[Key, object]) -> dict[Key, jax.Array]:
    """An unquantized param tree (flat, `kernel`s [in, out]) as the quantized tree `expected`,
    one weight at a time, each source array deleted once quantized."""
    scales = quantized_keys(expected)
    out: dict[Key, jax.Array] = {}
    for key in expected:
        if key in scales.values():
            continue
        src = flat.pop(unquantized_key(key, scales))
        if key not in scales:
            out[key] = src
            continue
        w = src.T if key[-1] == "weight" else src  # kernel [in, out] -> weight [out, in]
        out[key], out[scales[key]] = finalize(w, None, mode, reduce_axis(key),
                                              (shardings.get(key), shardings.get(scales[key])))
        src.delete()
        w.delete()
    return out
