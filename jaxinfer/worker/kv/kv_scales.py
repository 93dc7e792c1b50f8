"""Per-layer K and V scales of an fp8 KV cache (`--kv-cache-dtype fp8`, `--kv-cache-scales`).

Where they come from (`--kv-cache-scales`):
- `checkpoint`: the checkpoint's `model.layers.N.self_attn.{k_scale,v_scale}` tensors (or one
  `kv_scale` for both), as vLLM and llm-compressor write them; a missing layer is an error.
- `calibrate`: one dense forward over a fixed calibration text (`calibration_tokens`), taking
  each layer's largest |K| (after the k norm, bounded over every RoPE rotation) and |V|;
  scale = that maximum / the fp8 maximum, rounded up to a power of two (so scaling q and the
  output by it is exact, see `pallas_kernels/attention/kv_quant.py`; e4m3 keeps its 3-bit mantissa over its
  whole normal range, so the up to 2x headroom costs no precision).
- `auto` (default): the checkpoint's tensors when it has them, else `calibrate`.
- a number: that scale for every layer's K and V (1.0: values stored as they are).

A state-space layer (kv_specs.FixedStateSpec) has no K or V: its scales are 1.0 and unused, its
float32 state laid over the fp8 pages as raw bytes (model/state_pages.py).

An MLA latent cache (DeepSeek) has one scale per layer for the whole 576-wide latent ([c, rope
key]; the values are its first columns, so the v scale is the k scale): calibrated over |c| and
the rope key's pair norms; from a checkpoint, its k_scale.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.core.kv_cache.cache_config import SCALE_MODES, check_scales_flag
from jaxinfer.errors import ConfigError
from jaxinfer.model.config import ModelConfig
from jaxinfer.model.kernel_table import KernelTable
from jaxinfer.model.kv_specs import FixedStateSpec
from pallas_kernels.attention.kv_quant import FP8KVAttention, fp8_max, is_fp8

log = logging.getLogger(__name__)

CALIBRATION_TOKENS = 512


def state_layers(cfg: ModelConfig) -> frozenset[int]:
    """The layers that keep no K or V: state-space layers, whose states lie over the cache's
    pages as raw bytes (model/state_pages.py); their scales are 1.0, never read."""
    return frozenset(i for i, spec in enumerate(cfg.layer_kv_specs())
                     if isinstance(spec, FixedStateSpec))


def checkpoint_kv_scales(model_dir: str | Path, num_layers: int,
                         states: frozenset[int] = frozenset()):
    """(k scales, v scales) from the checkpoint's safetensors (1.0 for the layers in `states`),
    or None when it has none."""
    from safetensors import safe_open
    found: dict[str, float] = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), framework="np") as f:
            for name in f.keys():
                if name.endswith(("self_attn.k_scale", "self_attn.v_scale", "self_attn.kv_scale")):
                    found[name] = float(np.asarray(f.get_tensor(name), np.float32).reshape(-1)[0])
    if not found:
        return None

    def scale(i: int, kind: str) -> float:
        for name in (f"model.layers.{i}.self_attn.{kind}_scale",
                     f"model.layers.{i}.self_attn.kv_scale"):
            if name in found:
                return found[name]
        raise ConfigError(f"--kv-cache-scales checkpoint: '{model_dir}' has KV scales but none "
                          f"for layer {i} ({kind}_scale)")

    return (tuple(1.0 if i in states else scale(i, "k") for i in range(num_layers)),
            tuple(1.0 if i in states else scale(i, "v") for i in range(num_layers)))


def calibration_tokens(tokenizer, vocab_size: int, max_tokens: int) -> np.ndarray:
    """Fixed calibration input: the source of a few standard-library modules (code and prose,
    present on every machine), tokenized, BOS first where the tokenizer adds one; without a
    tokenizer, a deterministic spread of token ids."""
    import json.decoder
    import textwrap
    if tokenizer is None:
        return (np.arange(max_tokens, dtype=np.int64) * 7919 % vocab_size).astype(np.int32)
    text = inspect.getsource(textwrap) + inspect.getsource(json.decoder)
    return np.asarray(tokenizer.encode(text)[:max_tokens], np.int32)


def _pow2_scale(amax: float, dtype) -> float:
    if not amax > 0:
        return 1.0
    return float(2.0 ** math.ceil(math.log2(amax / fp8_max(dtype))))


def rope_key_amax(x: jax.Array, rotary_dim: int) -> jax.Array:
    """The largest |value| a rotate-half RoPE key can take at any position: over its first
    `rotary_dim` dims the largest (x_j, x_j+rotary_dim/2) pair norm, which any rotation keeps;
    past them (partial rotary) the values as they are."""
    x = x.astype(jnp.float32)
    half = rotary_dim // 2
    amax = jnp.sqrt(x[..., :half] ** 2 + x[..., half:2 * half] ** 2).max(initial=0.0)
    return jnp.maximum(amax, jnp.abs(x[..., 2 * half:]).max(initial=0.0))


def _latent_amax(c: jax.Array, k_pe: jax.Array) -> jax.Array:
    """An MLA latent's largest |value| at any position: |c| and the rope key's pair norms."""
    return jnp.maximum(jnp.abs(c.astype(jnp.float32)).max(), rope_key_amax(k_pe, k_pe.shape[-1]))


def calibrate_kv_scales(cfg: ModelConfig, params, tokens: np.ndarray, dtype=jnp.float8_e4m3fn):
    """(k scales, v scales): per layer, the K and V maxima of one dense forward over `tokens`
    (see the module docstring)."""
    from jaxinfer.model.transformer import Transformer

    def maxima(params, tokens):
        model = Transformer(cfg, dtype=params["embed"]["embedding"].dtype)
        positions = jnp.arange(tokens.shape[1])[None]
        _, state = model.apply({"params": params}, tokens, positions, mutable=["intermediates"])
        out = []
        for i, spec in enumerate(cfg.layer_kv_specs()):
            if isinstance(spec, FixedStateSpec):
                out.append((0.0, 0.0))  # no K or V: scale 1.0
                continue
            attn = state["intermediates"][f"layers_{i}"]["attn"]  # Attention sows k and v
            if spec.values_in_keys:  # MLAttention sows c and the rope key: K and V at once
                amax = _latent_amax(attn["c"][0], attn["k_pe"][0])
                out.append((amax, amax))
                continue
            k_amax = rope_key_amax(attn["k"][0], cfg.rope_head_dim)
            v_amax = jnp.abs(attn["v"][0].astype(jnp.float32)).max()
            out.append((k_amax, v_amax))
        return out

    amax = jax.device_get(jax.jit(maxima)(params, jnp.asarray(tokens)[None]))
    return (tuple(_pow2_scale(float(k), dtype) for k, _ in amax),
            tuple(_pow2_scale(float(v), dtype) for _, v in amax))


def resolve_kv_scales(mode: str, cfg: ModelConfig, params, *, model_dir: str | None,
                      tokenizer=None, kv_dtype=jnp.float8_e4m3fn):
    """(k scales, v scales, where they came from) for `--kv-cache-scales mode`."""
    check_scales_flag(mode)
    if mode not in SCALE_MODES:
        unit = (float(mode),) * cfg.num_layers
        return unit, unit, f"--kv-cache-scales {mode}"
    if mode in ("auto", "checkpoint"):
        given = (checkpoint_kv_scales(model_dir, cfg.num_layers, state_layers(cfg))
                 if model_dir else None)
        if given is not None:
            return *given, "checkpoint"
        if mode == "checkpoint":
            raise ConfigError(f"--kv-cache-scales checkpoint: '{model_dir}' has no k_scale / "
                              f"v_scale / kv_scale tensors (use calibrate or a number)")
    n = min(CALIBRATION_TOKENS, cfg.max_position_embeddings)
    k, v = calibrate_kv_scales(cfg, params, calibration_tokens(tokenizer, cfg.vocab_size, n),
                               kv_dtype)
    return k, v, "calibrated"


def kv_cache_kernels(kernels: KernelTable, kv_dtype, cfg: ModelConfig, params=None, *,
                     scales: str = "auto", model_dir: str | None = None,
                     tokenizer=None) -> KernelTable:
    """The kernel table the model runs with this cache dtype: `kernels` itself for 16/32-bit
    caches; for fp8 its attention slot in the `FP8KVAttention` wrapper with the scales of
    `scales` (params None: unit scales, e.g. to measure a step's activations), every other slot
    as it is."""
    if not is_fp8(kv_dtype):
        if scales != "auto":
            raise ConfigError(f"--kv-cache-scales {scales} needs an fp8 --kv-cache-dtype "
                              f"(the cache is {jnp.dtype(kv_dtype).name})")
        return kernels
    if params is None:
        unit = (1.0,) * cfg.num_layers
        return dataclasses.replace(kernels, attention=FP8KVAttention(kernels.attention, unit, unit))
    k, v, source = resolve_kv_scales(scales, cfg, params, model_dir=model_dir,
                                     tokenizer=tokenizer, kv_dtype=kv_dtype)
    specs = cfg.layer_kv_specs()
    # A layer whose values are read out of its keys (the MLA latent): one scale, the k scale.
    v = tuple(k_i if getattr(spec, "values_in_keys", False) else v_i
              for k_i, v_i, spec in zip(k, v, specs))
    log.info("fp8 KV cache scales (%s): k %s, v %s", source, k, v)
    return dataclasses.replace(kernels, attention=FP8KVAttention(kernels.attention, k, v))
