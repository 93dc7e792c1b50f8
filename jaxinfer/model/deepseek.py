"""DeepSeek-V2 / V3's config.json (families.py registers them): Multi-head Latent Attention's
shape (`MLAConfig`), the dense first layers, shared + routed experts and their routing.

The paged cache of an MLA model holds, per token and layer, one latent "KV head" of width
kv_lora_rank + qk_rope_head_dim (576 for every DeepSeek model): the normed compressed KV and the
decoupled, already rotated RoPE key, shared by all query heads (docs/MLA.md). So the config says
num_kv_heads = 1 and head_dim = that width, and the cache's V array is empty (`kv_widths`);
the model's own per-head dims are in `MLAConfig`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from jaxinfer.errors import ConfigError

Raw = dict[str, Any]

# HF's DeepseekV2Config / DeepseekV3Config defaults (hub configs rely on some of them).
V2_DEFAULTS = dict(kv_lora_rank=512, q_lora_rank=1536, qk_nope_head_dim=128, qk_rope_head_dim=64,
                   v_head_dim=128, first_k_dense_replace=0, n_shared_experts=2,
                   n_routed_experts=64, routed_scaling_factor=1.0, topk_method="greedy",
                   n_group=None, topk_group=None, norm_topk_prob=False,
                   moe_intermediate_size=1407, scoring_func="softmax")
V3_DEFAULTS = dict(V2_DEFAULTS, n_shared_experts=1, n_routed_experts=256,
                   routed_scaling_factor=2.5, topk_method="noaux_tc", n_group=8, topk_group=4,
                   num_experts_per_tok=8, first_k_dense_replace=3, norm_topk_prob=True,
                   moe_intermediate_size=2048, scoring_func="sigmoid", rope_interleave=True)
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")


@dataclasses.dataclass(frozen=True)
class MLAConfig:
    q_lora_rank: int | None  # None: one q_proj; else q_a_proj -> RMSNorm -> q_b_proj
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    # The rope dims are stored as interleaved pairs (x0, x1), (x2, x3), ... (DeepSeek's layout;
    # HF V2 always, V3 with rope_interleave); False: HF's rotate-half halves.
    rope_interleave: bool = True

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_width(self) -> int:
        """One cache entry: the compressed KV and the rotated RoPE key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _with_defaults(defaults: Raw):
    def normalize(raw: Raw) -> Raw:
        raw = {**defaults, **raw}  # q_lora_rank: null (V2-Lite) means no q LoRA
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"config.json: hidden_act '{act}' is not supported (only 'silu')")
        if raw.get("attention_bias"):
            raise ConfigError("config.json: attention_bias=true is not supported for DeepSeek")
        if raw.get("quantization_config"):
            raise ConfigError("config.json: quantized DeepSeek checkpoints (quantization_config) "
                              "are not supported; load a bf16 checkpoint")
        # The cache's geometry: one latent head of the latent width (the module docstring).
        width = int(raw["kv_lora_rank"]) + int(raw["qk_rope_head_dim"])
        return {**raw, "num_key_value_heads": 1, "head_dim": width}
    return normalize


normalize_v2 = _with_defaults(V2_DEFAULTS)
normalize_v3 = _with_defaults(V3_DEFAULTS)


def _softmax_scale(raw: Raw, qk_head_dim: int) -> float:
    """qk_head_dim ** -0.5, times YaRN's mscale(factor, mscale_all_dim) squared (DeepSeek's
    attention applies it to the scores; rope.py applies the cos/sin factor)."""
    scale = qk_head_dim ** -0.5
    params = {**(raw.get("rope_scaling") or {}), **(raw.get("rope_parameters") or {})}
    if params.get("rope_type", params.get("type", "default")) not in (None, "default"):
        all_dim = params.get("mscale_all_dim")
        if all_dim:
            scale *= yarn_mscale(float(params["factor"]), float(all_dim)) ** 2
    return scale


def deepseek_fields(raw: Raw, layers: int) -> dict:
    q_lora = raw.get("q_lora_rank")
    mla = MLAConfig(q_lora_rank=int(q_lora) if q_lora else None,
                    kv_lora_rank=int(raw["kv_lora_rank"]),
                    qk_nope_head_dim=int(raw["qk_nope_head_dim"]),
                    qk_rope_head_dim=int(raw["qk_rope_head_dim"]),
                    v_head_dim=int(raw["v_head_dim"]),
                    rope_interleave=bool(raw.get("rope_interleave", True)))
    experts = int(raw.get("n_routed_experts") or 0)
    method = raw.get("topk_method") or "greedy"
    if method not in TOPK_METHODS:
        raise ConfigError(f"config.json: topk_method '{method}' is not supported "
                          f"(supported: {', '.join(TOPK_METHODS)})")
    scoring = raw.get("scoring_func") or "softmax"
    if scoring not in ("softmax", "sigmoid"):
        raise ConfigError(f"config.json: scoring_func '{scoring}' is not supported "
                          f"(supported: softmax, sigmoid)")
    v3 = raw["architectures"][0] == "DeepseekV3ForCausalLM"
    grouped = method != "greedy" or v3  # HF's V3 router always limits groups
    n_group = int(raw.get("n_group") or 1) if grouped else 1
    topk_group = int(raw.get("topk_group") or n_group) if grouped else 1
    if experts and (experts % n_group or topk_group > n_group):
        raise ConfigError(f"config.json: n_group={n_group} must divide n_routed_experts={experts} "
                          f"and topk_group={topk_group} must not exceed it")
    dense = int(raw.get("first_k_dense_replace") or 0)
    freq = int(raw.get("moe_layer_freq") or 1)
    k = int(raw.get("num_experts_per_tok") or 0)
    mtp = int(raw.get("num_nextn_predict_layers") or 0)
    return dict(mla=mla, attn_scale=_softmax_scale(raw, mla.qk_head_dim),
                num_experts=experts, num_experts_per_tok=k,
                moe_intermediate_size=int(raw["moe_intermediate_size"]),
                moe_layers=tuple(experts > 0 and i >= dense and i % freq == 0
                                 for i in range(layers + mtp)),  # the MTP modules' too
                # HF's V2 router scales and never renormalizes; V3's renormalizes, then scales.
                norm_topk_prob=bool(raw.get("norm_topk_prob")) and v3,
                n_shared_experts=int(raw.get("n_shared_experts") or 0),
                router_scoring=scoring, n_group=n_group, topk_group=topk_group,
                routed_scaling_factor=float(raw.get("routed_scaling_factor") or 1.0),
                score_correction_bias=v3, mtp_layers=mtp)
