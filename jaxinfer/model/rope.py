"""Rotary position embeddings: the `rope_scaling` / `rope_parameters` of a config.json, and the
inverse frequencies (with HF's scaling rules) computed once on the host.

A model has one `RopeConfig`, or two when its windowed layers rotate with their own base (Gemma 3:
`rope_local_base_freq`, or transformers 5's per-layer-type `rope_parameters`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from jaxinfer.errors import ConfigError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    # llama3 and yarn (parse_rope always sets it; 8192 is Llama 3.1's)
    original_max_position_embeddings: int = 8192
    # llama3 only
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    # yarn only (gpt-oss): the ramp between interpolated and extrapolated frequencies, and the
    # factor cos/sin are multiplied by
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float = 1.0


def parse_rope(raw: dict[str, Any], params: dict[str, Any] | None = None,
               theta_default: float = 10000.0) -> RopeConfig:
    """The rope of a config.json, read as transformers' modeling_rope_utils reads it.

    `raw` is the whole config. Without `params` the rope is the config's one: transformers >= 5
    writes `rope_parameters`, older configs rope_theta + rope_scaling (which, when both are there,
    replaces rope_parameters, as in HF). `params` is instead one layer type's entry of a
    per-layer-type rope (Gemma 3), whose missing rope_theta is `theta_default`."""
    per_layer_type = params is not None
    if params is None:
        params = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
        theta = params.get("rope_theta", raw.get("rope_theta", theta_default))
    else:
        theta = params.get("rope_theta", theta_default)
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(
            f"config.json: rope_scaling.rope_type '{rope_type}' is not supported "
            f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    theta = float(theta)
    if rope_type == "default":
        return RopeConfig(theta=theta)
    # HF's scaled ropes turn only the first partial_rotary_factor of each head (its default rope,
    # in these families' models, ignores the field).
    partial = params.get("partial_rotary_factor", raw.get("partial_rotary_factor"))
    if partial is not None and float(partial) != 1.0:
        raise ConfigError(f"config.json: partial_rotary_factor={partial} is not supported "
                          f"(rope over the whole head only)")
    if rope_type == "linear":
        return RopeConfig(theta=theta, rope_type="linear", factor=_factor(params, rope_type))
    original = _original_max_positions(raw, params, per_layer_type)
    if rope_type == "llama3":
        return RopeConfig(
            theta=theta, rope_type="llama3", factor=_factor(params, rope_type),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=original)
    factor = params.get("factor")
    if factor is None:  # HF (for DeepSeek-V3): the ratio of the context lengths
        factor = _max_positions(raw, rope_type) / original
    factor = float(factor)
    attention = params.get("attention_factor")
    if attention is None:  # the paper's suggestion, as HF computes it (DeepSeek: a ratio)
        mscale, all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and all_dim:
            attention = _mscale(factor, float(mscale)) / _mscale(factor, float(all_dim))
        else:
            attention = _mscale(factor)
    # HF reads `truncate` from the config's top-level rope dict, which for a per-layer-type rope
    # holds only the layer types: there it is always the default, True.
    truncate = True if per_layer_type else bool(params.get("truncate", True))
    return RopeConfig(theta=theta, rope_type="yarn", factor=factor,
                      original_max_position_embeddings=original,
                      beta_fast=float(params.get("beta_fast") or 32.0),
                      beta_slow=float(params.get("beta_slow") or 1.0),
                      truncate=truncate, attention_factor=float(attention))


def partial_rotary_dim(raw: dict[str, Any]) -> int:
    """HF's default rope turns int(head_dim * partial_rotary_factor) dims (transformers 5 keeps
    the factor in rope_parameters, older configs at the top level)."""
    head_dim = int(raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"])
    params = raw.get("rope_parameters") or {}
    factor = float(params.get("partial_rotary_factor", raw["partial_rotary_factor"]))
    dim = int(head_dim * factor)
    if not 0 < dim <= head_dim or dim % 2:
        raise ConfigError(f"config.json: partial_rotary_factor={factor} turns {dim} of "
                          f"head_dim={head_dim} dims; an even number in 2..head_dim is needed")
    return dim


def _factor(params: dict[str, Any], rope_type: str) -> float:
    if params.get("factor") is None:
        raise ConfigError(f"config.json: rope_scaling.factor is required for rope_type "
                          f"'{rope_type}'")
    return float(params["factor"])


def _max_positions(raw: dict[str, Any], rope_type: str) -> int:
    if raw.get("max_position_embeddings") is None:
        raise ConfigError(f"config.json: max_position_embeddings is required for rope_type "
                          f"'{rope_type}' without rope_scaling.original_max_position_embeddings "
                          f"or factor")
    return int(raw["max_position_embeddings"])


def _original_max_positions(raw: dict[str, Any], params: dict[str, Any],
                            per_layer_type: bool) -> int:
    """The pretraining context of llama3 / YaRN scaling, with HF's fallbacks: a top-level
    `original_max_position_embeddings` (Phi-3's spelling) wins over the rope dict's in a
    one-rope config; without either, it is `max_position_embeddings`."""
    top = None if per_layer_type else raw.get("original_max_position_embeddings")
    value = top if top is not None else params.get("original_max_position_embeddings")
    if value is None:
        return _max_positions(raw, params.get("rope_type", params.get("type")))
    return int(value)


def _mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn(r: RopeConfig, inv: list[float], d: int) -> list[float]:
    def correction_dim(rotations: float) -> float:
        return (d * math.log(r.original_max_position_embeddings / (rotations * 2 * math.pi))
                / (2 * math.log(r.theta)))

    low, high = correction_dim(r.beta_fast), correction_dim(r.beta_slow)
    if r.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001  # HF's guard against a zero-width ramp
    out = []
    for i, f in enumerate(inv):
        extrapolation = 1 - min(max((i - low) / (high - low), 0.0), 1.0)
        out.append(f / r.factor * (1 - extrapolation) + f * extrapolation)
    return out


def rope_inv_freq(r: RopeConfig, head_dim: int) -> list[float]:
    """Inverse frequencies [head_dim / 2] with HF's scaling rules."""
    d = head_dim
    inv = [1.0 / (r.theta ** (i / d)) for i in range(0, d, 2)]
    if r.rope_type == "linear":
        return [f / r.factor for f in inv]
    if r.rope_type == "yarn":
        return _yarn(r, inv, d)
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
