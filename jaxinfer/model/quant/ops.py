"""Quantized weights' arithmetic: per-channel quantization, and the one matmul every quantized
linear layer runs (`quantized_matmul`).

Weights are stored [out, in] (the Hugging Face layout: K-major, which is the layout cuBLASLt's FP8
gemm takes its second operand in, so no transpose runs per step) with one float32 scale per output
channel: `w ≈ q * scale[:, None]`. Expert stacks keep the grouped-matmul layout [E, in, out] with
scales [E, out]; `quantize` takes the reduction axis.

`quantized_matmul` has two implementations (`--quant-impl`, the kernel table's `QuantizedMatmul`
slot, forces one for FP8 weights; "auto" picks by rows and device, `choose_impl`):

- "fp8" (W8A8): each token's activations are quantized to e4m3 with their own scale (amax / 448,
  computed in the step), the product of the two e4m3 operands accumulates in float32 (Hopper's FP8
  tensor cores through XLA's cuBLASLt FP8 gemm), and the token and channel scales multiply the
  output as an outer product, which is exact: y[t, n] = sx[t] * sw[n] * sum_k xq[t, k] * wq[n, k].
- "dequant" (weight-only, W8A16): the stored weight is converted to the activation dtype inside the
  dot and the channel scale multiplies the output. What int8 weights always run, and what FP8
  weights run where FP8 tensor cores are absent (compute capability < 8.9).

On the CPU both are exact emulations of the GPU arithmetic (XLA upcasts the 8-bit operands).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

FP8 = jnp.float8_e4m3fn
FP8_MAX = float(jnp.finfo(FP8).max)  # 448
INT8_MAX = 127.0
STORAGE = {"fp8": FP8, "int8": jnp.int8}
IMPLS = ("fp8", "dequant")
CHOICES = ("auto", *IMPLS)  # --quant-impl
# Rows (tokens) below which FP8 weights take the weight-only path on a GPU with FP8 tensor cores.
# Measured on the H200 (jaxinfer/bench/suites/quant.py, Llama-3-8B's projections): at 8 rows cuBLASLt's
# FP8 gemm streamed the weights at 0.97 TB/s, slower than the bf16 weights it replaces, while at
# 256 rows it beat bf16 by 1.25x; below this the step is a weight stream, which the weight-only
# dot reads at half the bf16 bytes.
FP8_GEMM_MIN_ROWS = 128


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


def choose_impl(rows: int, weight_dtype, impl: str = "auto",
                capability: tuple[int, int] | None = None) -> str:
    """What `quantized_matmul` runs for `rows` tokens against a weight of `weight_dtype`: int8
    weights always "dequant"; FP8 ones `impl` (one of CHOICES: `--quant-impl`), or with "auto" the
    rule of `pick_impl` on an accelerator of `capability` (NVIDIA compute capability; (0, 0): none)
    and "fp8" on the CPU, `capability` None (the GPU's arithmetic, emulated: what accuracy tests
    should see)."""
    if impl not in CHOICES:
        raise ValueError(f"quant_impl {impl!r}: expected one of {', '.join(CHOICES)}")
    if jnp.dtype(weight_dtype) != jnp.dtype(FP8):
        return "dequant"
    if impl != "auto":
        return impl
    if capability is None:
        return "fp8"
    return pick_impl(rows, capability)


def pick_impl(rows: int, capability: tuple[int, int]) -> str:
    """`choose_impl`'s rule for FP8 weights on a GPU of `capability`."""
    if rows >= FP8_GEMM_MIN_ROWS and capability >= (8, 9):
        return "fp8"
    return "dequant"


def quantized_matmul(x: jax.Array, w: jax.Array, scale: jax.Array, impl: str = "auto",
                     out_dtype=None, capability: tuple[int, int] | None = None) -> jax.Array:
    """x [..., K] @ dequantize(w [N, K], scale [N]).T -> [..., N] in x's dtype (or `out_dtype`);
    `impl`: one of CHOICES, `capability` the device's (`choose_impl`)."""
    out_dtype = out_dtype or x.dtype
    rows = 1
    for d in x.shape[:-1]:
        rows *= d
    impl = choose_impl(rows, w.dtype, impl, capability)
    dims = (((x.ndim - 1,), (1,)), ((), ()))
    if impl == "fp8":
        xq, xs = quantize_tokens(x)
        # XLA merges dots that share an operand (q/k/v, gate/up) into one gemm over the
        # concatenation of their weights, and for cuBLASLt's FP8 gemm that concatenation is a copy
        # of the weights in every step (seen on the H200); the barrier gives each its own operand.
        xq, w = jax.lax.optimization_barrier((xq, w))
        y = jax.lax.dot_general(xq, w, dims, preferred_element_type=jnp.float32)
        return (y * xs * scale).astype(out_dtype)
    y = jax.lax.dot_general(x, w.astype(x.dtype), dims, preferred_element_type=jnp.float32)
    return (y * scale).astype(out_dtype)


@dataclasses.dataclass(frozen=True)
class QuantizedMatmul:
    """The kernel table's quantized-matmul slot: `quantized_matmul` with `--quant-impl` and the
    device's compute capability (None: the CPU) bound once per engine."""
    impl: str = "auto"
    capability: tuple[int, int] | None = None

    def __call__(self, x: jax.Array, w: jax.Array, scale: jax.Array, out_dtype=None) -> jax.Array:
        return quantized_matmul(x, w, scale, self.impl, out_dtype, self.capability)
