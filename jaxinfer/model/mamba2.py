"""Mamba-2's mixer on the paged cache: a shared layer of the Mamba-2 hybrids (HF's
Mamba2Mixer, as GraniteMoeHybridMambaLayer runs it).

    in_proj(x) -> gate z [I], xBC [C = I + 2 G N], dt [H] (params in_proj_z, _x, _b, _c, _dt)
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
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxinfer.model.config import ModelConfig
from jaxinfer.model.fused_projections import project
from jaxinfer.model.kernel_table import KernelTable
from jaxinfer.model.quant.layers import linear
from jaxinfer.model.state_pages import StateShape, state_words, step_states
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
    def state_shapes(self) -> tuple[StateShape, StateShape]:
        """The conv state [W-1, C] (its channels x, B and C) and the SSM state [H, P, N]
        (state_pages.py's order)."""
        gn = self.groups * self.state_dim
        return (StateShape((self.conv_width - 1, self.conv_dim), 1, (self.inner, gn, gn)),
                StateShape((self.heads, self.head_dim, self.state_dim)))

    @property
    def state_bytes(self) -> int:
        """The float32 state one sequence carries (FixedStateSpec.state_bytes)."""
        return 4 * state_words(self.state_shapes)

    @property
    def in_projections(self) -> tuple[tuple[str, int], ...]:
        """in_proj's parts (name, features) in HF's order: z, x, B, C, dt. Kept apart (fused as
        in_proj on one GPU: fused_projections.py) so that a column split over devices gives
        each its heads' z, x and dt and an equal share of B's and C's channels."""
        i, gn = self.inner, self.groups * self.state_dim
        return (("in_proj_z", i), ("in_proj_x", i), ("in_proj_b", gn), ("in_proj_c", gn),
                ("in_proj_dt", self.heads))

    def tp_refusal(self, tp: int) -> str | None:
        """Why the layer's heads cannot be split over tp devices (None: they can): each device
        takes whole heads, an equal share of B's and C's channels, and whole groups or a share
        of one group's heads."""
        if self.heads % tp:
            return f"does not divide the model's {self.heads} Mamba-2 heads (mamba_n_heads)"
        if self.groups * self.state_dim % tp:
            return (f"does not divide the Mamba-2 B and C channels (mamba_n_groups x "
                    f"mamba_d_state = {self.groups * self.state_dim})")
        if self.groups % tp and tp % self.groups:
            return (f"neither divides nor is a multiple of the model's {self.groups} Mamba-2 "
                    f"groups (mamba_n_groups)")
        return None


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
        dense = functools.partial(linear(cfg, self.dtype, self.kernels), use_bias=dims.proj_bias)
        z, xs, b, c, dt = project(self, dense, x, dims.in_projections, "in_proj")
        h = dims.heads
        conv_w = self.param("conv1d_weight", nn.initializers.lecun_normal(),
                            (dims.conv_width, dims.conv_dim), self.dtype)
        conv_b = (self.param("conv1d_bias", nn.initializers.zeros, (dims.conv_dim,), self.dtype)
                  if dims.conv_bias else None)
        dt_bias = self.param("dt_bias", nn.initializers.ones, (h,), self.dtype)
        a_log = self.param("A_log", nn.initializers.zeros, (h,), self.dtype)
        d = self.param("D", nn.initializers.ones, (h,), self.dtype)
        step = functools.partial(_ssd_step, self.kernels.mamba2, dims, lead)
        y, kv = self.kernels.state_heads.run(
            step, (xs, b, c, dt, dt_bias, a_log, d, conv_w, conv_b, kv, md),
            axes=(1, 1, 1, 1, 0, 0, 0, None, None, 0, None), out_axes=(1, 0))
        y = GatedRMSNorm(cfg.rms_norm_eps, dims.groups, name="norm")(y, z)
        out = dense(width, name="out_proj")(y.astype(x.dtype))
        return out.reshape(*lead, width), kv


def _ssd_step(kernels, dims: Mamba2Dims, lead, heads, xs, b, c, dt, dt_bias, a_log, d, conv_w,
              conv_b, kv, md):
    """The layer's step on the heads of `heads` (ssm_kernels.StateHeads): xs [T, h P], b, c
    [T, its share of G N], dt [T, h], dt_bias, a_log, d [h] of its heads, the whole conv weight
    [W, C] and bias [C] -> (y [T, h P], kv with the final states over their pages; None on the
    dense path)."""
    t, local_heads = dt.shape
    p, n = dims.head_dim, dims.state_dim

    def own(conv, axis):  # its channels of the conv's x, B and C parts
        i, gn = dims.inner, dims.groups * n
        return jnp.concatenate([heads.own(part, axis) for part in jnp.split(
            conv, [i, i + gn], axis=axis)], axis=axis)

    xbc = jnp.concatenate([xs, b, c], axis=-1)
    weight, bias = own(conv_w, 1), None if conv_b is None else own(conv_b, 0)
    batch = step_states(lead, kv, md, tuple(s.split(heads.count) for s in dims.state_shapes))
    conv0, ssm0 = batch.pools
    xbc, conv1 = kernels.conv(xbc, weight, bias, conv0, *batch.ragged, decode=batch.decode)
    xs, b, c = jnp.split(xbc, [xs.shape[1], xs.shape[1] + b.shape[1]], axis=-1)
    # Each device convolves its share of B's and C's channels (and keeps their conv state); its
    # heads read whole groups: those of its heads, or the one group they share with other devices.
    per_group = dims.heads // dims.groups
    first, count = heads.index() * local_heads // per_group, max(local_heads // per_group, 1)
    b, c = (jax.lax.dynamic_slice_in_dim(heads.gather(m, 1).reshape(t, dims.groups, n), first,
                                         count, axis=1) for m in (b, c))
    y, ssm1 = kernels.ssd(xs.reshape(t, local_heads, p), mamba2_dt(dt, dt_bias, dims.dt_limit),
                          -jnp.exp(a_log.astype(_F32)), b, c, d, ssm0, *batch.ragged,
                          chunk_size=dims.chunk_size, decode=batch.decode)
    return y.reshape(t, local_heads * p), batch.written(kv, (conv1, ssm1))
