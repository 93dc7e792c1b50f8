"""Qwen3-Next (`Qwen3NextForCausalLM`): Gated DeltaNet beside gated attention, a family in one
file (families.py, "Adding a model family" in docs/ARCHITECTURE.md).

As HF transformers' modeling_qwen3_next.py: every layer is the shared pre-norm layer
(transformer.DecoderLayer) with Gemma's (1 + w) RMSNorms (norm_offset), its mixer Gated
DeltaNet (gated_deltanet.py, layer_types "linear_attention"; its state a FixedStateSpec in the
attention pages) or gated attention (layer_types "full_attention"): q_proj gives each head's
query and an output gate, q and k are RMSNormed per head, RoPE turns the first
partial_rotary_factor of each head, and the heads' output is times sigmoid(gate) before o_proj.
The MLP is Qwen3-MoE's (decoder_sparse_step, mlp_only_layers; softmax, top-k, renormalised with
norm_topk_prob) plus a shared expert (shared_expert_intermediate_size wide) times
sigmoid(shared_expert_gate(x)). The checkpoint's multi-token-prediction module (mtp.*: fc over
[pre_fc_norm_embedding(e), pre_fc_norm_hidden(h)], one full-attention layer `layers.0`, norm,
the target's LM head; `MTP` below) is not part of the model, as in HF's; it is read by
`--speculative-config '{"method": "mtp", ...}'` (spec_decode/mtp.py), whose verifying steps roll
the Gated DeltaNet states back past a rejected proposal (core/kv_cache/state_rollback.py).
"""

from __future__ import annotations

import dataclasses
import functools
import re

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxinfer.errors import ConfigError
from jaxinfer.model.families import FAMILIES, Family, MTPLayout, Raw
from jaxinfer.model.fused_projections import project
from jaxinfer.model.gated_deltanet import GatedDeltaNet, GatedDeltaNetDims
from jaxinfer.model.norm_rope import RMSNorm, apply_rope
from jaxinfer.model.quant.layers import linear
from jaxinfer.model.rope import partial_rotary_dim
from jaxinfer.model.tensor_sources import depthwise_conv_weight, plain
from jaxinfer.model.transformer import MLP, Attention, MoE

# HF's Qwen3NextConfig defaults (hub configs rely on some of them).
DEFAULTS = dict(vocab_size=151936, hidden_size=2048, intermediate_size=5632,
                num_hidden_layers=48, num_attention_heads=16, num_key_value_heads=2,
                hidden_act="silu", max_position_embeddings=32768, rms_norm_eps=1e-6,
                tie_word_embeddings=False, attention_bias=False, head_dim=256,
                linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
                linear_num_key_heads=16, linear_num_value_heads=32, decoder_sparse_step=1,
                moe_intermediate_size=512, shared_expert_intermediate_size=512,
                num_experts_per_tok=10, num_experts=512, norm_topk_prob=True,
                partial_rotary_factor=0.25, full_attention_interval=4, rope_theta=10000.0)
LINEAR, FULL = "linear_attention", "full_attention"
_LAYER = re.compile(r"model\.layers\.(\d+)\.(linear_attn\.conv1d\.weight|"
                    r"mlp\.shared_expert\.(gate|up|down)_proj\.(weight|weight_scale(?:_inv)?)|"
                    r"mlp\.shared_expert_gate\.weight)")
_MTP = re.compile(r"mtp\..*")
# The MTP module as vLLM's qwen3_next_mtp reads it: no mask at position 0, and a draft chain's
# next step reads the module's output after its final norm.
MTP = MTPLayout(prefix="mtp.", own=(("pre_fc_norm_embedding", "enorm"),
                                    ("pre_fc_norm_hidden", "hnorm"), ("fc", "eh_proj")),
                layer="layers.0.", norm="norm.weight", head=None, masks_position_0=False,
                chains_normed=True)


@dataclasses.dataclass(frozen=True)
class Qwen3NextOptions:
    """`ModelConfig.family_options` of a Qwen3-Next model."""
    gdn: GatedDeltaNetDims
    shared_expert_intermediate_size: int

    @property
    def state_dims(self) -> GatedDeltaNetDims:
        """The state-space layers' dims (their tp_refusal: parallel/sharding.py)."""
        return self.gdn


def normalize(raw: Raw) -> Raw:
    """HF's defaults (transformers 5 may write the experts' count as num_local_experts)."""
    if raw.get("num_experts") is None and raw.get("num_local_experts") is not None:
        raw = {**raw, "num_experts": raw["num_local_experts"]}
    raw = {**DEFAULTS, **raw}
    if raw["hidden_act"] != "silu":
        raise ConfigError(f"config.json: hidden_act '{raw['hidden_act']}' is not supported "
                          f"(only 'silu')")
    return raw


def _state_layers(raw: Raw, layers: int) -> tuple[bool, ...]:
    """Per layer whether it is a Gated DeltaNet layer: layer_types, else HF's pattern of one
    full-attention layer every full_attention_interval."""
    interval = int(raw["full_attention_interval"])
    types = raw.get("layer_types") or [LINEAR if (i + 1) % interval else FULL
                                       for i in range(layers)]
    if len(types) != layers:
        raise ConfigError(f"config.json: layer_types has {len(types)} entries for "
                          f"num_hidden_layers={layers}")
    bad = sorted(set(types) - {LINEAR, FULL})
    if bad:
        raise ConfigError(f"config.json: layer_types {bad} are not supported (supported: "
                          f"{LINEAR}, {FULL})")
    if FULL not in types:
        raise ConfigError("config.json: layer_types has no full_attention layer; a model of "
                          "Gated DeltaNet layers only is not supported (its state is stored in "
                          "attention pages)")
    return tuple(t == LINEAR for t in types)


def _gdn_dims(raw: Raw) -> GatedDeltaNetDims:
    hk, hv = int(raw["linear_num_key_heads"]), int(raw["linear_num_value_heads"])
    if hv % hk:
        raise ConfigError(f"config.json: linear_num_key_heads={hk} must divide "
                          f"linear_num_value_heads={hv}")
    return GatedDeltaNetDims(hk, hv, int(raw["linear_key_head_dim"]),
                             int(raw["linear_value_head_dim"]), int(raw["linear_conv_kernel_dim"]))


def fields(raw: Raw, layers: int) -> dict:
    dims = _gdn_dims(raw)
    state = _state_layers(raw, layers)
    # Qwen3-MoE's attention biases, q/k norms, experts and sparse layers (Qwen3's without
    # experts: every layer's MLP dense, as HF's model runs num_experts = 0).
    qwen3 = FAMILIES["Qwen3MoeForCausalLM" if raw["num_experts"] else "Qwen3ForCausalLM"]
    return dict(qwen3.fields(raw, layers), norm_offset=True, attn_output_gate=True,
                rotary_dim=partial_rotary_dim(raw),
                layer_states=tuple(dims.state_bytes if s else None for s in state),
                # vLLM's default: hub configs do not say (load_mtp finds out).
                mtp_layers=int(raw.get("num_nextn_predict_layers", 1) or 0),
                family_options=Qwen3NextOptions(dims,
                                                int(raw["shared_expert_intermediate_size"])))


class Qwen3NextAttention(Attention):
    """transformer.Attention's steps with q_proj's per-head output gate
    (ModelConfig.attn_output_gate): q_proj gives [q, gate] per head, and the heads' output is
    times sigmoid(gate) before o_proj."""

    @nn.compact
    def __call__(self, x, cos, sin, kv=None, md=None, lora_slot=None, positions=None):
        cfg, d = self.cfg, self.cfg.head_dim
        lead = x.shape[:-1]
        dense = functools.partial(linear(cfg, self.dtype, self.kernels), use_bias=cfg.qkv_bias)
        adapt = functools.partial(self.kernels.lora_delta, self, lora_slot)
        qg, k, v = project(self, dense, x, (("q_proj", 2 * cfg.num_heads * d),
                                            ("k_proj", cfg.num_kv_heads * d),
                                            ("v_proj", cfg.num_kv_heads * d)), "qkv_proj", adapt)
        q, gate = jnp.split(qg.reshape(*lead, cfg.num_heads, 2 * d), 2, axis=-1)
        norm = functools.partial(RMSNorm, cfg.rms_norm_eps, self.dtype, offset=True)
        q = norm(name="q_norm")(q)
        k = norm(name="k_norm")(k.reshape(*lead, cfg.num_kv_heads, d))
        v = v.reshape(*lead, cfg.num_kv_heads, d)
        self.sow_kv(k, v)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out, new_kv = self.attend(q, k, v, kv, md)
        return self.output(out * jax.nn.sigmoid(gate), lora_slot), new_kv


class Qwen3NextMoE(MoE):
    """transformer.MoE's routed experts (params as its own) beside the shared expert, times
    sigmoid(shared_expert_gate(x))."""

    @nn.compact
    def __call__(self, x):
        cfg = self.cfg
        routed = super().__call__(x)
        shared = dataclasses.replace(
            cfg, intermediate_size=cfg.family_options.shared_expert_intermediate_size)
        out = MLP(shared, self.dtype, self.kernels, name="shared_expert")(x)
        gate_w = self.param("shared_expert_gate", nn.initializers.lecun_normal(),
                            (cfg.hidden_size, 1), self.dtype)
        gate = jnp.dot(x, gate_w, preferred_element_type=jnp.float32)
        return routed + (jax.nn.sigmoid(gate) * out).astype(x.dtype)


def tensor_sources(ckpt, name: str, cfg) -> dict | None:
    """The tensors stored in layouts or places of their own: the conv weight, the shared
    expert and its gate ({param path: Source}), the multi-token-prediction module ({}: not the
    model's; spec_decode/mtp.py reads it); None for the names the shared loader maps."""
    if _MTP.fullmatch(name):
        return {}
    m = _LAYER.fullmatch(name)
    if m is None:
        return None
    layer, part = f"layers_{m[1]}", m[2]
    if part.startswith("linear_attn."):
        return {(layer, "linear_attn", "conv1d_weight"): depthwise_conv_weight(ckpt, name)}
    if m[3] is not None:
        proj = (layer, "moe", "shared_expert", f"{m[3]}_proj")
        if m[4] != "weight":  # a quantized checkpoint's scales, stored as the model keeps them
            return {(*proj, "weight_scale"): plain(ckpt, name, False)}
        # Under quantization a QuantLinear's weight [out, in], else a Dense kernel [in, out].
        if cfg.quantization:
            return {(*proj, "weight"): plain(ckpt, name, False)}
        return {(*proj, "kernel"): plain(ckpt, name, True)}
    return {(layer, "moe", "shared_expert_gate"): plain(ckpt, name, True)}


FAMILY = Family(fields, normalize, attention=Qwen3NextAttention, moe=Qwen3NextMoE,
                state_layer=GatedDeltaNet, state_layer_name="linear_attn",
                tensor_sources=tensor_sources, writable=False, mtp=MTP)
