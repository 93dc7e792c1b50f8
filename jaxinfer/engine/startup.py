"""Where start-up time goes: wall-clock phases of building an engine (config + tokenizer, weights,
KV cache allocation, warm-up) and, inside warm-up, the seconds jax reports for its compilation
stages through `jax.monitoring` (jaxpr tracing, lowering to MLIR, XLA's backend compile, persistent
cache reads). The engine keeps one `StartupTimes` (`LLMEngine.startup`); the server logs it once
ready (`STARTUP_LOG_PREFIX` + JSON) and `jaxinfer bench startup` reads that line.

The jax stages are summed over threads (warm-up compiles on a pool), so they can exceed the
warm-up's wall time.
"""

from __future__ import annotations

import contextlib
import threading
import time

import jax

STARTUP_LOG_PREFIX = "startup phases (s): "

# jax.monitoring event -> our name. backend_compile also fires around a persistent-cache read.
_JAX_EVENTS = {
    "/jax/core/compile/jaxpr_trace_duration": "tracing",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "lowering",
    "/jax/core/compile/backend_compile_duration": "xla_compile",
    "/jax/compilation_cache/cache_retrieval_time_sec": "cache_read",
}

_lock = threading.Lock()
_active: list["StartupTimes"] = []  # timers inside `compiling()`; one process-wide listener feeds them
_listening = False


def _listen(event: str, duration_s: float, **_) -> None:
    name = _JAX_EVENTS.get(event)
    if name is None:
        return
    with _lock:
        for timer in _active:
            timer.compile[name] = timer.compile.get(name, 0.0) + duration_s


class StartupTimes:
    def __init__(self) -> None:
        self.phases: dict[str, float] = {}   # wall seconds per phase, in order
        self.compile: dict[str, float] = {}  # jax compilation stages during `compiling()`
        self.counts: dict[str, float] = {}   # the executable cache's hits and its read/write seconds

    @contextlib.contextmanager
    def phase(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.phases[name] = self.phases.get(name, 0.0) + time.perf_counter() - start

    @contextlib.contextmanager
    def compiling(self):
        """Attribute jax's compilation events to this timer while the block runs."""
        global _listening
        with _lock:
            if not _listening:
                jax.monitoring.register_event_duration_secs_listener(_listen)
                _listening = True
            _active.append(self)
        try:
            yield
        finally:
            with _lock:
                _active.remove(self)

    def as_dict(self) -> dict:
        out = {k: round(v, 3) for k, v in self.phases.items()}
        out.update({f"compile_{k}": round(v, 3) for k, v in self.compile.items()})
        out.update(self.counts)
        return out
