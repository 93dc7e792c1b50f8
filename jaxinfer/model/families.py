"""The model families: architecture name -> `Family`, what its config.json means for
`ModelConfig` (HF's config defaults, which hub configs rely on, plus `fields`, the settings that
differ from Llama's), the layers it runs instead of the shared ones, and its tensor names.

A family whose only differences are switches of the shared model is a `Family` entry in
`FAMILIES` below. A family with layers of its own is one module of jaxinfer/model (e.g.
glm4_moe.py, llama4.py) that declares `FAMILY = Family(...)`, composed from the shared layers
(transformer.py, mla.py, routing.py, experts.py), and one line in `MODULES`; it is imported the
first time a config names its architecture (so the model's modules can look a family up here
without importing it). docs/ARCHITECTURE.md ("Adding a model family") walks through one.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
from typing import Any, Callable

from jaxinfer.errors import ConfigError
from jaxinfer.model import deepseek
from jaxinfer.model.rope import parse_rope

log = logging.getLogger(__name__)

Raw = dict[str, Any]


def required(raw: Raw, key: str) -> Any:
    if raw.get(key) is None:
        raise ConfigError(f"config.json: required field '{key}' is missing")
    return raw[key]


def _silu_only(raw: Raw) -> Raw:
    act = raw.get("hidden_act", raw.get("hidden_activation", "silu"))
    if act != "silu":
        raise ConfigError(f"config.json: hidden_act '{act}' is not supported (only 'silu')")
    return raw


def _cap_at_sliding_window(raw: Raw, arch: str) -> dict:
    """Llama-style families run every layer with full attention; a `sliding_window` shorter than
    the context caps the context at the window (as vLLM does for these families), so nothing the
    window would hide is ever attended."""
    max_pos = int(raw.get("max_position_embeddings") or 4096)
    window = raw.get("sliding_window")
    if arch.startswith("Qwen") and not raw.get("use_sliding_window", False):
        return {}
    if window is None or window >= max_pos:
        return {}
    log.warning("config.json: sliding_window=%d < max_position_embeddings=%d; this family runs "
                "full attention, so the context is capped at %d tokens", window, max_pos, window)
    return {"max_position_embeddings": int(window)}


def layer_windows(raw: Raw, layers: int, sliding: Callable[[int], bool]) -> tuple[int | None, ...]:
    """Each layer's window from `layer_types` (transformers >= 4.54), else the family's pattern
    `sliding(i)` (Gemma 3's `sliding_window_pattern`, gpt-oss's and Gemma 2's alternation)."""
    types = raw.get("layer_types")
    if types is None:
        types = ["sliding_attention" if sliding(i) else "full_attention" for i in range(layers)]
    if len(types) != layers:
        raise ConfigError(f"config.json: layer_types has {len(types)} entries for "
                          f"num_hidden_layers={layers}")
    bad = sorted(set(types) - {"sliding_attention", "full_attention"})
    if bad:
        raise ConfigError(f"config.json: layer_types {bad} are not supported "
                          f"(supported: 'sliding_attention', 'full_attention')")
    window = raw.get("sliding_window")
    if "sliding_attention" in types and (not isinstance(window, int) or window < 1):
        raise ConfigError(f"config.json: sliding_window={window!r} must be a positive integer "
                          f"for layers of type 'sliding_attention'")
    return tuple(window if t == "sliding_attention" else None for t in types)


def _llama(raw: Raw, layers: int) -> dict:
    bias = bool(raw.get("attention_bias", False))
    return dict(qkv_bias=bias, o_bias=bias, mlp_bias=bool(raw.get("mlp_bias", False)),
                **_cap_at_sliding_window(raw, "LlamaForCausalLM"))


def _mistral(raw: Raw, layers: int) -> dict:
    """Mistral's `sliding_window` (Mistral-7B-v0.1: 4,096) windows every layer, as HF does; the KV
    manager then keeps only each sequence's window of blocks (docs/kv_cache.md)."""
    window = raw.get("sliding_window")
    if window is None or window >= int(raw.get("max_position_embeddings") or 4096):
        return {}
    return dict(layer_windows=layer_windows(raw, layers, lambda i: True))


def _qwen2(raw: Raw, layers: int) -> dict:
    return dict(qkv_bias=True, **_cap_at_sliding_window(raw, "Qwen2ForCausalLM"))


def _qwen3(raw: Raw, layers: int) -> dict:
    bias = bool(raw.get("attention_bias", False))
    return dict(qk_norm=True, qkv_bias=bias, o_bias=bias,
                **_cap_at_sliding_window(raw, "Qwen3ForCausalLM"))


def _mixtral(raw: Raw, layers: int) -> dict:
    return dict(num_experts=int(required(raw, "num_local_experts")),
                num_experts_per_tok=int(required(raw, "num_experts_per_tok")),
                moe_intermediate_size=int(required(raw, "intermediate_size")),
                norm_topk_prob=True, moe_layers=(True,) * layers,
                **_cap_at_sliding_window(raw, "MixtralForCausalLM"))


def _mixtral_normalize(raw: Raw) -> Raw:
    return _silu_only({"rope_theta": 1_000_000.0, **raw})  # MixtralConfig's default_theta


def _qwen3_moe(raw: Raw, layers: int) -> dict:
    # Hub configs say num_experts; transformers 5 writes num_local_experts (its attribute_map).
    experts = int(raw.get("num_experts") or required(raw, "num_local_experts"))
    step = int(raw.get("decoder_sparse_step", 1) or 1)
    dense_only = set(raw.get("mlp_only_layers") or [])
    return dict(_qwen3(raw, layers), num_experts=experts,
                num_experts_per_tok=int(required(raw, "num_experts_per_tok")),
                moe_intermediate_size=int(required(raw, "moe_intermediate_size")),
                norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
                moe_layers=tuple(i not in dense_only and experts > 0 and (i + 1) % step == 0
                                 for i in range(layers)))


# --- Gemma 2 / Gemma 3 ---------------------------------------------------------------------------

# HF's Gemma2Config / Gemma3TextConfig defaults: hub configs leave many of these out.
_GEMMA_COMMON = dict(head_dim=256, hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6,
                     tie_word_embeddings=True, query_pre_attn_scalar=256, sliding_window=4096,
                     attention_bias=False, bos_token_id=2, eos_token_id=1, pad_token_id=0)
GEMMA2_DEFAULTS = dict(_GEMMA_COMMON, vocab_size=256000, hidden_size=2304, intermediate_size=9216,
                       num_hidden_layers=26, num_attention_heads=8, num_key_value_heads=4,
                       max_position_embeddings=8192, rope_theta=10000.0,
                       final_logit_softcapping=30.0, attn_logit_softcapping=50.0)
GEMMA3_DEFAULTS = dict(_GEMMA_COMMON, vocab_size=262208, hidden_size=2304, intermediate_size=9216,
                       num_hidden_layers=26, num_attention_heads=8, num_key_value_heads=4,
                       max_position_embeddings=131072, rope_theta=1_000_000.0,
                       rope_local_base_freq=10_000.0, sliding_window_pattern=6,
                       final_logit_softcapping=None, attn_logit_softcapping=None)
GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh")


def _gemma_defaults(defaults: Raw) -> Callable[[Raw], Raw]:
    def normalize(raw: Raw) -> Raw:
        if raw.get("use_bidirectional_attention"):
            raise ConfigError("config.json: use_bidirectional_attention=true is not supported "
                              "(causal language models only)")
        return {**defaults, **raw}
    return normalize


def _gemma3_multimodal(raw: Raw) -> Raw:
    """Gemma3ForConditionalGeneration: its language model's config (`text_config`) with the
    top-level token ids and dtype; the vision tower is not loaded (image inputs are refused).
    Whether lm_head is the embedding is the top-level tie_word_embeddings (Gemma3Config's, default
    true), as in HF, which never reads the text_config's."""
    text = raw.get("text_config")
    if not isinstance(text, dict):
        raise ConfigError("config.json: Gemma3ForConditionalGeneration needs a 'text_config' object")
    top = {k: raw[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id", "torch_dtype",
                               "dtype", "quantization_config")
           if raw.get(k) is not None}
    return _gemma_defaults(GEMMA3_DEFAULTS)({
        **top, **text, "architectures": raw["architectures"],
        "tie_word_embeddings": bool(raw.get("tie_word_embeddings", True))})


def _gemma_common(raw: Raw) -> dict:
    act = raw.get("hidden_activation") or raw.get("hidden_act")
    if act not in GELU_TANH:
        raise ConfigError(f"config.json: hidden_activation '{act}' is not supported for Gemma "
                          f"(supported: {', '.join(GELU_TANH)})")
    if raw.get("attention_bias"):
        raise ConfigError("config.json: attention_bias=true is not supported for Gemma")
    return dict(hidden_act="gelu_tanh", norm_offset=True, sandwich_norms=True, embed_scale=True,
                attn_scale=float(required(raw, "query_pre_attn_scalar")) ** -0.5,
                attn_softcap=raw.get("attn_logit_softcapping"),
                final_softcap=raw.get("final_logit_softcapping"))


def _gemma2(raw: Raw, layers: int) -> dict:
    return dict(_gemma_common(raw), layer_windows=layer_windows(raw, layers, lambda i: i % 2 == 0))


def _gemma3(raw: Raw, layers: int) -> dict:
    pattern = int(raw.get("sliding_window_pattern") or 6)
    windows = layer_windows(raw, layers, lambda i: bool((i + 1) % pattern))
    # As Gemma3TextConfig: transformers 5's per-layer-type rope_parameters (a flat one is not
    # read), rope_scaling updating the global layers' entry, and the thetas' defaults.
    params = raw.get("rope_parameters") or {}
    full = {**(params.get("full_attention") or {}), **(raw.get("rope_scaling") or {})}
    rope = parse_rope(raw, full, float(raw["rope_theta"]))
    local = parse_rope(raw, params.get("sliding_attention") or {},
                       float(raw["rope_local_base_freq"]))
    if raw.get("attn_logit_softcapping") is not None:
        log.warning("config.json: attn_logit_softcapping=%s is ignored: Gemma 3's attention has no "
                    "soft-cap (HF transformers' Gemma3Attention never applies it)",
                    raw["attn_logit_softcapping"])
    return dict(_gemma_common(raw), qk_norm=True, layer_windows=windows, rope=rope,
                local_rope=local, attn_softcap=None)


def _gemma3_multimodal_fields(raw: Raw, layers: int) -> dict:
    if raw.get("final_logit_softcapping") is not None:
        log.warning("config.json: final_logit_softcapping=%s is ignored: HF transformers' "
                    "Gemma3ForConditionalGeneration never applies it",
                    raw["final_logit_softcapping"])
    return dict(_gemma3(raw, layers), final_softcap=None)


# --- gpt-oss -------------------------------------------------------------------------------------

# HF's GptOssConfig defaults that its YaRN reads (hub configs set both).
GPT_OSS_DEFAULTS = dict(rope_theta=150000.0, max_position_embeddings=131072)


def _gpt_oss_normalize(raw: Raw) -> Raw:
    """HF's defaults; MXFP4 expert weights are dequantized on load (exact in bf16: weights.py),
    so the model runs unquantized and the quantization_config is consumed here."""
    raw = {**GPT_OSS_DEFAULTS, **raw}
    qc = raw.get("quantization_config") or {}
    if qc.get("quant_method") == "mxfp4":
        raw = {k: v for k, v in raw.items() if k != "quantization_config"}
    return raw


def _gpt_oss(raw: Raw, layers: int) -> dict:
    bias = bool(raw.get("attention_bias", True))
    experts = int(required(raw, "num_local_experts"))
    return dict(qkv_bias=bias, o_bias=bias, attn_sinks=True,
                layer_windows=layer_windows(raw, layers, lambda i: i % 2 == 0),
                num_experts=experts, num_experts_per_tok=int(required(raw, "num_experts_per_tok")),
                moe_intermediate_size=int(required(raw, "intermediate_size")),
                moe_layers=(True,) * layers, router_bias=True, topk_then_softmax=True,
                expert_bias=True, swiglu_clamp=(float(raw.get("swiglu_alpha", 1.702)),
                                                float(raw.get("swiglu_limit", 7.0))))


@dataclasses.dataclass(frozen=True)
class MTPLayout:
    """Where a checkpoint keeps its multi-token-prediction module (spec_decode/mtp.py runs it)
    and how the families' modules differ; the defaults are DeepSeek-V3's (vLLM's deepseek_mtp).

    - prefix: the module's tensors' prefix (`{layers}`: num_hidden_layers, the checkpoint layer
      DeepSeek stores it as);
    - own: {checkpoint name under prefix: role}, the roles `enorm`, `hnorm` (the embedding's and
      the target hidden state's norms) and `eh_proj` (the [H, 2 H] projection of their concat);
    - layer: its decoder layer's tensors' prefix under prefix; norm, head: its final norm's and
      LM head's weights under prefix (head None: the target's `lm_head.weight`);
    - masks_position_0: the embedding is zero at position 0 (DeepSeek's, as vLLM masks it);
    - chains_normed: a draft chain's next step reads this step's output after the module's
      final norm (Qwen3-Next's, vLLM's qwen3_next_mtp), else before it (DeepSeek's)."""
    prefix: str = "model.layers.{layers}."
    own: tuple[tuple[str, str], ...] = (("enorm", "enorm"), ("hnorm", "hnorm"),
                                        ("eh_proj", "eh_proj"))
    layer: str = ""
    norm: str = "shared_head.norm.weight"
    head: str | None = "shared_head.head.weight"
    masks_position_0: bool = True
    chains_normed: bool = False


@dataclasses.dataclass(frozen=True)
class Family:
    """What a family declares.

    - fields(raw, num_layers) -> ModelConfig fields (the settings that differ from Llama's);
    - normalize(raw) -> raw: HF's config defaults filled in (and what the family refuses);
    - attention / moe: the flax modules its layers run instead of transformer.py's `Attention`
      and `MoE` (same constructor and call; None: the shared ones);
    - state_layer: the flax module its fixed-state layers run (ModelConfig.layer_states: a
      Mamba-2 mixer, a Gated DeltaNet), constructed (cfg, kernels, dtype, layer=) and called as
      `Attention`; state_layer_name: its name in a layer (HF's module name);
    - tensor_sources(ckpt, name, cfg) -> {param path: Source} for checkpoint tensors stored in a
      layout of its own ({}: skip the tensor; None: the shared loader maps it);
    - rename(name) -> name: its checkpoint names spelled as the shared loader's (weights.hf_name);
    - writable: whether weights.save_safetensors writes its checkpoints in HF's names;
    - mtp: its multi-token-prediction module's layout (`MTPLayout`; DeepSeek's by default)."""
    fields: Callable[[Raw, int], dict]
    normalize: Callable[[Raw], Raw] = _silu_only
    attention: Any = None
    moe: Any = None
    state_layer: Any = None
    state_layer_name: str = "mamba"
    tensor_sources: Callable | None = None
    rename: Callable[[str], str] | None = None
    writable: bool = True
    mtp: MTPLayout = MTPLayout()


FAMILIES: dict[str, Family] = {
    "LlamaForCausalLM": Family(_llama),
    "MistralForCausalLM": Family(_mistral),
    "Qwen2ForCausalLM": Family(_qwen2),
    "Qwen3ForCausalLM": Family(_qwen3),
    "MixtralForCausalLM": Family(_mixtral, _mixtral_normalize),
    "Qwen3MoeForCausalLM": Family(_qwen3_moe),
    "Gemma2ForCausalLM": Family(_gemma2, _gemma_defaults(GEMMA2_DEFAULTS)),
    "Gemma3ForCausalLM": Family(_gemma3, _gemma_defaults(GEMMA3_DEFAULTS)),
    "Gemma3ForConditionalGeneration": Family(_gemma3_multimodal_fields, _gemma3_multimodal,
                                             writable=False),
    "GptOssForCausalLM": Family(_gpt_oss, _gpt_oss_normalize, writable=False),
    "DeepseekV2ForCausalLM": Family(deepseek.deepseek_fields, deepseek.normalize_v2,
                                    writable=False),
    "DeepseekV3ForCausalLM": Family(deepseek.deepseek_fields, deepseek.normalize_v3,
                                    writable=False),
}

# Families in a module of their own: architecture -> the module that declares its `FAMILY`.
MODULES: dict[str, str] = {
    "Glm4MoeForCausalLM": "jaxinfer.model.glm4_moe",
    "Llama4ForCausalLM": "jaxinfer.model.llama4",
    "GraniteMoeHybridForCausalLM": "jaxinfer.model.granitemoehybrid",
    "Qwen3NextForCausalLM": "jaxinfer.model.qwen3_next",
}

SUPPORTED_ARCHITECTURES = (*FAMILIES, *MODULES)


def family(architecture: str) -> Family | None:
    """The family of `architecture` (its module imported on first use), None if unsupported."""
    if architecture in FAMILIES:
        return FAMILIES[architecture]
    if architecture in MODULES:
        return importlib.import_module(MODULES[architecture]).FAMILY
    return None
