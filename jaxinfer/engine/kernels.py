"""The engine's kernel table: its kernel flags (--attention-backend, --moe-impl, --quant-impl,
--lora-impl) resolved once against the platform (jaxinfer/model/kernel_table.py)."""

from __future__ import annotations

from jaxinfer.model.kernel_table import KernelTable, current_platform, resolve_kernels


def engine_kernels(args) -> KernelTable:
    """The kernel table of an engine built from `args` (EngineArgs), before the KV-cache dtype's
    and tensor parallelism's wrappers (kv_scales.kv_cache_kernels, parallel.kernels)."""
    return resolve_kernels(current_platform(), attention=args.attention_backend,
                           moe=args.moe_impl, quant=args.quant_impl, lora=args.lora_impl,
                           tensor_parallel=args.tensor_parallel_size)
