"""The model's quantized layers: `linear(cfg, dtype, kernels)` is the Dense factory every projection of the
transformer uses, and `expert_weights` declares the MoE expert stacks.

A quantized linear holds `weight` [out, in] in the storage dtype, `weight_scale` [out] float32 and
(when the layer has one) `bias` [out] in the model dtype: the tensor names a compressed-tensors
checkpoint uses, so loading and saving map names one to one. Unquantized models keep nn.Dense's
params (`kernel` [in, out]), through gemm_rows.Dense.
"""

from __future__ import annotations

import functools
from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxinfer.model.config import ModelConfig
from jaxinfer.model.gemm_rows import Dense
from jaxinfer.model.quant.ops import STORAGE, QuantizedMatmul

EXPERT_PROJS = ("w_gate", "w_up", "w_down")
FUSED_EXPERT_PROJS = ("w_gate_up", "w_down")  # gate and up as one stack (fused_projections.py)


def scale_name(weight: str) -> str:
    """The param holding a quantized weight's scales: 'weight' -> 'weight_scale'."""
    return weight + "_scale"


class QuantLinear(nn.Module):
    features: int
    mode: str
    use_bias: bool = True
    dtype: jnp.dtype = jnp.bfloat16
    matmul: Callable = QuantizedMatmul()  # the kernel table's `quantized_matmul`

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        k = x.shape[-1]
        weight = self.param("weight", nn.initializers.zeros, (self.features, k), STORAGE[self.mode])
        scale = self.param(scale_name("weight"), nn.initializers.ones, (self.features,),
                           jnp.float32)
        y = self.matmul(x.astype(self.dtype), weight, scale)
        if self.use_bias:
            bias = self.param("bias", nn.initializers.zeros, (self.features,), self.dtype)
            y = y + bias.astype(y.dtype)
        return y


def linear(cfg: ModelConfig, dtype, kernels) -> functools.partial:
    """The Dense layer class of this model on `kernels` (the kernel table): gemm_rows.Dense, or
    QuantLinear under `cfg.quantization` (call it with features, use_bias= and name=)."""
    if cfg.quantization:
        return functools.partial(QuantLinear, mode=cfg.quantization, dtype=dtype,
                                 matmul=kernels.quantized_matmul)
    return functools.partial(Dense, dtype=dtype, param_dtype=dtype, rows=kernels.gemm_rows)


def expert_weights(module: nn.Module, cfg: ModelConfig, dtype) -> tuple[tuple, tuple | None]:
    """Declare the expert stacks (w_gate, w_up [E, H, F]; w_down [E, F, H]) on `module`, or
    (w_gate_up [E, H, 2F], w_down) where its params hold gate and up fused; returns (weights,
    scales): scales [E, out] float32 per stack under quantization, else None."""
    e, f, h = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    shapes = {"w_gate": (e, h, f), "w_up": (e, h, f), "w_gate_up": (e, h, 2 * f),
              "w_down": (e, f, h)}
    names = FUSED_EXPERT_PROJS if module.has_variable("params", "w_gate_up") else EXPERT_PROJS
    if not cfg.quantization:
        init = nn.initializers.lecun_normal()
        return tuple(module.param(n, init, shapes[n], dtype) for n in names), None
    storage = STORAGE[cfg.quantization]
    weights = tuple(module.param(n, nn.initializers.zeros, shapes[n], storage) for n in names)
    scales = tuple(module.param(scale_name(n), nn.initializers.ones, (e, shapes[n][2]), jnp.float32)
                   for n in names)
    return weights, scales
