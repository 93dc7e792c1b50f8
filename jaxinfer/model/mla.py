"""Multi-head Latent Attention (DeepSeek-V2/V3), in the absorbed form over a paged latent cache.

Per token, the layer projects x to a latent c = RMSNorm(W_DKV x) (kv_lora_rank wide) and one
decoupled RoPE key k_pe (qk_rope_head_dim), shared by every head. HF decompresses per head
k_h = [W_UK_h c, k_pe], v_h = W_UV_h c. Absorbing W_UK into the query and W_UV into the output
gives the same attention without ever decompressing:

    score_h(t, s) = q_nope_h . (W_UK_h c_s) + q_pe_h . k_pe_s = [W_UK_h^T q_nope_h, q_pe_h] . [c_s, k_pe_s]
    out_h(t)      = W_UV_h sum_s p_h(t, s) c_s

so attention is multi-query attention with one "KV head" of width kv_lora_rank + rope dim (576)
whose values are the keys' first kv_lora_rank columns: the cache stores [c, rotated k_pe] once
per token (the V array of the layer's cache pair is empty: ModelConfig.kv_widths), and the
backend's paged kernels run on it with q = [W_UK^T q_nope, q_pe] per head. docs/MLA.md has the
arithmetic.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxinfer.model.config import ModelConfig
from jaxinfer.model.kernel_table import KernelTable
from jaxinfer.model.norm_rope import RMSNorm, apply_rope
from jaxinfer.model.quant.layers import linear
from pallas_kernels.attention.backend import AttentionBackend
from pallas_kernels.attention.latent_reference import LATENT_REFERENCE
from pallas_kernels.attention.reference import causal_attention_reference


def deinterleave(x: jax.Array) -> jax.Array:
    """DeepSeek's rope dims come as interleaved pairs (x0, x1), (x2, x3), ...: evens then odds
    turns them into the rotate-half layout `apply_rope` turns (as HF's V3 interleave path does;
    V2's complex rotation differs only in the output order, which q . k does not see)."""
    return jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)


def latent_backend(backend, latent_decode, value_width: int):
    """What MLA attention runs on, inside the same wrappers as `backend` (tensor parallelism's
    shard_map, fp8 KV scales): decode is the kernel table's `latent_decode` with `value_width`
    (kv_lora_rank) bound where it has one (on Hopper under the Mosaic backend:
    pallas_kernels/attention/latent_decode_mosaic.py, all heads of a sequence on each latent
    page), else the jnp latent decode (latent_reference.py); prefill is the jnp reference's ragged
    prefill over the latent as one 576-wide KV head (the GPU backends' prefill kernels stop at
    head dim 256)."""
    if isinstance(backend, AttentionBackend):
        if latent_decode is None:
            return LATENT_REFERENCE
        return dataclasses.replace(LATENT_REFERENCE, name=f"{backend.name}-latent",
                                   decode=latent_decode(value_width))
    return dataclasses.replace(backend, inner=latent_backend(backend.inner, latent_decode,
                                                             value_width))


class _Kernel(nn.Module):
    """A Dense kernel [in, out] as a bare param: the absorbed form multiplies by per-head slices."""
    shape: tuple[int, int]
    dtype: jnp.dtype

    @nn.compact
    def __call__(self) -> jax.Array:
        return self.param("kernel", nn.initializers.lecun_normal(), self.shape, self.dtype)


class MLAttention(nn.Module):
    cfg: ModelConfig
    kernels: KernelTable
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x, cos, sin, kv=None, md=None, lora_slot=None, positions=None):
        """As `Attention`: paged (x [T, H], kv = (latent cache, empty V cache), md) or dense
        (x [B, L, H], kv None). LoRA adapters do not cover MLA's projections (peft.py refuses)."""
        cfg, m = self.cfg, self.cfg.mla
        heads, nope, r = cfg.num_heads, m.qk_nope_head_dim, m.kv_lora_rank
        dense = functools.partial(linear(cfg, self.dtype, self.kernels), use_bias=False)
        gemm_rows = self.kernels.gemm_rows
        norm = functools.partial(RMSNorm, cfg.rms_norm_eps, self.dtype)
        lead = x.shape[:-1]
        if m.q_lora_rank:
            q = dense(m.q_lora_rank, name="q_a_proj")(x)
            q = dense(heads * m.qk_head_dim, name="q_b_proj")(norm(name="q_a_layernorm")(q))
        else:
            q = dense(heads * m.qk_head_dim, name="q_proj")(x)
        q = q.reshape(*lead, heads, m.qk_head_dim)
        q_nope, q_pe = q[..., :nope], q[..., nope:]
        compressed = dense(m.latent_width, name="kv_a_proj_with_mqa")(x)
        c = norm(name="kv_a_layernorm")(compressed[..., :r])
        k_pe = compressed[..., None, r:]  # [..., 1, rope]: one key for all heads
        if m.rope_interleave:
            q_pe, k_pe = deinterleave(q_pe), deinterleave(k_pe)
        # What the latent cache will hold, before RoPE, for fp8 scale calibration (kv_scales.py;
        # a no-op unless applied with mutable "intermediates").
        self.sow("intermediates", "c", c)
        self.sow("intermediates", "k_pe", k_pe)
        q_pe, k_pe = apply_rope(q_pe, cos, sin), apply_rope(k_pe, cos, sin)

        w_kv_b = _Kernel((r, heads * (nope + m.v_head_dim)), self.dtype, name="kv_b_proj")()
        w_kv_b = w_kv_b.reshape(r, heads, nope + m.v_head_dim)
        w_uk, w_uv = w_kv_b[..., :nope], w_kv_b[..., nope:]
        q_latent = gemm_rows(lambda q: jnp.einsum("...hn,rhn->...hr", q, w_uk,
                                                  preferred_element_type=jnp.float32),
                             q_nope, math.prod(lead), heads * nope * r).astype(q.dtype)
        q_abs = jnp.concatenate([q_latent, q_pe], axis=-1)  # [..., heads, r + rope]
        latent = jnp.concatenate([c[..., None, :], k_pe], axis=-1)  # [..., 1, r + rope]
        if kv is None:
            out = causal_attention_reference(q_abs, latent, latent, scale=cfg.score_scale)
            new_kv = None
        else:
            backend = latent_backend(self.kernels.attention, self.kernels.latent_decode, r)
            latent_cache, empty = backend.write_kv(*kv, latent, latent[..., :0], md.slot_mapping)
            out = backend(q_abs, latent_cache, latent_cache, md, scale=cfg.score_scale)
            new_kv = (latent_cache, empty)
        out = gemm_rows(lambda o: jnp.einsum("...hr,rhv->...hv", o, w_uv,
                                             preferred_element_type=jnp.float32),
                        out[..., :r].astype(q.dtype), math.prod(lead),
                        heads * r * m.v_head_dim).astype(q.dtype)
        out = out.reshape(*lead, heads * m.v_head_dim)
        return dense(cfg.hidden_size, name="o_proj")(out), new_kv
