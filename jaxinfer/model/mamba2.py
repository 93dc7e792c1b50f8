"""Mamba-2's mixer on the paged cache: a shared layer of the Mamba-2 hybrids (HF's
Mamba2Mixer, as GraniteMoeHybridMambaLayer runs it).

    in_proj(x) -> gate z [I], xBC [C = I + 2 G N], dt [H]
    xBC -> causal depthwise conv (width W) + SiLU -> x [H, P], B, C [G, N]
    y = SSD(x, softplus(dt + dt_bias) clamped to dt_limit, A = -exp(A_log), B, C) + D x
    out_proj(RMSNorm_groups(y * silu(z)) * weight)

The state a sequence carries between steps is the conv's last W-1 inputs and the SSM state
[H, P, N], both float32. The layer's KV spec is a `FixedStateSpec` over attention-sized
pages (kv_specs.py; state_pages.py reads and writes it). Only the states of the step's
sequences are gathered: the kernels (the table's `mamba2`) run on a pool of one slot per
sequence.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxinfer.model.config import ModelConfig
from jaxinfer.model.kernel_table import KernelTable
from jaxinfer.model.quant.layers import linear
from jaxinfer.model.state_pages import state_words, step_states
from pallas_kernels.ssm.reference import mamba2_dt

_F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class Mamba2Dims:
    """A Mamba-2 layer's shapes (HF's mamba_* config fields)."""
    heads: int         # H (mamba_n_heads)
    head_dim: int      # P (mamba_d_head)
    groups: int        # G (mamba_n_groups): B and C shared by H // G heads
    state_dim: int     # N (mamba_d_state)
    conv_width: int    # W (mamba_d_conv)
    chunk_size: int    # the SSD scan's chunk (mamba_chunk_size)
    conv_bias: bool = True
    proj_bias: bool = False
    dt_limit: tuple[float, float] = (0.0, float("inf"))

    @property
    def inner(self) -> int:
        """I = H x P: the width of x, z and y."""
        return self.heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.inner + 2 * self.groups * self.state_dim

    @property
    def state_shapes(self) -> tuple[tuple[int, ...], ...]:
        """The conv state [W-1, C] and the SSM state [H, P, N] (state_pages.py's order)."""
        return ((self.conv_width - 1, self.conv_dim),
                (self.heads, self.head_dim, self.state_dim))

    @property
    def state_bytes(self) -> int:
        """The float32 state one sequence carries (FixedStateSpec.state_bytes)."""
        return 4 * state_words(self.state_shapes)


class GatedRMSNorm(nn.Module):
    """HF's MambaRMSNormGated (norm_before_gate=False): y * silu(z), RMS-normalised over each
    of `groups` equal slices, times the weight; float32 inside."""
    eps: float
    groups: int

    @nn.compact
    def __call__(self, y, z):
        w = self.param("weight", nn.initializers.ones, (y.shape[-1],), y.dtype)
        h = y.astype(_F32) * jax.nn.silu(z.astype(_F32))
        g = h.reshape(*h.shape[:-1], self.groups, -1)
        g = g * jax.lax.rsqrt(jnp.mean(g * g, axis=-1, keepdims=True) + self.eps)
        return w.astype(_F32) * g.reshape(h.shape)


class Mamba2Mixer(nn.Module):
    """A fixed-state layer (families.Family.state_layer), called as transformer.Attention:
    paged (x [T, H] with kv, md) or dense (x [B, L, H], each row a fresh sequence)."""
    cfg: ModelConfig
    kernels: KernelTable
    dtype: jnp.dtype
    layer: int = 0

    @nn.compact
    def __call__(self, x, cos=None, sin=None, kv=None, md=None, lora_slot=None, positions=None):
        cfg, dims = self.cfg, self.cfg.family_options.mamba
        lead, width = x.shape[:-1], x.shape[-1]
        x = x.reshape(-1, width)
        batch = step_states(lead, kv, md, dims.state_shapes)
        conv0, ssm0 = batch.pools
        dense = linear(cfg, self.dtype, self.kernels)
        i, c, h = dims.inner, dims.conv_dim, dims.heads
        proj = dense(i + c + h, use_bias=dims.proj_bias, name="in_proj")(x)
        z, xbc, dt = jnp.split(proj, [i, i + c], axis=-1)
        conv_w = self.param("conv1d_weight", nn.initializers.lecun_normal(),
                            (dims.conv_width, c), self.dtype)
        conv_b = (self.param("conv1d_bias", nn.initializers.zeros, (c,), self.dtype)
                  if dims.conv_bias else None)
        ssm = self.kernels.mamba2
        xbc, conv1 = ssm.conv(xbc, conv_w, conv_b, conv0, *batch.ragged, decode=batch.decode)
        xs, b, cm = jnp.split(xbc, [i, i + dims.groups * dims.state_dim], axis=-1)
        t, g, n = x.shape[0], dims.groups, dims.state_dim
        dt_bias = self.param("dt_bias", nn.initializers.ones, (h,), self.dtype)
        a_log = self.param("A_log", nn.initializers.zeros, (h,), self.dtype)
        d = self.param("D", nn.initializers.ones, (h,), self.dtype)
        y, ssm1 = ssm.ssd(xs.reshape(t, h, dims.head_dim), mamba2_dt(dt, dt_bias, dims.dt_limit),
                          -jnp.exp(a_log.astype(_F32)), b.reshape(t, g, n), cm.reshape(t, g, n),
                          d, ssm0, *batch.ragged, chunk_size=dims.chunk_size,
                          decode=batch.decode)
        y = GatedRMSNorm(cfg.rms_norm_eps, g, name="norm")(y.reshape(t, i), z)
        out = dense(width, use_bias=dims.proj_bias, name="out_proj")(y.astype(x.dtype))
        return out.reshape(*lead, width), batch.written(kv, (conv1, ssm1))
