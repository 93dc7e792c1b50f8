"""The front end the flags ask for."""

from __future__ import annotations

import logging

from jaxinfer.engine.args import EngineArgs
from jaxinfer.engine.llm_engine import LLMEngine
from jaxinfer.frontends.data_parallel import DataParallelEngine
from jaxinfer.frontends.disaggregated import DisaggregatedEngine

log = logging.getLogger(__name__)


def create_engine(args: EngineArgs):
    """The engine the flags ask for: one LLMEngine, DataParallelEngine when --data-parallel-size > 1
    (after joining a multi-process run when its flags are set), or DisaggregatedEngine with
    --disaggregate."""
    import jax

    from jaxinfer.model.config import load_config
    from jaxinfer.parallel.distributed import initialize_distributed
    from jaxinfer.parallel.sharding import validate_parallel_sizes
    from jaxinfer.worker.kv.planner import claim_allocator_share
    claim_allocator_share(args.gpu_memory_utilization)  # before anything starts JAX
    if initialize_distributed(args) and args.background_compile:
        # A step runs in the smallest *compiled* bucket that fits: with buckets compiling in the
        # background that depends on each process's compile timing, and the processes must
        # dispatch the same step shapes. So a multi-process warmup compiles every bucket first.
        log.info("multi-process run: compiling every step bucket before serving "
                 "(--no-background-compile)")
        args.background_compile = False
    if args.disaggregate:
        return DisaggregatedEngine.from_engine_args(args)
    if args.data_parallel_size > 1:
        validate_parallel_sizes(load_config(args.model_path), args.tensor_parallel_size,
                                args.data_parallel_size, jax.device_count(), args.expert_layout)
        return DataParallelEngine.from_engine_args(args)
    return LLMEngine.from_engine_args(args)
