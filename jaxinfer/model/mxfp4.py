"""MXFP4 weights (OCP Microscaling FP4, gpt-oss's expert stacks) dequantized on load.

A checkpoint stores each [out, in] expert matrix as `*_blocks` uint8 [E, out, in / 32, 16] (two
e2m1 values a byte, the low nibble first) and `*_scales` uint8 [E, out, in / 32] (one e8m0 exponent,
biased by 127, per block of 32 values). A value is e2m1 * 2^(scale - 127), exactly what HF's
`convert_moe_packed_tensors` computes.

The dequantized values are exact in bfloat16: an e2m1 value has at most two significant bits and
bfloat16 has float32's exponent range, so every product is representable unless a block's scale
leaves the normal range (2^-126 .. 2^127), which no real checkpoint's does. The model then runs the
bf16 experts through the grouped-matmul kernel (or, with --quantization fp8, re-quantizes them per
channel to e4m3: not exact, one rounding per value). Running MXFP4 inside the kernel (4-bit weight
reads) is not implemented.
"""

from __future__ import annotations

import numpy as np

FP4_VALUES = np.array([+0.0, +0.5, +1.0, +1.5, +2.0, +3.0, +4.0, +6.0,
                       -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)
BLOCK = 32  # values per scale


def dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """blocks uint8 [..., G, 16], scales uint8 [..., G] -> float32 [..., G * 32]."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != BLOCK // 2:
        raise ValueError(f"MXFP4 blocks {list(blocks.shape)} and scales {list(scales.shape)} "
                         f"do not match (blocks [..., G, 16], scales [..., G])")
    lo, hi = FP4_VALUES[blocks & 0x0F], FP4_VALUES[blocks >> 4]
    values = np.stack([lo, hi], axis=-1).reshape(*blocks.shape[:-1], BLOCK)
    exponents = scales.astype(np.int32)[..., None] - 127
    return np.ldexp(values, exponents).reshape(*blocks.shape[:-2], -1)


def quantize(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The inverse for values already on the MXFP4 grid (tests and fixtures): float [..., K]
    (K a multiple of 32) -> (blocks, scales) with `dequantize(blocks, scales) == w`. The scale is
    the smallest power of two that puts the block's largest magnitude within e2m1's 6.0."""
    *lead, k = w.shape
    blocks = w.astype(np.float32).reshape(*lead, k // BLOCK, BLOCK)
    amax = np.abs(blocks).max(axis=-1)
    exp = np.where(amax > 0, np.ceil(np.log2(np.maximum(amax, 1e-30) / 6.0)), 0).astype(np.int32)
    scaled = blocks / np.ldexp(1.0, exp)[..., None]
    codes = np.abs(scaled[..., None] - FP4_VALUES).argmin(axis=-1).astype(np.uint8)
    if not np.array_equal(FP4_VALUES[codes] * np.ldexp(1.0, exp)[..., None], blocks):
        raise ValueError("values are not on the MXFP4 grid")
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
    # C order: numpy keeps a transposed input's layout, which safetensors would write as is
    return np.ascontiguousarray(packed), np.ascontiguousarray(exp + 127, dtype=np.uint8)
