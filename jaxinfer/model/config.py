"""Model configuration parsed from a Hugging Face `config.json`.

One transformer serves every supported family: most differences between families are fields of
`ModelConfig` (biases, q/k norm, tied embeddings, MoE shape, norms, windows, chunks, soft-caps);
a family with layers of its own swaps them in (families.py: `Family.attention`, `Family.moe`).
How each architecture's config.json sets them is `families.py` or the family's module. Anything
the model does not implement is refused there or here, with the field and value in the message,
rather than silently computing something else.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from jaxinfer.errors import ConfigError
from jaxinfer.model import families
from jaxinfer.model.deepseek import MLAConfig
from jaxinfer.model.families import required
from jaxinfer.model.kv_specs import (ChunkedLocalAttentionSpec, FixedStateSpec,
                                     FullAttentionSpec, KVCacheSpec, MLAAttentionSpec,
                                     SlidingWindowSpec)
from jaxinfer.model.quant_scheme import checkpoint_quantization
from jaxinfer.model.rope import RopeConfig, parse_rope
from jaxinfer.model.rope import rope_inv_freq as _inv_freq

SUPPORTED_ARCHITECTURES = families.SUPPORTED_ARCHITECTURES
__all__ = ["ModelConfig", "RopeConfig", "SUPPORTED_ARCHITECTURES", "config_from_dict",
           "load_config", "rope_inv_freq"]

@dataclasses.dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    # Mixture of experts; num_experts == 0 means a dense model.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    moe_layers: tuple[bool, ...] = ()
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    dtype: str = "bfloat16"
    # Weight quantization of the linear layers (jaxinfer/model/quant): None, "fp8" or "int8".
    quantization: str | None = None
    # Gemma: the MLP's gate activation ("silu" or "gelu_tanh"), norms scaling by (1 + w),
    # norms after attention and the MLP as well ("sandwich"), embeddings times sqrt(hidden).
    hidden_act: str = "silu"
    norm_offset: bool = False
    sandwich_norms: bool = False
    embed_scale: bool = False
    # Attention: the score scale (None: head_dim ** -0.5; Gemma: query_pre_attn_scalar ** -0.5),
    # tanh soft-caps of the scores and the final logits (Gemma 2), one learned sink logit per query
    # head (gpt-oss), each layer's sliding window (None: full attention; () all full), and the rope
    # of the windowed layers when it differs from `rope` (Gemma 3).
    attn_scale: float | None = None
    attn_softcap: float | None = None
    final_softcap: float | None = None
    attn_sinks: bool = False
    layer_windows: tuple[int | None, ...] = ()
    local_rope: RopeConfig | None = None
    # Qwen3-Next's gated attention (qwen3_next.py): q_proj gives each head's query and an output
    # gate, twice num_heads x head_dim wide (what LoRA's q_proj shapes follow).
    attn_output_gate: bool = False
    # Rope over the first rotary_dim dims of each head only (HF's partial_rotary_factor; the rest
    # pass through); None: the whole head.
    rotary_dim: int | None = None
    # Each layer's attention chunk (Llama 4's chunked local layers: a query at p sees keys
    # p - p % chunk <= j <= p); None: not chunked; () none is.
    layer_chunks: tuple[int | None, ...] = ()
    # gpt-oss experts: router bias, softmax over the top-k logits (not top-k of the softmax),
    # expert biases and the clamped SwiGLU (up + 1) * gate * sigmoid(alpha * gate).
    router_bias: bool = False
    topk_then_softmax: bool = False
    expert_bias: bool = False
    swiglu_clamp: tuple[float, float] | None = None  # (alpha, limit)
    # DeepSeek (deepseek.py): multi-head latent attention; always-on shared experts (one MLP of
    # n_shared_experts x moe_intermediate_size); router scores softmax or sigmoid (+ a learned
    # correction bias for the choice only), top-k within the topk_group best of n_group expert
    # groups, weights times routed_scaling_factor.
    mla: MLAConfig | None = None
    n_shared_experts: int = 0
    router_scoring: str = "softmax"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    score_correction_bias: bool = False
    # A family module's own settings (families.py), read by its own layers: a frozen dataclass
    # of that module's, None for the families of shared layers only.
    family_options: Any = None
    # DeepSeek-V3's multi-token-prediction modules (num_nextn_predict_layers): checkpoint layers
    # num_layers .. num_layers + mtp_layers - 1, read only by spec_decode/mtp.py (moe_layers
    # covers them too).
    mtp_layers: int = 0
    # State-space layers (a Mamba-2 hybrid's, run by its family's `state_layer`): per layer the
    # bytes of its fixed state (float32 conv + SSM state), None for an attention layer; () none.
    layer_states: tuple[int | None, ...] = ()
    # Granite's muP multipliers: embeddings times embedding_multiplier, each layer's attention
    # (or mixer) and MLP outputs times residual_multiplier before the residual add, the final
    # logits divided by logits_scaling.
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    def layer_is_moe(self, layer: int) -> bool:
        return bool(self.moe_layers) and self.moe_layers[layer]

    def layer_window(self, layer: int) -> int | None:
        """Layer `layer`'s sliding window (keys p - window < j <= p), None for full attention."""
        return self.layer_windows[layer] if self.layer_windows else None

    def layer_kv_specs(self) -> tuple[KVCacheSpec, ...]:
        """Per layer, what it keeps in the KV cache (kv_specs.py): the one place that turns the
        family's attention kinds into cache rules, which everything from the memory planner to
        the prefix cache reads instead of the config."""
        if self.mla:
            if self.layer_windows:
                raise ConfigError(f"{self.architecture}: MLA with sliding windows is not "
                                  f"supported")
            latent = MLAAttentionSpec(self.mla.latent_width, self.mla.kv_lora_rank)
            return (latent,) * self.num_layers
        specs = []
        for layer in range(self.num_layers):
            if self.layer_states and self.layer_states[layer] is not None:
                # Stored in the attention layers' page (padded), so both share one pool.
                page = FullAttentionSpec(self.num_kv_heads, self.head_dim)
                specs.append(FixedStateSpec(self.layer_states[layer], page_of=page))
                continue
            window = self.layer_window(layer)
            chunk = self.layer_chunks[layer] if self.layer_chunks else None
            if window is not None and chunk is not None:
                raise ConfigError(f"{self.architecture}: layer {layer} has both a sliding window "
                                  f"and an attention chunk")
            if window is not None:
                specs.append(SlidingWindowSpec(self.num_kv_heads, self.head_dim,
                                               sliding_window=window))
            elif chunk is not None:
                specs.append(ChunkedLocalAttentionSpec(self.num_kv_heads, self.head_dim,
                                                       attention_chunk=chunk))
            else:
                specs.append(FullAttentionSpec(self.num_kv_heads, self.head_dim))
        return tuple(specs)

    def layer_rope(self, layer: int) -> RopeConfig:
        return self.local_rope if self.local_rope and self.layer_window(layer) else self.rope

    @property
    def rope_head_dim(self) -> int:
        """Width the rotary embedding turns: MLA's decoupled rope dims, else the head's first
        rotary_dim (partial rotary), else the head."""
        return self.mla.qk_rope_head_dim if self.mla else (self.rotary_dim or self.head_dim)

    @property
    def kv_widths(self) -> tuple[int, int]:
        """Widths of one cached (K, V) head: MLA caches the latent alone (the V array is empty).
        Every attention layer's (KVCacheGroups refuses layers whose pages differ; a fixed state
        is stored in the attention layers' pages)."""
        spec = self.layer_kv_specs()[0]
        return (spec.page_of if isinstance(spec, FixedStateSpec) else spec).stored_widths

    @property
    def score_scale(self) -> float:
        return self.attn_scale if self.attn_scale is not None else self.head_dim ** -0.5

    def num_params(self) -> int:
        """Parameter count (embeddings counted once when tied)."""
        h, d = self.hidden_size, self.head_dim
        attn = h * d * (self.num_heads * 2 + self.num_kv_heads * 2)
        if self.mla:
            attn = _mla_params(self.mla, h, self.num_heads)
        attn += (d * (self.num_heads + 2 * self.num_kv_heads) if self.qkv_bias else 0)
        attn += 2 * d if self.qk_norm else 0
        attn += self.num_heads if self.attn_sinks else 0
        total = 0
        for layer in range(self.num_layers):
            if self.layer_is_moe(layer):
                f = self.moe_intermediate_size
                mlp = self.num_experts * 3 * h * f
                mlp += self.num_experts if self.router_bias else 0
                mlp += self.num_experts * (2 * f + h) if self.expert_bias else 0
                mlp += 3 * h * f * self.n_shared_experts + self.num_experts * (
                    h + int(self.score_correction_bias))
            else:
                mlp = 3 * h * self.intermediate_size
            total += attn + mlp + (4 if self.sandwich_norms else 2) * h
        emb = self.vocab_size * h
        return total + h + emb * (1 if self.tie_word_embeddings else 2)


def _mla_params(m: MLAConfig, h: int, heads: int) -> int:
    q = (h * m.q_lora_rank + m.q_lora_rank + m.q_lora_rank * heads * m.qk_head_dim
         if m.q_lora_rank else h * heads * m.qk_head_dim)
    kv = h * m.latent_width + m.kv_lora_rank + m.kv_lora_rank * heads * (m.qk_nope_head_dim
                                                                         + m.v_head_dim)
    return q + kv + heads * m.v_head_dim * h


def config_from_dict(raw: dict[str, Any]) -> ModelConfig:
    archs = raw.get("architectures") or []
    if not archs:
        raise ConfigError("config.json: field 'architectures' is missing or empty")
    arch = archs[0]
    family = families.family(arch)
    if family is None:
        raise ConfigError(
            f"config.json: architectures '{arch}' is not supported "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    raw = family.normalize(raw)

    hidden = int(required(raw, "hidden_size"))
    heads = int(required(raw, "num_attention_heads"))
    kv_heads = int(raw.get("num_key_value_heads") or heads)
    if heads % kv_heads:
        raise ConfigError(
            f"config.json: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}"
        )
    head_dim = int(raw.get("head_dim") or hidden // heads)
    layers = int(required(raw, "num_hidden_layers"))
    max_pos = int(raw.get("max_position_embeddings") or 4096)
    fields = family.fields(raw, layers)
    max_pos = fields.pop("max_position_embeddings", max_pos)
    moe = fields.get("num_experts_per_tok", 0), fields.get("num_experts", 0)
    if moe[0] > moe[1]:
        raise ConfigError(f"config.json: num_experts_per_tok={moe[0]} exceeds the number of "
                          f"experts {moe[1]}")

    eos = raw.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    dtype = str(raw.get("torch_dtype", raw.get("dtype", "bfloat16")) or "bfloat16")

    return ModelConfig(
        architecture=arch,
        vocab_size=int(required(raw, "vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(required(raw, "intermediate_size")),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope=fields.pop("rope", None) or parse_rope(raw),
        max_position_embeddings=max_pos,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=eos_ids,
        dtype=dtype,
        quantization=checkpoint_quantization(raw),
        **fields,
    )


def not_a_model_dir(model_dir: str | Path) -> str | None:
    """Why `model_dir` cannot be a model directory (the message), or None when it is a directory."""
    if Path(model_dir).is_file():
        return (f"'{model_dir}' is a file; a model directory is expected (config.json, the "
                f"weights, tokenizer.json)")
    if not Path(model_dir).is_dir():
        return f"model directory '{model_dir}' does not exist"
    return None


def load_config(model_dir: str | Path) -> ModelConfig:
    path = Path(model_dir) / "config.json"
    if (problem := not_a_model_dir(model_dir)) is not None:
        raise ConfigError(problem)
    if not path.is_file():
        raise ConfigError(f"'{path}' not found: a model directory needs a config.json")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"'{path}' is not valid JSON: {e}") from None
    return config_from_dict(raw)


def rope_inv_freq(cfg: ModelConfig, rope: RopeConfig | None = None) -> list[float]:
    """Inverse frequencies of `rope` (default: the model's global rope) for the model's heads."""
    return _inv_freq(rope or cfg.rope, cfg.rope_head_dim)
