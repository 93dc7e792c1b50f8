"""The engine `jaxinfer serve` runs on: the engine core in processes of its own (core_client.py,
the default; one per data-parallel replica) or in the server process (async_engine.py:
`--engine-core in-process`, for debugging and comparison, and what the front ends the core process
does not run yet take: disaggregated prefill/decode, multi-process runs)."""

from __future__ import annotations

import logging

from jaxinfer.engine.args import EngineArgs

log = logging.getLogger(__name__)

ENGINE_CORE_MODES = ("process", "in-process")


def in_process_reason(args: EngineArgs) -> str | None:
    """Why these flags keep the engine core in the server process, or None."""
    from jaxinfer.parallel.distributed import distributed_settings
    if args.disaggregate:
        return "--disaggregate"
    if distributed_settings(args) is not None:
        return "a multi-process run (its leader replays the engine calls in-process)"
    return None


def create_server_engine(args: EngineArgs, engine_core: str = "process"):
    """A CoreProcessEngine, or an AsyncEngine for `in-process` and for the flags that need one."""
    from jaxinfer.frontends.async_engine import AsyncEngine
    if engine_core not in ENGINE_CORE_MODES:
        raise ValueError(f"--engine-core must be one of {ENGINE_CORE_MODES}, got {engine_core!r}")
    if engine_core == "process":
        reason = in_process_reason(args)
        if reason is None:
            from jaxinfer.frontends.core_client import CoreProcessEngine
            return CoreProcessEngine(args)
        log.warning("the engine core runs in the server process: %s", reason)
    return AsyncEngine(args)
