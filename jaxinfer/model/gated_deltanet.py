"""Gated DeltaNet on the paged cache: Qwen3-Next's linear-attention layer (HF's
Qwen3NextGatedDeltaNet).

    in_proj_qkvz(x) -> per key head: q [K], k [K], and v, z [V] of its Hv / Hk value heads
    in_proj_ba(x)   -> per key head: b, a of its Hv / Hk value heads
    (q, k, v) -> causal depthwise conv (width W, no bias) + SiLU
    g = -exp(A_log) softplus(a + dt_bias) (the log decay), beta = sigmoid(b)
    o = the gated delta rule over (q, k L2-normalised, q times K^-1/2; v, g, beta)
    out_proj(RMSNorm_per_head(o) * weight * silu(z))

The state a sequence carries between steps is the conv's last W-1 inputs and the recurrent
state [Hv, K, V], both float32: a `FixedStateSpec` over attention-sized pages
(state_pages.py reads and writes it). The kernels are the table's `gdn` (ssm_kernels.py).
"""

from __future__ import annotations

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxinfer.model.config import ModelConfig
from jaxinfer.model.kernel_table import KernelTable
from jaxinfer.model.quant.layers import linear
from jaxinfer.model.state_pages import StateShape, state_words, step_states
from pallas_kernels.ssm.reference import gdn_gating

_F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class GatedDeltaNetDims:
    """A Gated DeltaNet layer's shapes (HF's linear_* config fields)."""
    key_heads: int     # Hk (linear_num_key_heads)
    value_heads: int   # Hv (linear_num_value_heads), a multiple of Hk
    key_dim: int       # K (linear_key_head_dim)
    value_dim: int     # V (linear_value_head_dim)
    conv_width: int    # W (linear_conv_kernel_dim)
    # The delta rule's chunk (HF's and fla's chunk_gated_delta_rule: 64); the result does not
    # depend on it.
    chunk_size: int = 64

    @property
    def key_width(self) -> int:
        return self.key_heads * self.key_dim

    @property
    def value_width(self) -> int:
        return self.value_heads * self.value_dim

    @property
    def conv_dim(self) -> int:
        """The conv's channels: q, k and v."""
        return 2 * self.key_width + self.value_width

    @property
    def state_shapes(self) -> tuple[StateShape, StateShape]:
        """The conv state [W-1, C] (its channels q, k and v) and the recurrent state [Hv, K, V]
        (state_pages.py's order)."""
        return (StateShape((self.conv_width - 1, self.conv_dim), 1,
                           (self.key_width, self.key_width, self.value_width)),
                StateShape((self.value_heads, self.key_dim, self.value_dim)))

    @property
    def state_bytes(self) -> int:
        """The float32 state one sequence carries (FixedStateSpec.state_bytes)."""
        return 4 * state_words(self.state_shapes)

    def tp_refusal(self, tp: int) -> str | None:
        """Why the layer's heads cannot be split over tp devices (None: they can): each device
        takes whole key heads and their value heads."""
        if self.key_heads % tp:
            return (f"does not divide the model's {self.key_heads} Gated DeltaNet key heads "
                    f"(linear_num_key_heads)")
        return None


class GatedHeadNorm(nn.Module):
    """HF's Qwen3NextRMSNormGated: each head's o RMS-normalised (float32), times the weight
    in o's dtype, times silu(z) in float32, cast back to o's dtype."""
    eps: float

    @nn.compact
    def __call__(self, o, z):
        w = self.param("weight", nn.initializers.ones, (o.shape[-1],), o.dtype)
        of = o.astype(_F32)
        normed = (of * jax.lax.rsqrt(jnp.mean(of * of, axis=-1, keepdims=True) + self.eps))
        y = (w * normed.astype(o.dtype)).astype(_F32) * jax.nn.silu(z.astype(_F32))
        return y.astype(o.dtype)


class GatedDeltaNet(nn.Module):
    """A fixed-state layer (families.Family.state_layer), called as transformer.Attention:
    paged (x [T, H] with kv, md) or dense (x [B, L, H], each row a fresh sequence)."""
    cfg: ModelConfig
    kernels: KernelTable
    dtype: jnp.dtype
    layer: int = 0

    @nn.compact
    def __call__(self, x, cos=None, sin=None, kv=None, md=None, lora_slot=None, positions=None):
        cfg, dims = self.cfg, self.cfg.family_options.gdn
        lead, width = x.shape[:-1], x.shape[-1]
        x = x.reshape(-1, width)
        t, hk, hv, kd, vd = (x.shape[0], dims.key_heads, dims.value_heads, dims.key_dim,
                             dims.value_dim)
        rep = hv // hk
        dense = linear(cfg, self.dtype, self.kernels)
        # HF's layout: grouped by key head, each its q, k and its value heads' v and z (b, a);
        # so a column split over devices gives each its key heads' and their value heads' parts.
        qkvz = dense(2 * dims.key_width + 2 * dims.value_width, use_bias=False,
                     name="in_proj_qkvz")(x).reshape(t, hk, 2 * kd + 2 * rep * vd)
        q, k, v, z = jnp.split(qkvz, [kd, 2 * kd, 2 * kd + rep * vd], axis=-1)
        ba = dense(2 * hv, use_bias=False, name="in_proj_ba")(x).reshape(t, hk, 2 * rep)
        b, a = ba[..., :rep].reshape(t, hv), ba[..., rep:].reshape(t, hv)
        conv_w = self.param("conv1d_weight", nn.initializers.lecun_normal(),
                            (dims.conv_width, dims.conv_dim), self.dtype)
        dt_bias = self.param("dt_bias", nn.initializers.ones, (hv,), self.dtype)
        a_log = self.param("A_log", nn.initializers.zeros, (hv,), self.dtype)
        g, beta = gdn_gating(a, b, a_log, dt_bias)
        step = functools.partial(_delta_rule_step, self.kernels.gdn, dims, lead)
        o, kv = self.kernels.state_heads.run(
            step, (q, k, v.reshape(t, hv, vd), g, beta, conv_w, kv, md),
            axes=(1, 1, 1, 1, 1, None, 0, None), out_axes=(1, 0))
        o = GatedHeadNorm(cfg.rms_norm_eps, name="norm")(o, z.reshape(t, hv, vd))
        out = dense(width, use_bias=False, name="out_proj")(o.reshape(t, dims.value_width))
        return out.reshape(*lead, width), kv


def _delta_rule_step(kernels, dims: GatedDeltaNetDims, lead, heads, q, k, v, g, beta, conv_w,
                     kv, md):
    """The layer's step on the heads of `heads` (ssm_kernels.StateHeads): q, k [T, hk, K], v
    [T, hv, V], g, beta [T, hv] of its heads, the whole conv weight [W, C] -> (o [T, hv, V], kv
    with the final states over their pages; None on the dense path)."""
    t, hk, kd = q.shape
    hv, vd = v.shape[1:]
    mixed = jnp.concatenate([x.reshape(t, -1) for x in (q, k, v)], axis=-1)
    # Its heads' channels of the conv's q, k and v parts.
    weight = jnp.concatenate([heads.own(w, 1) for w in jnp.split(
        conv_w, [dims.key_width, 2 * dims.key_width], axis=1)], axis=-1)
    batch = step_states(lead, kv, md, tuple(s.split(heads.count) for s in dims.state_shapes))
    conv0, state0 = batch.pools
    mixed, conv1 = kernels.conv(mixed, weight, None, conv0, *batch.ragged, decode=batch.decode)
    q, k, v = jnp.split(mixed, [hk * kd, 2 * hk * kd], axis=-1)
    o, state1 = kernels.delta_rule(q.reshape(t, hk, kd), k.reshape(t, hk, kd),
                                   v.reshape(t, hv, vd), g, beta, state0, *batch.ragged,
                                   chunk_size=dims.chunk_size, decode=batch.decode)
    return o, batch.written(kv, (conv1, state1))
