"""Quantized weights' arithmetic: per-channel quantization, and the one matmul every quantized
linear layer runs (`quantized_matmul`).

Weights are stored [out, in] (the Hugging Face layout: K-major, which is the layout cuBLASLt's FP8
gemm takes its second operand in, so no transpose runs per step) with one float32 scale per output
channel: `w ≈ q * scale[:, None]`. Expert stacks keep the grouped-matmul layout [E, in, out] with
scales [E, out]; `quantize` takes the reduction axis.

`quantized_matmul` has three implementations:

- "fp8" (W8A8): each token's activations are quantized to e4m3 with their own scale (amax / 448,
  computed in the step), the product of the two e4m3 operands accumulates in float32 (Hopper's FP8
  tensor cores through XLA's cuBLASLt FP8 gemm), and the token and channel scales multiply the
  output as an outer product, which is exact: y[t, n] = sx[t] * sw[n] * sum_k xq[t, k] * wq[n, k].
- "dequant" (weight-only, W8A16): the stored weight is converted to the activation dtype inside the
  dot and the channel scale multiplies the output. What int8 weights always run, and what FP8
  weights run where FP8 tensor cores are absent (compute capability < 8.9).
- "mosaic": the "fp8" arithmetic in a Mosaic GPU weight-streaming kernel for few rows
  (`pallas_kernels/matmul/fp8_matmul_mosaic.py`: swap-AB fp8 wgmma fed by a deep TMA ring, persistent
  CTAs, split K), for Hopper (compute capability >= 9.0) steps of at most its MAX_ROWS rows. Off by
  default (MOSAIC_DEFAULT): on the H200 it beats "dequant" per projection at one row but not in the
  decode step, where the glue around each call (x's quantization, the split sum) adds a kernel
  launch per piece (docs/quantization.md); on the CPU it runs in Mosaic GPU's interpreter.

On the CPU all three are exact emulations of the GPU arithmetic (XLA upcasts the 8-bit operands).
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp

FP8 = jnp.float8_e4m3fn
FP8_MAX = float(jnp.finfo(FP8).max)  # 448
INT8_MAX = 127.0
STORAGE = {"fp8": FP8, "int8": jnp.int8}
IMPLS = ("fp8", "dequant", "mosaic")
# Rows (tokens) below which FP8 weights take the weight-only path on a GPU with FP8 tensor cores.
# Measured on the H200 (benchmarks/bench_quant.py, Llama-3-8B's projections): at 8 rows cuBLASLt's
# FP8 gemm streamed the weights at 0.97 TB/s, slower than the bf16 weights it replaces, while at
# 256 rows it beat bf16 by 1.25x; below this the step is a weight stream, which the weight-only
# dot reads at half the bf16 bytes.
FP8_GEMM_MIN_ROWS = 128
# Whether steps of fewer than FP8_GEMM_MIN_ROWS rows take the "mosaic" kernel by default on Hopper;
# $JAXINFER_QUANT_IMPL=mosaic forces it either way.
MOSAIC_DEFAULT = False


def _qmax(dtype) -> float:
    return FP8_MAX if jnp.dtype(dtype) == jnp.dtype(FP8) else INT8_MAX


def _cast(x: jax.Array, dtype) -> jax.Array:
    """x (already scaled into range) to the 8-bit storage type: clipped (e4m3fn has no infinity,
    so an overflow would be NaN) and, for int8, rounded to nearest."""
    m = _qmax(dtype)
    x = jnp.clip(x, -m, m)
    return (jnp.round(x) if jnp.dtype(dtype) == jnp.dtype(jnp.int8) else x).astype(dtype)


def quantize(w: jax.Array, mode: str, axis: int = -1) -> tuple[jax.Array, jax.Array]:
    """Symmetric quantization with one scale per slice along `axis` (the reduction axis of the
    weight's matmul): returns (q in the mode's storage dtype, float32 scales with `axis` removed)
    with w ≈ q * scale."""
    dtype = STORAGE[mode]
    wf = w.astype(jnp.float32)
    amax = jnp.max(jnp.abs(wf), axis=axis, keepdims=True)
    scale = jnp.maximum(amax, jnp.finfo(jnp.float32).tiny) / _qmax(dtype)
    return _cast(wf / scale, dtype), jnp.squeeze(scale, axis)


def dequantize(q: jax.Array, scale: jax.Array, axis: int = -1, dtype=jnp.float32) -> jax.Array:
    return (q.astype(jnp.float32) * jnp.expand_dims(scale, axis)).astype(dtype)


def quantize_tokens(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Dynamic per-token e4m3 activations: (xq [..., K], scale [..., 1] float32)."""
    q, s = quantize(x, "fp8", axis=-1)
    return q, s[..., None]


@functools.cache
def compute_capability() -> tuple[int, int]:
    """The default device's NVIDIA compute capability; (0, 0) for any other device."""
    dev = jax.devices()[0]
    if dev.platform != "gpu":
        return 0, 0
    try:
        major, minor = (int(v) for v in str(dev.compute_capability).split(".")[:2])
    except (AttributeError, ValueError):
        return 0, 0
    return major, minor


def fp8_tensor_cores() -> bool:
    """The default device has FP8 tensor cores (NVIDIA compute capability >= 8.9)."""
    return compute_capability() >= (8, 9)


def mosaic_fits(rows: int, weight_shape: tuple[int, ...] | None) -> bool:
    """The "mosaic" kernel takes this step: few enough rows and a weight [N, K] that it tiles."""
    from pallas_kernels.matmul import fp8_matmul_mosaic as kernel
    return (weight_shape is not None and rows <= kernel.MAX_ROWS
            and kernel.supports(*weight_shape))


def choose_impl(rows: int, weight_dtype, weight_shape: tuple[int, ...] | None = None) -> str:
    """What `quantized_matmul` runs for `rows` tokens against a weight of `weight_shape` [N, K];
    $JAXINFER_QUANT_IMPL (one of IMPLS) overrides it for FP8 weights, for benchmarks and
    bisection ("mosaic" where the kernel takes the step, else the choice without the override)."""
    if jnp.dtype(weight_dtype) != jnp.dtype(FP8):
        return "dequant"
    forced = os.environ.get("JAXINFER_QUANT_IMPL")
    if forced:
        if forced not in IMPLS:
            raise ValueError(f"JAXINFER_QUANT_IMPL={forced!r}: expected one of {IMPLS}")
        if forced != "mosaic" or mosaic_fits(rows, weight_shape):
            return forced
    if jax.devices()[0].platform == "cpu":
        return "fp8"  # the GPU's arithmetic, emulated: what accuracy tests should see
    return pick_impl(rows, compute_capability(), mosaic_fits(rows, weight_shape), MOSAIC_DEFAULT)


def pick_impl(rows: int, capability: tuple[int, int], fits: bool, mosaic: bool) -> str:
    """`choose_impl`'s rule for FP8 weights on a GPU of `capability` where the "mosaic" kernel
    takes the step (`fits`) and is switched on (`mosaic`)."""
    if rows >= FP8_GEMM_MIN_ROWS and capability >= (8, 9):
        return "fp8"
    if mosaic and fits and capability >= (9, 0):
        return "mosaic"
    return "dequant"


def quantized_matmul(x: jax.Array, w: jax.Array, scale: jax.Array, impl: str | None = None,
                     out_dtype=None) -> jax.Array:
    """x [..., K] @ dequantize(w [N, K], scale [N]).T -> [..., N] in x's dtype (or `out_dtype`)."""
    out_dtype = out_dtype or x.dtype
    rows = 1
    for d in x.shape[:-1]:
        rows *= d
    impl = impl or choose_impl(rows, w.dtype, w.shape)
    dims = (((x.ndim - 1,), (1,)), ((), ()))
    if impl == "fp8":
        xq, xs = quantize_tokens(x)
        # XLA merges dots that share an operand (q/k/v, gate/up) into one gemm over the
        # concatenation of their weights, and for cuBLASLt's FP8 gemm that concatenation is a copy
        # of the weights in every step (seen on the H200); the barrier gives each its own operand.
        xq, w = jax.lax.optimization_barrier((xq, w))
        y = jax.lax.dot_general(xq, w, dims, preferred_element_type=jnp.float32)
        return (y * xs * scale).astype(out_dtype)
    if impl == "mosaic":
        from pallas_kernels.matmul.fp8_matmul_mosaic import fp8_matmul
        xq, xs = quantize_tokens(x.reshape(rows, x.shape[-1]))
        y = fp8_matmul(xq, xs[:, 0], w, scale, out_dtype=out_dtype,
                       interpret=jax.devices()[0].platform == "cpu")
        return y.reshape(*x.shape[:-1], w.shape[0])
    if impl == "dequant":
        y = jax.lax.dot_general(x, w.astype(x.dtype), dims, preferred_element_type=jnp.float32)
        return (y * scale).astype(out_dtype)
    raise ValueError(f"impl={impl!r}: expected one of {IMPLS}")
