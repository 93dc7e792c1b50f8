"""GLM-4.5 / 4.6 (`Glm4MoeForCausalLM`): a family in one file (families.py, "Adding a model
family" in docs/ARCHITECTURE.md).

As HF transformers' modeling_glm4_moe.py: Llama's layers with q/k/v biases (attention_bias; o_proj
has none), an optional RMSNorm of q and k per head before RoPE (use_qk_norm), RoPE over the first
partial_rotary_factor of each head, the first first_k_dense_replace layers dense and the others
MoE layers as DeepSeek-V3's: sigmoid scores, the choice by scores plus e_score_correction_bias
limited to the topk_group best of n_group expert groups (a group's score: its two best), weights
renormalized (norm_topk_prob) and times routed_scaling_factor, beside n_shared_experts
always-on experts. Every one of these is a switch of the shared model (transformer.py's
`Attention`, `MoE`, routing.py), so the family declares config parsing and its checkpoint's
multi-token-prediction layers only.
"""

from __future__ import annotations

import re

from jaxinfer.errors import ConfigError
from jaxinfer.model.config import ModelConfig
from jaxinfer.model.families import Family, Raw, required
from jaxinfer.model.rope import partial_rotary_dim

# HF's Glm4MoeConfig defaults (hub configs rely on some of them).
DEFAULTS = dict(vocab_size=151552, hidden_size=4096, intermediate_size=10944,
                num_hidden_layers=46, num_attention_heads=96, num_key_value_heads=8,
                hidden_act="silu", max_position_embeddings=131072, rms_norm_eps=1e-5,
                attention_bias=False, moe_intermediate_size=1408, num_experts_per_tok=8,
                n_shared_experts=1, n_routed_experts=128, routed_scaling_factor=1.0, n_group=1,
                topk_group=1, first_k_dense_replace=1, norm_topk_prob=True, use_qk_norm=False,
                partial_rotary_factor=0.5, rope_theta=10000.0)
_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def normalize(raw: Raw) -> Raw:
    raw = {**DEFAULTS, **raw}
    if raw["hidden_act"] != "silu":
        raise ConfigError(f"config.json: hidden_act '{raw['hidden_act']}' is not supported "
                          f"(only 'silu')")
    return raw


def fields(raw: Raw, layers: int) -> dict:
    experts = int(required(raw, "n_routed_experts"))
    n_group, topk_group = int(raw["n_group"]), int(raw["topk_group"])
    if experts % n_group or not 1 <= topk_group <= n_group or experts // n_group < 2:
        raise ConfigError(f"config.json: n_group={n_group} must divide n_routed_experts="
                          f"{experts} into groups of at least 2 and topk_group={topk_group} "
                          f"must be in 1..n_group")
    dense = int(raw["first_k_dense_replace"])
    return dict(qkv_bias=bool(raw["attention_bias"]), qk_norm=bool(raw["use_qk_norm"]),
                rotary_dim=partial_rotary_dim(raw), num_experts=experts,
                num_experts_per_tok=int(raw["num_experts_per_tok"]),
                moe_intermediate_size=int(raw["moe_intermediate_size"]),
                moe_layers=tuple(i >= dense for i in range(layers)),
                norm_topk_prob=bool(raw["norm_topk_prob"]),
                n_shared_experts=int(raw["n_shared_experts"]), router_scoring="sigmoid",
                n_group=n_group, topk_group=topk_group,
                routed_scaling_factor=float(raw["routed_scaling_factor"]),
                score_correction_bias=True)


def tensor_sources(ckpt, name: str, cfg: ModelConfig) -> dict | None:
    """Hub checkpoints hold the multi-token-prediction layer(s) after the last layer
    (num_nextn_predict_layers); HF's model does not load them, nor does this one."""
    m = _LAYER.match(name)
    return {} if m and int(m[1]) >= cfg.num_layers else None


FAMILY = Family(fields, normalize, tensor_sources=tensor_sources)
