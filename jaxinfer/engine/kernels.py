"""The engine's kernel table: its kernel flags (--attention-backend, --moe-impl, --quant-impl,
--lora-impl) resolved once against the platform (jaxinfer/model/kernel_table.py)."""

from __future__ import annotations

from jaxinfer.engine.config import EngineConfig
from jaxinfer.model.kernel_table import KernelTable, current_platform, resolve_kernels


def engine_kernels(config: EngineConfig) -> KernelTable:
    """The kernel table of an engine of `config`, before the KV-cache dtype's
    and tensor parallelism's wrappers (kv_scales.kv_cache_kernels, parallel.kernels)."""
    kernels = config.compilation
    return resolve_kernels(current_platform(), attention=kernels.attention_backend,
                           moe=kernels.moe_impl, quant=kernels.quant_impl,
                           lora=config.lora.lora_impl,
                           tensor_parallel=config.parallel.tensor_parallel_size)
