"""Multi-host runs: joining `jax.distributed` from flags or environment, so one mesh spans the
devices of every process.

Every process runs the same engine: its own scheduler over the same request stream, in the same
order. Scheduling is deterministic (no clocks, no thread timing in its decisions; request seeds come
from `--seed`), so every process builds the same step inputs and runs the same jitted step on
them, which is what SPMD over a mesh spanning processes requires. We replicate the scheduling
rather than broadcast step inputs from process 0 because a step's inputs are a dozen host arrays
built per step and a broadcast would put a blocking cross-host collective on the critical path of
every step, while the request stream changes only when requests arrive; the sampled tokens each
process reads back are replicated, so the processes' host states never diverge. `jaxinfer
generate` and `LLM(...)` therefore run multi-host as they are, with the same prompts on every
process. `jaxinfer serve` runs the same command on every process: process 0 serves HTTP and
publishes its engine's request stream (adds, aborts) step by step through the coordination
service's key-value store; the others bind no port and replay it (frontends/multihost.py).
Buckets compiling in the background would make a step's shape depend on each process's compile
timing, so a multi-process run compiles them all before serving (create_engine), and the KV
cache takes the fewest blocks any process planned (fewest_across_processes).
"""

from __future__ import annotations

import logging
import os

import jax

from jaxinfer.errors import ConfigError
from jaxinfer.parallel.sharding import DEFAULT_EXPERT_LAYOUT, EXPERT_LAYOUTS

log = logging.getLogger(__name__)

ENV = {"coordinator_address": "JAXINFER_COORDINATOR_ADDRESS",
       "num_processes": "JAXINFER_NUM_PROCESSES", "process_id": "JAXINFER_PROCESS_ID"}


def add_parallel_arguments(parser) -> None:
    g = parser.add_argument_group("parallelism")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="devices one model replica is split over (one mesh axis, 'tp')")
    g.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                   help="engine replicas on disjoint device groups behind one front end")
    g.add_argument("--expert-layout", default=DEFAULT_EXPERT_LAYOUT, choices=EXPERT_LAYOUTS,
                   help="how MoE experts split over the tensor-parallel devices: 'ep' whole "
                        "experts per device, 'tp' every expert's intermediate size "
                        "(docs/multi_gpu.md)")
    g.add_argument("--coordinator-address", default=None,
                   help="host:port of process 0 in a multi-process run (jax.distributed; "
                        f"env {ENV['coordinator_address']})")
    g.add_argument("--num-processes", type=int, default=None,
                   help=f"processes in a multi-process run (env {ENV['num_processes']})")
    g.add_argument("--process-id", type=int, default=None,
                   help=f"this process's index, 0 .. num-processes - 1 (env {ENV['process_id']})")


def distributed_settings(args) -> dict | None:
    """coordinator_address / num_processes / process_id from the flags, else the environment;
    None when this is a single-process run."""
    got = {}
    for name, env in ENV.items():
        value = getattr(args, name, None)
        if value is None and os.environ.get(env):
            value = os.environ[env]
        got[name] = value
    if got["coordinator_address"] is None:
        return None
    for name in ("num_processes", "process_id"):
        flag = name.replace("_", "-")
        if got[name] is None:
            raise ConfigError(f"--{flag} is required with --coordinator-address")
        try:
            got[name] = int(got[name])
        except ValueError:
            raise ConfigError(f"--{flag} {got[name]!r}: not an integer") from None
    if got["num_processes"] < 1:
        raise ConfigError(f"--num-processes {got['num_processes']}: must be >= 1")
    if not 0 <= got["process_id"] < got["num_processes"]:
        raise ConfigError(f"--process-id {got['process_id']}: must be in [0, "
                          f"{got['num_processes']})")
    return got


def initialize_distributed(args) -> bool:
    """Join the multi-process run the flags describe (once per process; before any JAX
    computation). On CPU the cross-process collectives go through gloo. Returns whether this is a
    multi-process run."""
    settings = distributed_settings(args)
    if settings is None:
        return False
    if jax.distributed.is_initialized():
        return True
    if os.environ.get("JAX_PLATFORMS", "").startswith("cpu"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(**settings)
    log.info("process %d of %d joined %s: %d devices in all", settings["process_id"],
             settings["num_processes"], settings["coordinator_address"], jax.device_count())
    return True


def fewest_across_processes(n: int) -> int:
    """The smallest of every process's `n` (itself in a single-process run): the KV planner sizes
    the cache from each device's free memory, and every process must schedule over the same
    number of blocks."""
    if jax.process_count() == 1:
        return n
    import numpy as np
    from jax.experimental import multihost_utils
    fewest = int(np.min(multihost_utils.process_allgather(np.int64(n))))
    if fewest != n:
        log.info("KV cache: %d blocks, the fewest any process planned (this one: %d)", fewest, n)
    return fewest
