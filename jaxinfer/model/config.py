"""Model configuration parsed from a Hugging Face `config.json`.

One transformer serves every supported family: the differences between Llama, Mistral, Qwen2,
Qwen3, Mixtral and Qwen3-MoE are fields of `ModelConfig` (biases, q/k norm, tied embeddings,
MoE shape), never separate model code. Anything the model does not implement is refused here,
with the field and value in the message, rather than silently computing something else.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from pathlib import Path
from typing import Any

from jaxinfer.errors import ConfigError
from jaxinfer.model.quant_scheme import checkpoint_quantization

log = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "MixtralForCausalLM",
    "Qwen3MoeForCausalLM",
)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    # llama3 only
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


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
    # Kernel dispatch, from the engine's --moe-impl / --quant-impl ("auto": chosen per call shape
    # and device): `moe_experts`' implementation (pallas_kernels/moe/grouped_matmul.py) and
    # `quantized_matmul`'s (model/quant/ops.py). Part of the config, so of every compile cache key.
    moe_impl: str = "auto"
    quant_impl: str = "auto"

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    def layer_is_moe(self, layer: int) -> bool:
        return bool(self.moe_layers) and self.moe_layers[layer]

    def num_params(self) -> int:
        """Parameter count (embeddings counted once when tied)."""
        h, d = self.hidden_size, self.head_dim
        attn = h * d * (self.num_heads * 2 + self.num_kv_heads * 2)
        attn += (d * (self.num_heads + 2 * self.num_kv_heads) if self.qkv_bias else 0)
        attn += 2 * d if self.qk_norm else 0
        total = 0
        for layer in range(self.num_layers):
            if self.layer_is_moe(layer):
                mlp = self.num_experts * 3 * h * self.moe_intermediate_size + h * self.num_experts
            else:
                mlp = 3 * h * self.intermediate_size
            total += attn + mlp + 2 * h
        emb = self.vocab_size * h
        return total + h + emb * (1 if self.tie_word_embeddings else 2)


def _get(raw: dict[str, Any], key: str, default: Any = ConfigError) -> Any:
    if key in raw and raw[key] is not None:
        return raw[key]
    if default is ConfigError:
        raise ConfigError(f"config.json: required field '{key}' is missing")
    return default


def _parse_rope(raw: dict[str, Any]) -> RopeConfig:
    # transformers >= 5 writes `rope_parameters`; older configs write rope_theta + rope_scaling.
    params = dict(raw.get("rope_parameters") or {})
    scaling = dict(raw.get("rope_scaling") or {})
    merged = {**scaling, **params}
    theta = float(merged.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = merged.get("rope_type", merged.get("type", "default")) or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(
            f"config.json: rope_scaling.rope_type '{rope_type}' is not supported "
            f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    if rope_type == "default":
        return RopeConfig(theta=theta)
    factor = float(merged.get("factor", 1.0))
    if rope_type == "linear":
        return RopeConfig(theta=theta, rope_type="linear", factor=factor)
    return RopeConfig(
        theta=theta,
        rope_type="llama3",
        factor=factor,
        low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
        high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(merged.get("original_max_position_embeddings", 8192)),
    )


def _refuse_sliding_window(raw: dict[str, Any], arch: str, max_pos: int) -> int:
    """Sliding-window attention is not implemented. A window at least as long as the context changes
    nothing, so such configs load with the context capped at the window (as vLLM does)."""
    window = raw.get("sliding_window")
    if arch.startswith("Qwen") and not raw.get("use_sliding_window", False):
        return max_pos
    if window is None or window >= max_pos:
        return max_pos
    log.warning(
        "config.json: sliding_window=%d < max_position_embeddings=%d; sliding-window attention is "
        "not implemented, so the context is capped at %d tokens", window, max_pos, window
    )
    return int(window)


def config_from_dict(raw: dict[str, Any]) -> ModelConfig:
    archs = raw.get("architectures") or []
    if not archs:
        raise ConfigError("config.json: field 'architectures' is missing or empty")
    arch = archs[0]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ConfigError(
            f"config.json: architectures '{arch}' is not supported "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    act = raw.get("hidden_act", raw.get("hidden_activation", "silu"))
    if act != "silu":
        raise ConfigError(f"config.json: hidden_act '{act}' is not supported (only 'silu')")

    hidden = int(_get(raw, "hidden_size"))
    heads = int(_get(raw, "num_attention_heads"))
    kv_heads = int(_get(raw, "num_key_value_heads", heads))
    if heads % kv_heads:
        raise ConfigError(
            f"config.json: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}"
        )
    head_dim = int(raw.get("head_dim") or hidden // heads)
    layers = int(_get(raw, "num_hidden_layers"))
    max_pos = int(_get(raw, "max_position_embeddings", 4096))
    max_pos = _refuse_sliding_window(raw, arch, max_pos)

    family = {
        "LlamaForCausalLM": dict(qkv_bias=bool(raw.get("attention_bias", False)),
                                 o_bias=bool(raw.get("attention_bias", False)),
                                 mlp_bias=bool(raw.get("mlp_bias", False))),
        "MistralForCausalLM": {},
        "Qwen2ForCausalLM": dict(qkv_bias=True),
        "Qwen3ForCausalLM": dict(qk_norm=True, qkv_bias=bool(raw.get("attention_bias", False)),
                                 o_bias=bool(raw.get("attention_bias", False))),
        "MixtralForCausalLM": {},
        "Qwen3MoeForCausalLM": dict(qk_norm=True, qkv_bias=bool(raw.get("attention_bias", False)),
                                    o_bias=bool(raw.get("attention_bias", False))),
    }[arch]

    moe: dict[str, Any] = {}
    if arch == "MixtralForCausalLM":
        experts = int(_get(raw, "num_local_experts"))
        moe = dict(num_experts=experts, num_experts_per_tok=int(_get(raw, "num_experts_per_tok")),
                   moe_intermediate_size=int(_get(raw, "intermediate_size")), norm_topk_prob=True,
                   moe_layers=(True,) * layers)
    elif arch == "Qwen3MoeForCausalLM":
        # Hub configs say num_experts; transformers 5 writes num_local_experts (its attribute_map).
        experts = int(raw.get("num_experts") or _get(raw, "num_local_experts"))
        step = int(raw.get("decoder_sparse_step", 1) or 1)
        dense_only = set(raw.get("mlp_only_layers") or [])
        moe = dict(num_experts=experts, num_experts_per_tok=int(_get(raw, "num_experts_per_tok")),
                   moe_intermediate_size=int(_get(raw, "moe_intermediate_size")),
                   norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
                   moe_layers=tuple(i not in dense_only and experts > 0 and (i + 1) % step == 0
                                    for i in range(layers)))
    if moe and moe["num_experts_per_tok"] > moe["num_experts"]:
        raise ConfigError(f"config.json: num_experts_per_tok={moe['num_experts_per_tok']} exceeds "
                          f"the number of experts {moe['num_experts']}")

    eos = raw.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    dtype = str(raw.get("torch_dtype", raw.get("dtype", "bfloat16")) or "bfloat16")

    return ModelConfig(
        architecture=arch,
        vocab_size=int(_get(raw, "vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(_get(raw, "intermediate_size")),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope=_parse_rope(raw),
        max_position_embeddings=max_pos,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=eos_ids,
        dtype=dtype,
        quantization=checkpoint_quantization(raw),
        **family,
        **moe,
    )


def load_config(model_dir: str | Path) -> ModelConfig:
    path = Path(model_dir) / "config.json"
    if not Path(model_dir).is_dir():
        raise ConfigError(f"model directory '{model_dir}' does not exist")
    if not path.is_file():
        raise ConfigError(f"'{path}' not found: a model directory needs a config.json")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"'{path}' is not valid JSON: {e}") from None
    return config_from_dict(raw)


def rope_inv_freq(cfg: ModelConfig) -> list[float]:
    """Inverse frequencies for RoPE, with HF's scaling rules (computed once on the host)."""
    d = cfg.head_dim
    inv = [1.0 / (cfg.rope.theta ** (i / d)) for i in range(0, d, 2)]
    r = cfg.rope
    if r.rope_type == "linear":
        return [f / r.factor for f in inv]
    if r.rope_type == "llama3":
        low_wavelen = r.original_max_position_embeddings / r.low_freq_factor
        high_wavelen = r.original_max_position_embeddings / r.high_freq_factor
        out = []
        for f in inv:
            wavelen = 2 * math.pi / f
            if wavelen < high_wavelen:
                out.append(f)
            elif wavelen > low_wavelen:
                out.append(f / r.factor)
            else:
                smooth = (r.original_max_position_embeddings / wavelen - r.low_freq_factor) / (
                    r.high_freq_factor - r.low_freq_factor)
                out.append((1 - smooth) * f / r.factor + smooth * f)
        return out
    return inv
