"""Flash-prefill kernel configurations named on a tool's command line: "default" is the entry
point's production configuration (`flash_config.KernelConfig()`); anything else is a list of
field overrides on it, e.g. "stages=3:block_kv=192" (values parsed as Python literals)."""

from __future__ import annotations

import ast
import dataclasses

from pallas_kernels.attention.flash_config import KernelConfig


def prefill_config(spec: str) -> KernelConfig:
    if spec == "default":
        return KernelConfig()
    fields = {}
    for item in spec.split(":"):
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"{item!r} in {spec!r}: expected field=value")
        fields[key] = ast.literal_eval(value)
    return dataclasses.replace(KernelConfig(), **fields)
