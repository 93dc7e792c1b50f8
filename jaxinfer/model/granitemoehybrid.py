"""IBM Granite 4.0-H (`GraniteMoeHybridForCausalLM`): a Mamba-2 hybrid, a family in one file
(families.py, "Adding a model family" in docs/ARCHITECTURE.md).

As HF transformers' modeling_granitemoehybrid.py, every layer is the shared pre-norm layer
(transformer.DecoderLayer): input norm, a mixer, post-attention norm, an MLP, each output times
residual_multiplier before its residual add. The mixer is Mamba-2 (mamba2.py, layer_types
"mamba"; its state a FixedStateSpec in the attention pages) or Llama's attention (layer_types
"attention") with scores scaled by attention_multiplier, RoPE only when
position_embedding_type is "rope" (the 4.0-H checkpoints have none: NoPE). The MLP is the
shared SwiGLU MLP (shared_mlp, shared_intermediate_size wide), plus, when num_local_experts > 0,
top-k experts (intermediate_size wide) weighted by the softmax of their top-k router logits
(gpt-oss's order: transformer.MoE's topk_then_softmax). Embeddings are times
embedding_multiplier, logits divided by logits_scaling (ModelConfig's Granite multipliers).
"""

from __future__ import annotations

import dataclasses
import re

import flax.linen as nn
import jax.numpy as jnp

from jaxinfer.errors import ConfigError
from jaxinfer.model.config import ModelConfig
from jaxinfer.model.families import Family, Raw
from jaxinfer.model.kernel_table import KernelTable
from jaxinfer.model.mamba2 import Mamba2Dims, Mamba2Mixer
from jaxinfer.model.norm_rope import apply_rope
from jaxinfer.model.tensor_sources import (Source, depthwise_conv_weight, fused_down,
                                           fused_gate_up, plain, row_block,
                                           scale_rows)
from jaxinfer.model.transformer import MLP, Attention, MoE

# HF's GraniteMoeHybridConfig defaults (hub configs rely on some of them).
DEFAULTS = dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                num_hidden_layers=32, num_attention_heads=32, hidden_act="silu",
                max_position_embeddings=2048, rms_norm_eps=1e-6, tie_word_embeddings=False,
                attention_bias=False, embedding_multiplier=1.0, logits_scaling=1.0,
                residual_multiplier=1.0, attention_multiplier=1.0, num_local_experts=8,
                num_experts_per_tok=2, shared_intermediate_size=1024,
                position_embedding_type=None, mamba_n_heads=128, mamba_n_groups=1,
                mamba_d_state=256, mamba_d_head="auto", mamba_d_conv=4, mamba_expand=2,
                mamba_chunk_size=256, mamba_conv_bias=True, mamba_proj_bias=False,
                time_step_limit=(0.0, float("inf")), rope_theta=10000.0, bos_token_id=1,
                eos_token_id=2)
# layer_types as hub configs spell them, and as transformers 5 rewrites them.
MAMBA, ATTENTION = ("mamba", "linear_attention"), ("attention", "full_attention")
_LAYER = re.compile(r"model\.layers\.(\d+)\.(mamba\.conv1d\.(weight|bias)|"
                    r"mamba\.in_proj\.(?:weight|bias|weight_scale(?:_inv)?)|"
                    r"shared_mlp\.(input|output)_linear\.weight|"
                    r"block_sparse_moe\.(input_linear|output_linear|router\.layer)\.weight)")


@dataclasses.dataclass(frozen=True)
class GraniteHybridOptions:
    """`ModelConfig.family_options` of a Granite 4.0-H model."""
    mamba: Mamba2Dims
    rope: bool  # position_embedding_type "rope"; else the attention layers turn none (NoPE)

    @property
    def state_dims(self) -> Mamba2Dims:
        """The state-space layers' dims (their tp_refusal: parallel/sharding.py)."""
        return self.mamba


def normalize(raw: Raw) -> Raw:
    """HF's defaults; the shared model's MLP width is shared_mlp's, the experts' HF's
    intermediate_size (as llama4.py moves its widths)."""
    raw = {**DEFAULTS, **raw}
    if raw["hidden_act"] != "silu":
        raise ConfigError(f"config.json: hidden_act '{raw['hidden_act']}' is not supported "
                          f"(only 'silu')")
    return {**raw, "intermediate_size": raw["shared_intermediate_size"],
            "moe_intermediate_size": raw["intermediate_size"]}


def _state_layers(raw: Raw, layers: int) -> tuple[bool, ...]:
    """Per layer whether it is a Mamba-2 layer (layer_types, or the older layers_block_type;
    HF's default: every layer)."""
    types = raw.get("layer_types") or raw.get("layers_block_type") or [MAMBA[0]] * layers
    if len(types) != layers:
        raise ConfigError(f"config.json: layer_types has {len(types)} entries for "
                          f"num_hidden_layers={layers}")
    bad = sorted(set(types) - set(MAMBA) - set(ATTENTION))
    if bad:
        raise ConfigError(f"config.json: layer_types {bad} are not supported (supported: "
                          f"{', '.join(MAMBA + ATTENTION)})")
    return tuple(t in MAMBA for t in types)


def _json_float(value) -> float:
    """A float of config.json: transformers 5 writes infinities as {"__float__": "Infinity"}."""
    return float(value["__float__"] if isinstance(value, dict) else value)


def _mamba_dims(raw: Raw) -> Mamba2Dims:
    heads, inner = int(raw["mamba_n_heads"]), int(raw["mamba_expand"]) * int(raw["hidden_size"])
    head_dim = inner // heads if raw["mamba_d_head"] == "auto" else int(raw["mamba_d_head"])
    groups = int(raw["mamba_n_groups"])
    if heads * head_dim != inner or heads % groups:
        raise ConfigError(f"config.json: mamba_n_heads={heads} x mamba_d_head={head_dim} must be "
                          f"mamba_expand x hidden_size = {inner}, and mamba_n_groups={groups} "
                          f"must divide mamba_n_heads")
    limit = raw["time_step_limit"] or (0.0, float("inf"))
    return Mamba2Dims(heads, head_dim, groups, int(raw["mamba_d_state"]),
                      int(raw["mamba_d_conv"]), int(raw["mamba_chunk_size"]),
                      bool(raw["mamba_conv_bias"]), bool(raw["mamba_proj_bias"]),
                      (_json_float(limit[0]), _json_float(limit[1])))


def fields(raw: Raw, layers: int) -> dict:
    position = raw["position_embedding_type"]
    if position not in (None, "nope", "rope"):
        raise ConfigError(f"config.json: position_embedding_type {position!r} is not supported "
                          f"(supported: null, 'nope', 'rope')")
    dims = _mamba_dims(raw)
    state = _state_layers(raw, layers)
    if all(state):
        raise ConfigError("config.json: layer_types has no attention layer; a model of Mamba-2 "
                          "layers only is not supported (its state is stored in attention pages)")
    experts = int(raw["num_local_experts"] or 0)
    moe = {}
    if experts:
        moe = dict(num_experts=experts, num_experts_per_tok=int(raw["num_experts_per_tok"]),
                   moe_intermediate_size=int(raw["moe_intermediate_size"]),
                   topk_then_softmax=True, moe_layers=(True,) * layers)
    bias = bool(raw["attention_bias"])
    return dict(qkv_bias=bias, o_bias=bias, attn_scale=float(raw["attention_multiplier"]),
                layer_states=tuple(dims.state_bytes if s else None for s in state),
                embedding_multiplier=float(raw["embedding_multiplier"]),
                residual_multiplier=float(raw["residual_multiplier"]),
                logits_scaling=float(raw["logits_scaling"]),
                family_options=GraniteHybridOptions(dims, position == "rope"), **moe)


class GraniteHybridAttention(Attention):
    """transformer.Attention's steps, RoPE only when the config asks for it."""

    @nn.compact
    def __call__(self, x, cos, sin, kv=None, md=None, lora_slot=None, positions=None):
        q, k, v = self.qkv(x, lora_slot)
        self.sow_kv(k, v)
        if self.cfg.family_options.rope:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out, new_kv = self.attend(q, k, v, kv, md)
        return self.output(out, lora_slot), new_kv


class GraniteMoE(nn.Module):
    """The routed experts (transformer.MoE) beside the always-on shared MLP."""
    cfg: ModelConfig
    dtype: jnp.dtype
    kernels: KernelTable

    @nn.compact
    def __call__(self, x):
        routed = MoE(self.cfg, self.dtype, self.kernels, name="experts")(x)
        return routed + MLP(self.cfg, self.dtype, self.kernels, name="shared_mlp")(x)


def _gate_or_up(ckpt, name: str, half: int, kernel: bool) -> Source:
    """Gate (half 0) or up (half 1) of shared_mlp.input_linear [2F, H]: as a Dense kernel
    [H, F], or (`kernel` False: a QuantLinear's, quantized on load) a weight [F, H]."""
    f = ckpt.shape(name)[0] // 2
    return row_block(ckpt, name, half * f, f, kernel)


def _in_projections(ckpt, name: str, layer: str, tensor: str, cfg: ModelConfig) -> dict:
    """mamba.in_proj's weight [z | x | B | C | dt, H] (or its bias, or its scales) as the mixer's
    parts (Mamba2Dims.in_projections)."""
    kernel = tensor == "weight" and not cfg.quantization
    parts = cfg.family_options.mamba.in_projections
    rows = sum(size for _, size in parts)
    out, start = {}, 0
    for part, size in parts:
        if tensor.startswith("weight_scale"):  # (weight_scale_inv: a multiplier all the same)
            out[(layer, "mamba", part, "weight_scale")] = scale_rows(ckpt, name, start, size, rows)
        else:
            leaf = "kernel" if kernel else tensor
            out[(layer, "mamba", part, leaf)] = row_block(ckpt, name, start, size, kernel)
        start += size
    return out


def tensor_sources(ckpt, name: str, cfg: ModelConfig) -> dict | None:
    """The tensors stored in layouts of their own: the conv weight, the mixer's fused in_proj,
    the shared MLP's fused gate/up, the experts' fused stacks and the router ({param path:
    Source}); None for the names the shared loader maps (the mixer's out_proj and A_log, D,
    dt_bias, norm)."""
    m = _LAYER.fullmatch(name)
    if m is None:
        return None
    layer, part = f"layers_{m[1]}", m[2]
    if part.startswith("mamba.in_proj."):
        return _in_projections(ckpt, name, layer, part.rsplit(".", 1)[1], cfg)
    if part.startswith("mamba.conv1d."):
        tensor = part.rsplit(".", 1)[1]
        src = depthwise_conv_weight(ckpt, name) if tensor == "weight" else plain(ckpt, name, False)
        return {(layer, "mamba", f"conv1d_{tensor}"): src}
    if part.startswith("shared_mlp."):
        mlp = (layer, "moe", "shared_mlp") if cfg.is_moe else (layer, "mlp")
        # Under --quantization the MLP's projections are QuantLinear weights [out, in].
        kernel = not cfg.quantization
        leaf = "kernel" if kernel else "weight"
        if m[4] == "output":
            return {(*mlp, "down_proj", leaf): plain(ckpt, name, kernel)}
        return {(*mlp, "gate_proj", leaf): _gate_or_up(ckpt, name, 0, kernel),
                (*mlp, "up_proj", leaf): _gate_or_up(ckpt, name, 1, kernel)}
    experts = (layer, "moe", "experts")
    if m[5] == "router.layer":
        return {(*experts, "router"): plain(ckpt, name, True)}
    if m[5] == "output_linear":
        return {(*experts, "w_down"): fused_down(ckpt, name)}
    return {(*experts, "w_gate"): fused_gate_up(ckpt, name, 0),
            (*experts, "w_up"): fused_gate_up(ckpt, name, 1)}


FAMILY = Family(fields, normalize, attention=GraniteHybridAttention, moe=GraniteMoE,
                state_layer=Mamba2Mixer, tensor_sources=tensor_sources, writable=False)
