"""Weights: Hugging Face safetensors checkpoints (single or sharded), orbax checkpoints, and random
("dummy") weights of the real shapes, all into the param pytree of `jaxinfer.model.transformer`.

HF stores linear weights as [out, in]; Flax Dense kernels are [in, out], so they are transposed on
load and on save. MoE experts are stacked into [E, in, out] arrays for grouped matmuls; both the
per-expert hub layout (`experts.{e}.w1` / `experts.{e}.gate_proj`) and the fused layout newer
transformers versions write (`experts.gate_up_proj`, `experts.down_proj`) are read; gpt-oss's
experts ([E, in, out] with gate and up interleaved, biases, or MXFP4 blocks dequantized on load:
mxfp4.py) have their own names. Gemma3ForConditionalGeneration checkpoints load their language
model (`language_model.model.*` in hub checkpoints, `model.language_model.*` as transformers 5
writes them); the vision tower and projector are skipped.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path
from typing import Iterator

import jax
import jax.numpy as jnp
import numpy as np
from safetensors.numpy import save_file
from tqdm.auto import tqdm

from jaxinfer.model import families
from jaxinfer.model.config import ModelConfig, not_a_model_dir
from jaxinfer.errors import CheckpointError
from jaxinfer.model.quant import loading as quant_loading
from jaxinfer.model.quant import st_format
from jaxinfer.model.quant.layers import scale_name
from jaxinfer.model.tensor_sources import (EXPERT, EXPERT_PARAM, FUSED, GPT_OSS_EXPERTS, IGNORED,
                                           PACKED, QUANTIZED_DTYPES, Checkpoint, Source,
                                           fused_down, fused_gate_up, interleaved, mxfp4_experts,
                                           plain, stacked_as_stored, stacked_experts, stored)
from jaxinfer.model.transformer import (Params, dummy_leaf_makers, init_params,
                                        param_shapes)

LOAD_FORMATS = ("auto", "safetensors", "orbax", "dummy")
ORBAX_SUBDIR = "orbax"

# Param-path components that are spelled differently in HF tensor names.
_HF_MODULE = {"attn": "self_attn", "input_norm": "input_layernorm",
              "post_attn_norm": "post_attention_layernorm", "pre_ff_norm": "pre_feedforward_layernorm",
              "post_ff_norm": "post_feedforward_layernorm", "kernel": "weight", "embedding": "weight"}
GPT_OSS = "GptOssForCausalLM"
# Gemma3ForConditionalGeneration: the language model's prefixes, and the tensors not loaded.
_MULTIMODAL_PREFIXES = (("language_model.model.", "model."), ("model.language_model.", "model."),
                        ("language_model.lm_head.", "lm_head."))
_LAYER = re.compile(r"model\.layers\.(\d+)\.")
_VISION = re.compile(r"(model\.)?(vision_tower|multi_modal_projector)\..*")
_MIXTRAL_PROJ = {"w_gate": "w1", "w_up": "w3", "w_down": "w2"}
# MoE params stored under their own names (the expert stacks are gathered by pattern).
_MOE_NAMED = ("router", "router_bias", "score_bias", "shared_experts")


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"'{index}' is not a valid safetensors index: {e}") from None
        files = [model_dir / f for f in sorted(set(weight_map.values()))]
    elif (model_dir / "model.safetensors").is_file():
        files = [model_dir / "model.safetensors"]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(
            f"no model.safetensors (or sharded *.safetensors with an index) in '{model_dir}'")
    for f in files:
        if not f.is_file():
            raise CheckpointError(f"'{f}' is listed in the safetensors index but missing")
    return files


def _set(tree: dict, path: tuple[str, ...], value) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def _flat_paths(shapes: Params) -> dict[tuple[str, ...], jax.ShapeDtypeStruct]:
    flat, _ = jax.tree_util.tree_flatten_with_path(shapes)
    return {tuple(k.key for k in p): leaf for p, leaf in flat}


def _moe_prefix(cfg: ModelConfig, layer: str) -> str:
    mlp = "block_sparse_moe" if cfg.architecture == "MixtralForCausalLM" else "mlp"
    return f"model.layers.{layer}.{mlp}"


def hf_name(key: tuple[str, ...], cfg: ModelConfig) -> str:
    """HF tensor name of a (non-expert) param path, e.g. ('layers_0','attn','q_proj','kernel') ->
    'model.layers.0.self_attn.q_proj.weight'."""
    if key == ("embed", "embedding"):
        return "model.embed_tokens.weight"
    if key == ("final_norm", "weight"):
        return "model.norm.weight"
    if key == ("lm_head", "kernel"):
        return "lm_head.weight"
    layer = key[0].removeprefix("layers_")
    if key[1:] == ("moe", "router"):
        router = "router" if cfg.architecture == GPT_OSS else "gate"
        return f"{_moe_prefix(cfg, layer)}.{router}.weight"
    if key[1:] == ("moe", "router_bias"):
        return _moe_prefix(cfg, layer) + ".router.bias"
    if key[1:] == ("moe", "score_bias"):  # DeepSeek-V3
        return _moe_prefix(cfg, layer) + ".gate.e_score_correction_bias"
    if key[1:3] == ("moe", "shared_experts"):  # DeepSeek
        return ".".join([_moe_prefix(cfg, layer), "shared_experts",
                         *(_HF_MODULE.get(k, k) for k in key[3:])])
    return ".".join([f"model.layers.{layer}", *(_HF_MODULE.get(k, k) for k in key[1:])])


def _canonical(name: str) -> str:
    """Mixtral's hub layout says block_sparse_moe where transformers 5's fused layout says mlp;
    FP8 checkpoints with block scales name them weight_scale_inv (a multiplier all the same);
    a multimodal checkpoint's language model is the model."""
    for prefix, plain_prefix in _MULTIMODAL_PREFIXES:
        if name.startswith(prefix):
            name = plain_prefix + name[len(prefix):]
    return name.replace(".block_sparse_moe.", ".mlp.").replace(".weight_scale_inv", ".weight_scale")


def _gpt_oss_experts(ckpt: Checkpoint, name: str, m: re.Match) -> dict[tuple[str, ...], Source]:
    """The params one gpt-oss expert tensor fills (none for `_scales`: read with their blocks)."""
    layer, proj, kind = m.groups()
    key = (f"layers_{layer}", "moe")
    if kind == "_scales":
        return {}
    if kind == "_bias":
        if proj == "down_proj":
            return {(*key, "down_bias"): stored(ckpt, name)}
        src = stored(ckpt, name)
        return {(*key, "gate_bias"): interleaved(src, 0), (*key, "up_bias"): interleaved(src, 1)}
    if kind == "_blocks":
        src = mxfp4_experts(ckpt, name, name.removesuffix("_blocks") + "_scales")
    else:
        src = stored(ckpt, name)
    if proj == "down_proj":
        return {(*key, "w_down"): src}
    return {(*key, "w_gate"): interleaved(src, 0), (*key, "w_up"): interleaved(src, 1)}


def _from_hf(key: tuple[str, ...], arr: np.ndarray) -> np.ndarray:
    """HF stores linear weights [out, in]; Flax kernels (and our router) are [in, out]."""
    return arr.T if key[-1] in ("kernel", "router") else arr


def _sources(ckpt: Checkpoint, cfg: ModelConfig, expected: dict,
             source: Path) -> dict[tuple[str, ...], Source]:
    """Map every checkpoint tensor to the param it fills (headers only; nothing is read yet)."""
    by_name = {_canonical(hf_name(k, cfg)): k for k in expected
               if not (k[1:2] == ("moe",) and k[2] not in _MOE_NAMED)}
    sources: dict[tuple[str, ...], Source] = {}
    experts: dict[tuple[str, ...], dict[int, str]] = {}
    multimodal = cfg.architecture == "Gemma3ForConditionalGeneration"
    family = families.family(cfg.architecture)
    for name in ckpt.names():
        if IGNORED.fullmatch(name) or (multimodal and _VISION.fullmatch(name)):
            continue
        if family.tensor_sources and (own := family.tensor_sources(ckpt, name, cfg)) is not None:
            sources.update(own)
            continue
        if cfg.mla and (m := _LAYER.match(name)) and int(m[1]) >= cfg.num_layers:
            continue  # DeepSeek-V3's multi-token-prediction layer (not loaded: docs/MLA.md)
        if cfg.architecture == GPT_OSS and (m := GPT_OSS_EXPERTS.fullmatch(name)):
            sources.update(_gpt_oss_experts(ckpt, name, m))
            continue
        if m := EXPERT.fullmatch(name):
            layer, e, proj, tensor = m.groups()
            param = EXPERT_PARAM[proj] if tensor == "weight" else scale_name(EXPERT_PARAM[proj])
            experts.setdefault((f"layers_{layer}", "moe", param), {})[int(e)] = name
            continue
        if m := FUSED.fullmatch(name):
            layer, kind = m.groups()
            key = (f"layers_{layer}", "moe")
            if kind == "down_proj":
                sources[(*key, "w_down")] = fused_down(ckpt, name)
            else:
                sources[(*key, "w_gate")] = fused_gate_up(ckpt, name, 0)
                sources[(*key, "w_up")] = fused_gate_up(ckpt, name, 1)
            continue
        # (a family's own spelling renamed as the shared loader spells it)
        key = by_name.get(_canonical(family.rename(name) if family.rename else name))
        if key is None:
            raise CheckpointError(f"'{ckpt.file_of(name).name}': unexpected tensor '{name}' (shape "
                                  f"{list(ckpt.shape(name))}) for a {cfg.architecture} with this "
                                  f"config.json")
        sources[key] = plain(ckpt, name, transpose=key[-1] in ("kernel", "router"))
    for key, by_index in experts.items():
        missing = sorted(set(range(cfg.num_experts)) - set(by_index))
        if missing:
            raise CheckpointError(f"'{source}': {key[0]} is missing experts {missing[:8]} "
                                  f"of {'/'.join(key[1:])}")
        names = [by_index[e] for e in range(cfg.num_experts)]
        sources[key] = (stacked_as_stored(ckpt, names) if key[-1].endswith("_scale")
                        else stacked_experts(ckpt, names))
    return sources


def load_safetensors(model_dir: str | Path, cfg: ModelConfig, dtype=jnp.bfloat16,
                     progress: bool = True, shardings=None,
                     checkpoint: Checkpoint | None = None) -> Params:
    """Each param is made with `jax.make_array_from_callback`: every device (shard of
    `shardings`, a pytree of Shardings like the params; default: the first device) reads only its
    slice of the memory-mapped files. `checkpoint`: read these tensors instead of the
    directory's (a renamed view: spec_decode/mtp.py's MTP module as a one-layer model)."""
    model_dir = Path(model_dir)
    shapes = param_shapes(cfg, dtype)
    expected = _flat_paths(shapes)
    ckpt = checkpoint or Checkpoint(safetensors_files(model_dir))
    sources = _sources(ckpt, cfg, expected, model_dir)
    if cfg.tie_word_embeddings:
        sources.pop(("lm_head", "kernel"), None)  # some tied checkpoints still store a copy
    quantized = quant_loading.quantized_keys(expected)
    scale_keys = set(quantized.values())  # absent when a bf16 checkpoint is quantized on load
    missing = [k for k in expected if k not in sources and k not in scale_keys]
    if missing:
        names = ", ".join("/".join(k) for k in missing[:5])
        raise CheckpointError(f"'{model_dir}': {len(missing)} parameter(s) missing, e.g. {names}")
    for key, src in sources.items():
        want = expected.get(key)
        if want is None:
            raise CheckpointError(f"'{model_dir}': unexpected parameter {'/'.join(key)}")
        if src.dtype == PACKED:
            raise CheckpointError(f"'{model_dir}': parameter {'/'.join(key)} is stored as packed "
                                  f"bytes (U8); only gpt-oss's MXFP4 expert blocks are read so")
        if src.dtype in QUANTIZED_DTYPES and key not in quantized:
            raise CheckpointError(f"'{model_dir}': parameter {'/'.join(key)} is stored as "
                                  f"{src.dtype}, but config.json declares no quantization_config "
                                  f"that covers it")
        if key not in scale_keys and tuple(src.shape) != tuple(want.shape):
            raise CheckpointError(f"'{model_dir}': parameter {'/'.join(key)} has shape "
                                  f"{list(src.shape)}, the config implies {list(want.shape)}")
    flat_shardings = (_flat_paths(shardings) if shardings is not None else {})
    default = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    params: dict = {}
    for key in tqdm(expected, desc="Loading weights", unit="tensor", disable=not progress):
        if key in scale_keys:
            continue
        src = sources[key]
        if key in quantized:  # placed as stored, then made the model's 8-bit form on the device
            raw = jax.make_array_from_callback(
                tuple(src.shape), flat_shardings.get(key, default),
                lambda idx, src=src: np.ascontiguousarray(src.read(idx)))
            scale = sources[quantized[key]].read_all() if quantized[key] in sources else None
            q, s = quant_loading.finalize(
                raw, scale, cfg.quantization, quant_loading.reduce_axis(key),
                (flat_shardings.get(key), flat_shardings.get(quantized[key])))
            _set(params, key, q)
            _set(params, quantized[key], s)
            continue
        # Each param in its declared dtype: the model's, but float32 where the model keeps it
        # so (DeepSeek-V3's score correction bias).
        read = (lambda idx, src=src, t=np.dtype(expected[key].dtype):
                np.ascontiguousarray(src.read(idx), dtype=t))
        _set(params, key, jax.make_array_from_callback(tuple(src.shape),
                                                       flat_shardings.get(key, default), read))
    return params


def _hf_items(params: Params, cfg: ModelConfig) -> Iterator[tuple[str, np.ndarray]]:
    """Params as HF (name, [out, in] array) pairs, MoE experts in the hub's per-expert layout;
    quantized weights' scales as compressed-tensors stores them ([out, 1])."""
    for key, leaf in _flat_paths(params).items():
        arr = np.asarray(jax.device_get(leaf))
        scale = key[-1].endswith("_scale")
        if key[1:2] == ("moe",) and key[2] != "router":
            layer = key[0].removeprefix("layers_")
            stack = key[2].removesuffix("_scale")
            proj = (_MIXTRAL_PROJ[stack] if cfg.architecture == "MixtralForCausalLM"
                    else stack.removeprefix("w_") + "_proj")
            tensor = scale_name("weight") if scale else "weight"
            for e in range(arr.shape[0]):
                yield (f"{_moe_prefix(cfg, layer)}.experts.{e}.{proj}.{tensor}",
                       np.ascontiguousarray(arr[e][:, None] if scale else arr[e].T))
        else:
            yield hf_name(key, cfg), np.ascontiguousarray(arr[:, None] if scale else _from_hf(key, arr))


def save_safetensors(params: Params, cfg: ModelConfig, out_dir: str | Path,
                     filename: str = "model.safetensors") -> Path:
    """Write params under HF tensor names (the hub's per-expert layout for MoE)."""
    if not families.family(cfg.architecture).writable:
        raise CheckpointError(f"writing {cfg.architecture} checkpoints is not supported")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = dict(_hf_items(params, cfg))
    if cfg.quantization:  # 8-bit tensors: the numpy binding of safetensors cannot store them
        st_format.write(tensors, out / filename, metadata={"format": "pt"})
    else:
        save_file(tensors, str(out / filename), metadata={"format": "pt"})
    return out / filename


def save_orbax(params: Params, out_dir: str | Path) -> Path:
    import orbax.checkpoint as ocp

    path = Path(out_dir).resolve() / ORBAX_SUBDIR
    if path.exists():
        shutil.rmtree(path)
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(path, params)
    return path


def load_orbax(model_dir: str | Path, cfg: ModelConfig, dtype=jnp.bfloat16, shardings=None) -> Params:
    """Restore onto `shardings` (a pytree of Shardings like the params; default: the first device):
    orbax reads each device's shards straight into place."""
    import orbax.checkpoint as ocp

    path = Path(model_dir).resolve() / ORBAX_SUBDIR
    if not path.is_dir():
        raise CheckpointError(f"no orbax checkpoint at '{path}'")
    target = param_shapes(cfg, dtype)
    if shardings is not None:
        target = jax.tree_util.tree_map(
            lambda leaf, sh: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sh),
            target, shardings)
    with ocp.StandardCheckpointer() as ckpt:
        try:
            return ckpt.restore(path, target)
        except (ValueError, KeyError) as e:
            raise CheckpointError(f"orbax checkpoint '{path}' does not match the config: {e}") from None


class _MadeWhenTaken(dict):
    """Param path -> the call that makes the leaf; `pop` makes it. quantize_unquantized pops one
    weight at a time and deletes it once quantized, so at most one unquantized weight exists."""

    def pop(self, key):
        return super().pop(key)()


def _quantized_from_unquantized(model_dir, cfg: ModelConfig, dtype, load_format: str, seed: int,
                                shardings) -> Params:
    """Dummy or orbax weights (always unquantized) loaded as such, then quantized on the device
    weight by weight."""
    base_cfg = dataclasses.replace(cfg, quantization=None)
    expected = _flat_paths(param_shapes(cfg, dtype))
    flat_shardings = _flat_paths(shardings) if shardings is not None else {}
    base_shardings = None
    if shardings is not None:
        quantized = quant_loading.quantized_keys(expected)
        base_shardings = {}
        for key, sh in flat_shardings.items():
            if key in quantized.values():
                continue
            base_key = quant_loading.unquantized_key(key, quantized)
            _set(base_shardings, base_key,
                 quant_loading.transposed_sharding(sh, 2) if base_key != key else sh)
    if load_format == "dummy":  # each leaf made as quantize_unquantized takes it
        source = _MadeWhenTaken(dummy_leaf_makers(base_cfg, jax.random.key(seed), dtype,
                                                  shardings=base_shardings))
    else:
        source = _flat_paths(load_orbax(model_dir, base_cfg, dtype, base_shardings))
    flat = quant_loading.quantize_unquantized(source, expected, cfg.quantization, flat_shardings)
    out: dict = {}
    for key, leaf in flat.items():
        _set(out, key, leaf)
    return out


def load_params(model_dir: str | Path | None, cfg: ModelConfig, dtype=jnp.bfloat16,
                load_format: str = "auto", progress: bool = True, seed: int = 0,
                shardings=None) -> Params:
    """Load weights in the given format; `auto` prefers safetensors, then orbax. `shardings`: a
    pytree of Shardings like the params (ShardingPlan.params): every format loads straight into
    those shards."""
    if load_format not in LOAD_FORMATS:
        raise CheckpointError(f"--load-format '{load_format}' is not one of {', '.join(LOAD_FORMATS)}")
    if cfg.quantization and load_format in ("dummy", "orbax"):
        return _quantized_from_unquantized(model_dir, cfg, dtype, load_format, seed, shardings)
    if load_format == "dummy":
        return init_params(cfg, jax.random.key(seed), dtype, shardings=shardings)
    model_dir = Path(model_dir)
    if (problem := not_a_model_dir(model_dir)) is not None:
        raise CheckpointError(problem)
    if load_format == "auto":
        has_orbax = (model_dir / ORBAX_SUBDIR).is_dir()
        has_st = any(model_dir.glob("*.safetensors"))
        load_format = "safetensors" if has_st or not has_orbax else "orbax"
    if load_format == "orbax":
        return load_orbax(model_dir, cfg, dtype, shardings)
    return load_safetensors(model_dir, cfg, dtype, progress, shardings)
