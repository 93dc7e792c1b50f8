"""Which weight quantization a model runs: the checkpoint's `quantization_config` and the
`--quantization` flag.

Read from config.json:

- `quant_method: fp8` (transformers' FP8 configs): e4m3 weights with a per-tensor `weight_scale`
  or 2-D block scales (`weight_block_size`, tensors `weight_scale_inv`);
- `quant_method: fbgemm_fp8`: e4m3 weights with per-channel `weight_scale` [out, 1];
- `quant_method: compressed-tensors` with 8-bit `float` weights (FP8; tensor, channel or block
  strategy) or 8-bit `int` weights without activation quantization (W8A16).

Static activation scales (`input_scale`) are not used: activations are scaled per token at run time,
which is never coarser. Other methods (AWQ, GPTQ, 4-bit, ...) are refused.
"""

from __future__ import annotations

from typing import Any

from jaxinfer.errors import ConfigError

QUANTIZATIONS = ("fp8", "int8")


def _refuse(why: str) -> ConfigError:
    return ConfigError(f"config.json quantization_config: {why} (supported: quant_method 'fp8', "
                       f"'fbgemm_fp8', or 'compressed-tensors' with 8-bit float or 8-bit int weights)")


def _compressed_tensors(qc: dict[str, Any]) -> str:
    groups = qc.get("config_groups") or {}
    kinds = set()
    for group in groups.values():
        w = group.get("weights") or {}
        bits, kind = w.get("num_bits"), w.get("type")
        if bits != 8 or kind not in ("float", "int"):
            raise _refuse(f"compressed-tensors weights of {bits} bits, type {kind!r}")
        if kind == "int" and group.get("input_activations"):
            raise _refuse("compressed-tensors int8 weights with quantized activations (W8A8 int8)")
        kinds.add("fp8" if kind == "float" else "int8")
    if len(kinds) != 1:
        raise _refuse(f"compressed-tensors config_groups with weight types {sorted(kinds)}")
    return kinds.pop()


def checkpoint_quantization(raw: dict[str, Any]) -> str | None:
    """The weight quantization config.json declares (one of QUANTIZATIONS), or None."""
    qc = raw.get("quantization_config") or raw.get("compression_config")
    if not qc:
        return None
    method = qc.get("quant_method")
    if method in ("fp8", "fbgemm_fp8"):
        return "fp8"
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    raise _refuse(f"quant_method {method!r}")


def resolve_quantization(flag: str | None, checkpoint: str | None, load_format: str) -> str | None:
    """The quantization to run: the checkpoint's, or --quantization for a checkpoint without one
    (quantized on load). Refuses a flag that contradicts the checkpoint, naming the flag."""
    if flag is not None and flag not in QUANTIZATIONS:
        raise ConfigError(f"--quantization {flag!r}: choose from {', '.join(QUANTIZATIONS)}")
    if checkpoint and flag and flag != checkpoint and load_format != "dummy":
        raise ConfigError(f"--quantization {flag}: the checkpoint is already {checkpoint}-quantized "
                          f"(config.json quantization_config); drop the flag or pass "
                          f"--quantization {checkpoint}")
    return flag or checkpoint
