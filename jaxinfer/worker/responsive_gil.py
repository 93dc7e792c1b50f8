"""A shorter GIL switch interval while background compiles trace, so the step loop keeps its
turns (its host work needs the GIL a few times per step)."""

from __future__ import annotations

import contextlib
import sys
import threading

_SWITCH_INTERVAL_S = 0.0005
_switch_lock = threading.Lock()
_switch_users = [0, 0.0]  # background compiles running, the interval before the first


@contextlib.contextmanager
def responsive_gil():
    """While a background compile traces (pure Python, holding the GIL for long stretches), hand
    the GIL over every 0.5 ms instead of Python's 5: the step loop needs it a few times per step.
    (On the H200, batch-1 decode took 78 ms per token while buckets compiled, 4.6 ms after.)"""
    with _switch_lock:
        if not _switch_users[0]:
            _switch_users[1] = sys.getswitchinterval()
            sys.setswitchinterval(min(_switch_users[1], _SWITCH_INTERVAL_S))
        _switch_users[0] += 1
    try:
        yield
    finally:
        with _switch_lock:
            _switch_users[0] -= 1
            if not _switch_users[0]:
                sys.setswitchinterval(_switch_users[1])
