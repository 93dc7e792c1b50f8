"""jaxinfer: an LLM inference engine in JAX with Pallas GPU kernels.

The offline API in one import: `from jaxinfer import LLM, SamplingParams`.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# Imported on first use (PEP 562): every submodule, the `jaxinfer` command's included, imports this
# package first, and the command must take Ctrl-C (and print --help) before jax loads.
_SOURCES = {
    "AsyncEngine": "jaxinfer.frontends.async_engine",
    "LLM": "jaxinfer.frontends.llm",
    "LLMEngine": "jaxinfer.engine.llm_engine",
    "CompletionOutput": "jaxinfer.core.outputs",
    "RequestOutput": "jaxinfer.core.outputs",
    "LoRARequest": "jaxinfer.lora_request",
    "SamplingParams": "jaxinfer.sampling_params",
    "GuidedDecodingParams": "jaxinfer.structured",
    "StructuredOutputsParams": "jaxinfer.structured",
}
__all__ = ["LLM", "LLMEngine", "AsyncEngine", "SamplingParams", "LoRARequest", "StructuredOutputsParams",
           "GuidedDecodingParams", "RequestOutput", "CompletionOutput"]

if TYPE_CHECKING:
    from jaxinfer.frontends.async_engine import AsyncEngine
    from jaxinfer.frontends.llm import LLM
    from jaxinfer.engine.llm_engine import LLMEngine
    from jaxinfer.core.outputs import CompletionOutput, RequestOutput
    from jaxinfer.lora_request import LoRARequest
    from jaxinfer.sampling_params import SamplingParams
    from jaxinfer.structured import GuidedDecodingParams, StructuredOutputsParams


def __getattr__(name: str):
    if name not in _SOURCES:
        raise AttributeError(f"module 'jaxinfer' has no attribute {name!r}")
    value = getattr(importlib.import_module(_SOURCES[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
