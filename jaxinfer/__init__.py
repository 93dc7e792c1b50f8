"""jaxinfer: an LLM inference engine in JAX with Pallas GPU kernels.

The offline API in one import: `from jaxinfer import LLM, SamplingParams`.
"""
from jaxinfer.frontends.async_engine import AsyncEngine
from jaxinfer.frontends.llm import LLM
from jaxinfer.engine.llm_engine import LLMEngine
from jaxinfer.core.outputs import CompletionOutput, RequestOutput
from jaxinfer.lora_request import LoRARequest
from jaxinfer.sampling_params import SamplingParams
from jaxinfer.structured import GuidedDecodingParams, StructuredOutputsParams

__all__ = ["LLM", "LLMEngine", "AsyncEngine", "SamplingParams", "LoRARequest", "StructuredOutputsParams",
           "GuidedDecodingParams", "RequestOutput", "CompletionOutput"]
