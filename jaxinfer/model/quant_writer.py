"""A quantized checkpoint in the Hugging Face layout (`jaxinfer convert --quantization`): the
tensors of compressed-tensors (`<linear>.weight` 8-bit [out, in], `<linear>.weight_scale` float32
[out, 1]) and the `quantization_config` llm-compressor writes for the same scheme (FP8: channel-wise
weights, dynamic per-token activations; int8: channel-wise weights only), so vLLM and transformers
read it as well as jaxinfer."""

from __future__ import annotations

import json
from pathlib import Path

from jaxinfer.model.config import ModelConfig


def quantization_config(mode: str) -> dict:
    weights = {"num_bits": 8, "type": "float" if mode == "fp8" else "int", "strategy": "channel",
               "symmetric": True, "dynamic": False}
    activations = ({"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True,
                    "dynamic": True} if mode == "fp8" else None)
    return {"quant_method": "compressed-tensors",
            "format": "float-quantized" if mode == "fp8" else "int-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": activations}},
            # Not quantized: the embedding and LM head, and MoE routers.
            "ignore": ["lm_head", "re:.*mlp.gate$", "re:.*block_sparse_moe.gate$"]}


def write_quantized(params, cfg: ModelConfig, src_dir: Path, out_dir: Path) -> Path:
    """The quantized params and src_dir's config.json with the quantization_config added."""
    from jaxinfer.model.weights import save_safetensors

    path = save_safetensors(params, cfg, out_dir)
    raw = json.loads((Path(src_dir) / "config.json").read_text())
    raw["quantization_config"] = quantization_config(cfg.quantization)
    (Path(out_dir) / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    return path
