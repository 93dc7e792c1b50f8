"""Mamba-2's mixer on the paged cache: a shared layer of the Mamba-2 hybrids (HF's
Mamba2Mixer, as GraniteMoeHybridMambaLayer runs it).

    in_proj(x) -> gate z [I], xBC [C = I + 2 G N], dt [H]
    xBC -> causal depthwise conv (width W) + SiLU -> x [H, P], B, C [G, N]
    y = SSD(x, softplus(dt + dt_bias) clamped to dt_limit, A = -exp(A_log), B, C) + D x
    out_proj(RMSNorm_groups(y * silu(z)) * weight)

The state a sequence carries between steps is the conv's last W-1 inputs and the SSM state
[H, P, N], both float32. The layer's KV spec is a `FixedStateSpec` stored in the attention
layers' page (kv_specs.py): the page of block b of this layer's cache array pair (K and V,
[heads, blocks, block_size, width] each) holds, bit-cast to float32 words, the state after the
last token the sequence wrote into block b. A step reads the state after the token before its
first (block (ctx - 1) // block_size of the layer's group table; zeros for a sequence with no
context) and writes the state after its last token into the block of that token, so chunked
prefill carries the state across chunks, a decode updates its block in place, and the KV
manager frees the earlier blocks (FixedStateSpec.first_needed_block). Only the states of the
step's sequences are gathered: the kernels (the table's `mamba2`) run on a pool of one slot per
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
    def conv_words(self) -> int:
        return (self.conv_width - 1) * self.conv_dim

    @property
    def ssm_words(self) -> int:
        return self.heads * self.head_dim * self.state_dim

    @property
    def state_bytes(self) -> int:
        """The float32 state one sequence carries (FixedStateSpec.state_bytes)."""
        return 4 * (self.conv_words + self.ssm_words)


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
        if kv is None:
            batch = _dense_batch(lead, dims)
        else:
            batch = _paged_batch(md, kv, dims)
        cu, slots, has_init, conv0, ssm0 = batch[:5]
        dense = linear(cfg, self.dtype, self.kernels)
        i, c, h = dims.inner, dims.conv_dim, dims.heads
        proj = dense(i + c + h, use_bias=dims.proj_bias, name="in_proj")(x)
        z, xbc, dt = jnp.split(proj, [i, i + c], axis=-1)
        # A pure-decode step (one token a sequence, no padding rows) runs the one-token kernels.
        decode = kv is not None and md.num_decodes == md.num_seqs == x.shape[0]
        conv_w = self.param("conv1d_weight", nn.initializers.lecun_normal(),
                            (dims.conv_width, c), self.dtype)
        conv_b = (self.param("conv1d_bias", nn.initializers.zeros, (c,), self.dtype)
                  if dims.conv_bias else None)
        ssm = self.kernels.mamba2
        xbc, conv1 = ssm.conv(xbc, conv_w, conv_b, conv0, cu, slots, has_init, decode=decode)
        xs, b, cm = jnp.split(xbc, [i, i + dims.groups * dims.state_dim], axis=-1)
        t, g, n = x.shape[0], dims.groups, dims.state_dim
        dt_bias = self.param("dt_bias", nn.initializers.ones, (h,), self.dtype)
        a_log = self.param("A_log", nn.initializers.zeros, (h,), self.dtype)
        d = self.param("D", nn.initializers.ones, (h,), self.dtype)
        y, ssm1 = ssm.ssd(xs.reshape(t, h, dims.head_dim), mamba2_dt(dt, dt_bias, dims.dt_limit),
                          -jnp.exp(a_log.astype(_F32)), b.reshape(t, g, n), cm.reshape(t, g, n),
                          d, ssm0, cu, slots, has_init, chunk_size=dims.chunk_size,
                          decode=decode)
        y = GatedRMSNorm(cfg.rms_norm_eps, g, name="norm")(y.reshape(t, i), z)
        out = dense(width, use_bias=dims.proj_bias, name="out_proj")(y.astype(x.dtype))
        new_kv = None if kv is None else write_states(kv, batch[5], conv1, ssm1)
        return out.reshape(*lead, width), new_kv


def _dense_batch(lead: tuple[int, ...], dims: Mamba2Dims):
    """Rows of x [B, L, H] as B fresh sequences of L tokens, each in its own pool slot."""
    rows, length = (1, lead[0]) if len(lead) == 1 else lead
    cu = jnp.arange(rows + 1, dtype=jnp.int32) * length
    slots = jnp.arange(rows, dtype=jnp.int32)
    conv = jnp.zeros((rows, dims.conv_width - 1, dims.conv_dim), _F32)
    ssm = jnp.zeros((rows, dims.heads, dims.head_dim, dims.state_dim), _F32)
    return cu, slots, jnp.zeros((rows,), bool), conv, ssm


def _paged_batch(md, kv, dims: Mamba2Dims):
    """(cu_seqlens, slots, has_initial_state, conv pool, SSM pool, destination blocks) of a
    paged step: sequence s reads its state from the block before its first new token and
    writes it into the block of its last (a padding sequence, or a finished row of a decode
    loop, has no tokens: slot -1, its destination out of range)."""
    cu = md.query_start_loc.astype(jnp.int32)
    seq_lens = md.seq_lens.astype(jnp.int32)
    s = seq_lens.shape[0]
    num_blocks, block_size = kv[0].shape[1], kv[0].shape[2]
    q = cu[1:] - cu[:-1]
    live = (q > 0) & (seq_lens > 0)
    ctx = seq_lens - q
    rows = jnp.arange(s)
    src = md.block_tables[rows, jnp.maximum(ctx - 1, 0) // block_size]
    dst = jnp.where(live, md.block_tables[rows, jnp.maximum(seq_lens - 1, 0) // block_size],
                    num_blocks)
    has_init = live & (ctx > 0)
    conv, ssm = read_states(kv, src, dims)
    keep = has_init[:, None]
    conv = jnp.where(keep[..., None], conv, 0.0)
    ssm = jnp.where(keep[..., None, None], ssm, 0.0)
    slots = jnp.where(live, rows, -1).astype(jnp.int32)
    return cu, slots, has_init, conv, ssm, dst


def _words(page: jax.Array) -> jax.Array:
    """[S, E] elements of the cache dtype -> [S, E * itemsize / 4] float32 words (bit-cast)."""
    if page.dtype == _F32:
        return page
    ratio = 4 // page.dtype.itemsize
    return jax.lax.bitcast_convert_type(page.reshape(page.shape[0], -1, ratio), _F32)


def _elements(words: jax.Array, dtype) -> jax.Array:
    if jnp.dtype(dtype) == _F32:
        return words
    return jax.lax.bitcast_convert_type(words, dtype).reshape(words.shape[0], -1)


def read_states(kv, blocks: jax.Array, dims: Mamba2Dims) -> tuple[jax.Array, jax.Array]:
    """The states in pages `blocks` [S] of the cache array pair kv: conv [S, W-1, C] and SSM
    [S, H, P, N], float32."""
    pages = jnp.concatenate([jnp.moveaxis(a[:, blocks], 1, 0).reshape(blocks.shape[0], -1)
                             for a in kv], axis=-1)
    words = _words(pages)
    s = blocks.shape[0]
    conv = words[:, :dims.conv_words].reshape(s, dims.conv_width - 1, dims.conv_dim)
    ssm = words[:, dims.conv_words:dims.conv_words + dims.ssm_words]
    return conv, ssm.reshape(s, dims.heads, dims.head_dim, dims.state_dim)


def write_states(kv, blocks: jax.Array, conv: jax.Array, ssm: jax.Array):
    """kv with the states (conv [S, W-1, C], SSM [S, H, P, N]) written into pages `blocks`
    [S] (out of range: not written), the rest of each page zero."""
    s = blocks.shape[0]
    dtype = kv[0].dtype
    sizes = [a[:, 0].size for a in kv]  # elements of one page of each array
    total_words = sum(sizes) * jnp.dtype(dtype).itemsize // 4
    words = jnp.concatenate([conv.reshape(s, -1).astype(_F32), ssm.reshape(s, -1).astype(_F32)],
                            axis=-1)
    words = jnp.pad(words, ((0, 0), (0, total_words - words.shape[1])))
    pages = jnp.split(_elements(words, dtype), [sizes[0]], axis=-1)
    out = []
    for a, page in zip(kv, pages):
        heads, _, block_size, width = a.shape
        rows = jnp.moveaxis(page.reshape(s, heads, block_size, width), 0, 1)
        out.append(a.at[:, blocks].set(rows, mode="drop"))
    return tuple(out)
