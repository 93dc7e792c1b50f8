"""Llama 4's language model (`Llama4ForCausalLM`: Scout's and Maverick's text shapes): a family
in one file (families.py, "Adding a model family" in docs/ARCHITECTURE.md).

As HF transformers' modeling_llama4.py:
- attention: RoPE layers (no_rope_layers[i] = 1) rotate q and k as interleaved pairs, then (with
  use_qk_norm) L2-normalize them per head without a weight, and attend within their chunk of
  attention_chunk_size tokens (chunked local attention: ChunkedLocalAttentionSpec); the other
  layers (NoPE) attend globally without RoPE, their queries scaled by
  1 + attn_scale * log1p(floor((p + 1) / floor_scale)) at position p (attn_temperature_tuning);
- MoE layers (moe_layers, else every interleave_moe_layer_step-th): a router picks the top-1
  expert by logit; the token enters that expert scaled by the sigmoid of its logit (before the
  expert, not after it), beside one always-on shared expert; dense layers' MLP has
  intermediate_size_mlp, the experts intermediate_size.
"""

from __future__ import annotations

import dataclasses
import re

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxinfer.errors import ConfigError
from jaxinfer.model.config import ModelConfig
from jaxinfer.model.families import Family, Raw, required
from jaxinfer.model.kernel_table import KernelTable
from jaxinfer.model.mla import deinterleave
from jaxinfer.model.norm_rope import apply_rope
from jaxinfer.model.quant.layers import expert_weights
from jaxinfer.model.routing import route
from jaxinfer.model.tensor_sources import Source, stored
from jaxinfer.model.transformer import MLP, Attention

# HF's Llama4TextConfig defaults (hub configs rely on some of them).
DEFAULTS = dict(vocab_size=202048, hidden_size=5120, intermediate_size=8192,
                intermediate_size_mlp=16384, num_hidden_layers=48, num_attention_heads=40,
                num_key_value_heads=8, head_dim=128, hidden_act="silu",
                max_position_embeddings=131072, rms_norm_eps=1e-5, bos_token_id=1,
                eos_token_id=2, num_experts_per_tok=1, num_local_experts=16,
                interleave_moe_layer_step=1, use_qk_norm=True, no_rope_layer_interval=4,
                attention_chunk_size=8192, attn_temperature_tuning=True, floor_scale=8192,
                attn_scale=0.1, attention_bias=False, rope_theta=500000.0)
_EXPERTS = re.compile(r"model\.layers\.(\d+)\.feed_forward\.experts\.(gate_up_proj|down_proj)")


@dataclasses.dataclass(frozen=True)
class Llama4Options:
    """`ModelConfig.family_options` of a Llama 4 model."""
    rope_layers: tuple[bool, ...]  # no_rope_layers: 1 = this layer turns RoPE
    qk_l2_norm: bool
    temperature_tuning: bool
    floor_scale: float
    attn_scale: float


def normalize(raw: Raw) -> Raw:
    """HF's defaults; the shared model's MLP width is the dense layers' (intermediate_size_mlp),
    the experts' (and the shared expert's) is HF's intermediate_size."""
    raw = {**DEFAULTS, **raw}
    if raw["hidden_act"] != "silu":
        raise ConfigError(f"config.json: hidden_act '{raw['hidden_act']}' is not supported "
                          f"(only 'silu')")
    return {**raw, "intermediate_size": raw["intermediate_size_mlp"],
            "moe_intermediate_size": raw["intermediate_size"]}


def _layer_kinds(raw: Raw, layers: int) -> tuple[tuple[bool, ...], tuple[int | None, ...]]:
    """(whether each layer turns RoPE, each layer's attention chunk), as Llama4TextConfig
    derives them: RoPE layers are the chunked ones when attention_chunk_size is set."""
    interval = int(raw["no_rope_layer_interval"])
    rope = raw.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(layers)]
    chunk = raw.get("attention_chunk_size")
    types = raw.get("layer_types") or ["chunked_attention" if r and chunk is not None
                                       else "full_attention" for r in rope]
    if len(rope) != layers or len(types) != layers:
        raise ConfigError(f"config.json: no_rope_layers / layer_types need num_hidden_layers="
                          f"{layers} entries")
    bad = sorted(set(types) - {"chunked_attention", "full_attention"})
    if bad:
        raise ConfigError(f"config.json: layer_types {bad} are not supported for Llama 4")
    if "chunked_attention" in types and (not isinstance(chunk, int) or chunk < 1):
        raise ConfigError(f"config.json: attention_chunk_size={chunk!r} must be a positive "
                          f"integer for layers of type 'chunked_attention'")
    return (tuple(bool(r) for r in rope),
            tuple(chunk if t == "chunked_attention" else None for t in types))


def fields(raw: Raw, layers: int) -> dict:
    experts = int(required(raw, "num_local_experts"))
    if int(raw["num_experts_per_tok"]) != 1:
        raise ConfigError(f"config.json: num_experts_per_tok={raw['num_experts_per_tok']} is not "
                          f"supported for Llama 4 (only 1, as Scout and Maverick)")
    step = int(raw["interleave_moe_layer_step"])
    moe = raw.get("moe_layers")
    moe = set(moe) if moe is not None else set(range(step - 1, layers, step))
    rope_layers, chunks = _layer_kinds(raw, layers)
    bias = bool(raw["attention_bias"])
    options = Llama4Options(rope_layers, bool(raw["use_qk_norm"]),
                            bool(raw["attn_temperature_tuning"]), float(raw["floor_scale"]),
                            float(raw["attn_scale"]))
    return dict(qkv_bias=bias, o_bias=bias, num_experts=experts, num_experts_per_tok=1,
                moe_intermediate_size=int(raw["moe_intermediate_size"]),
                moe_layers=tuple(i in moe for i in range(layers)), n_shared_experts=1,
                router_scoring="sigmoid", norm_topk_prob=False,
                layer_chunks=chunks if any(chunks) else (), family_options=options)


def _l2_norm(x: jax.Array, eps: float) -> jax.Array:
    xf = x.astype(jnp.float32)
    return (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)).astype(x.dtype)


class Llama4Attention(Attention):
    """transformer.Attention's steps with Llama 4's RoPE, L2 q/k norm and NoPE temperature."""

    @nn.compact
    def __call__(self, x, cos, sin, kv=None, md=None, lora_slot=None, positions=None):
        cfg, opts = self.cfg, self.cfg.family_options
        q, k, v = self.qkv(x, lora_slot)
        self.sow_kv(k, v)
        if opts.rope_layers[self.layer]:
            # Interleaved pairs as rotate-half halves: the same rotation of q and k, so q . k
            # (all the cache is read for) is HF's.
            q, k = apply_rope(deinterleave(q), cos, sin), apply_rope(deinterleave(k), cos, sin)
            if opts.qk_l2_norm:
                q, k = _l2_norm(q, cfg.rms_norm_eps), _l2_norm(k, cfg.rms_norm_eps)
        elif opts.temperature_tuning:
            p = positions.astype(jnp.float32)
            scale = jnp.log1p(jnp.floor((p + 1.0) / opts.floor_scale)) * opts.attn_scale + 1.0
            q = (q * scale[..., None, None]).astype(q.dtype)
        out, new_kv = self.attend(q, k, v, kv, md)
        return self.output(out, lora_slot), new_kv


class Llama4MoE(nn.Module):
    """Top-1 routed SwiGLU experts whose input is scaled by the router's sigmoid score, and the
    shared expert (params named as transformer.MoE's)."""
    cfg: ModelConfig
    dtype: jnp.dtype
    kernels: KernelTable

    @nn.compact
    def __call__(self, x):
        cfg = self.cfg
        e, h = cfg.num_experts, cfg.hidden_size
        lead = x.shape[:-1]
        x = x.reshape(-1, h)
        router = self.param("router", nn.initializers.lecun_normal(), (h, e), self.dtype)
        experts_w, scales = expert_weights(self, cfg, self.dtype)
        logits = self.kernels.gemm_rows(
            lambda x: jnp.dot(x, router, preferred_element_type=jnp.float32), x, x.shape[0],
            h * e)
        weights, experts = route(cfg, logits)  # [T, 1]: sigmoid of the top logit
        scaled = (x * weights.astype(x.dtype)).astype(x.dtype)
        out = self.kernels.routed_experts(scaled, experts, jnp.ones_like(weights), experts_w,
                                          scales)
        shared = dataclasses.replace(cfg, intermediate_size=cfg.moe_intermediate_size)
        out = out + MLP(shared, self.dtype, self.kernels, name="shared_experts")(x)
        return out.reshape(*lead, h)


def _half(src: Source, half: int) -> Source:
    """Gate (half 0) or up (half 1) of an [E, H, 2F] stack whose last axis is gate then up."""
    e, h, two_f = src.shape
    f = two_f // 2

    def read(idx):
        cols = range(*idx[2].indices(f))
        return src.read((idx[0], idx[1], slice(half * f + cols.start, half * f + cols.stop)))
    return Source((e, h, f), read, src.dtype)


def tensor_sources(ckpt, name: str, cfg: ModelConfig) -> dict | None:
    """The experts as HF stores them: gate_up_proj [E, H, 2F] (gate, then up), down_proj
    [E, F, H], already the [E, in, out] stacks the model holds."""
    m = _EXPERTS.fullmatch(name)
    if m is None:
        return None
    key = (f"layers_{m[1]}", "moe")
    if m[2] == "down_proj":
        return {(*key, "w_down"): stored(ckpt, name)}
    return {(*key, "w_gate"): _half(stored(ckpt, name), 0),
            (*key, "w_up"): _half(stored(ckpt, name), 1)}


def rename(name: str) -> str:
    """Llama 4's feed_forward names as the shared loader spells them (weights.hf_name)."""
    return (name.replace(".feed_forward.router.", ".mlp.gate.")
            .replace(".feed_forward.shared_expert.", ".mlp.shared_experts.")
            .replace(".feed_forward.", ".mlp."))


FAMILY = Family(fields, normalize, attention=Llama4Attention, moe=Llama4MoE,
                tensor_sources=tensor_sources, rename=rename, writable=False)
