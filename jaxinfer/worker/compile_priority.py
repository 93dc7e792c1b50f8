"""Background compiles give way to the steps they run beside: on a CPU of two cores the first
requests of a cold `serve` took 10x their steady time while the rest of the buckets compiled.

The bucket compiler's background XLA compiles run on pool threads at the lowest CPU priority
(`BACKGROUND_NICE`, Linux), and its lowering thread, which needs the GIL the steps need too,
starts no new unit while the engine is stepping (a step within `QUIET_S`), for at most
`MAX_PAUSE_S` per unit, so that a server under constant load still gets its buckets
(`StepPacer`).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

QUIET_S = 0.25
MAX_PAUSE_S = 5.0
BACKGROUND_NICE = 19


class CompileStopped(Exception):
    """The compiler was stopped: submit nothing more."""


def _lowest_priority() -> None:
    """Pool initializer: this thread, and those XLA starts from it, at BACKGROUND_NICE. Linux
    only, where a thread id names one thread (elsewhere PRIO_PROCESS would name a process)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICE)


def background_pool(workers: int) -> ThreadPoolExecutor:
    """A compile pool whose threads, and XLA's started from them, run at BACKGROUND_NICE."""
    return ThreadPoolExecutor(max_workers=workers,
                              thread_name_prefix="jaxinfer-compile-background",
                              initializer=_lowest_priority)


class StepPacer:
    """When the engine last built a step, and the background lowering's wait for a quiet
    moment; `stop` set ends a wait with CompileStopped."""

    def __init__(self, stop: threading.Event):
        self._stop = stop
        self._last_step = 0.0  # time.monotonic() of the engine's last step (`step_seen`)

    def step_seen(self) -> None:
        """The engine is building a step: background lowering waits for a quiet moment."""
        self._last_step = time.monotonic()

    def wait_for_quiet(self) -> None:
        """Wait while the engine steps (one within QUIET_S), for at most MAX_PAUSE_S."""
        give_up = time.monotonic() + MAX_PAUSE_S
        while time.monotonic() - self._last_step < QUIET_S and time.monotonic() < give_up:
            if self._stop.wait(0.05):
                raise CompileStopped
