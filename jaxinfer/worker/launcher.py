"""Dispatching the runner's steps from a thread of their own (`--async-launch`).

Dispatching a step costs the host milliseconds on a GPU: jax's handling of a few hundred arguments,
then XLA launching the step's kernels (with the GIL released). On the engine's thread that time adds
to the scheduling, input building and output processing that must all fit in one step's device time.
With a launcher, the engine's thread builds step N+1's arrays and hands the dispatch over, then
processes step N's tokens while this thread dispatches N+1.

One thread runs the dispatches in submission order, so the KV cache and last-token array are donated
and replaced in the same order as without it. Other threads read that device state only once the
queued dispatches have run (`drain`; `ModelRunner`'s `kv_cache` and `last_tokens` properties do it).
While a launcher is open the interpreter hands the GIL over every 0.5 ms instead of 5, so a finished
launch need not wait long for the engine's Python to let it return.
"""

from __future__ import annotations

import concurrent.futures
import queue
import sys
import threading
import weakref
from concurrent.futures import Future
from typing import Any, Callable

_SWITCH_INTERVAL_S = 0.0005


class StepLauncher:
    def __init__(self, name: str = "jaxinfer-launch"):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._last: Future | None = None
        self._interval = sys.getswitchinterval()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        ref = weakref.ref(self)
        # Before the interpreter's exit joins threads: nothing is left half dispatched.
        register = getattr(threading, "_register_atexit", None)
        if register is not None:
            register(lambda: (launcher := ref()) is not None and launcher.close())

    def submit(self, fn: Callable[[], Any]) -> Future:
        """Run `fn` on the launcher thread after everything submitted before it."""
        if self._closed:
            raise RuntimeError("the step launcher is closed")
        if sys.getswitchinterval() > _SWITCH_INTERVAL_S:  # (a compile may have restored it)
            sys.setswitchinterval(_SWITCH_INTERVAL_S)
        future: Future = Future()
        self._last = future
        self._queue.put((fn, future))
        return future

    def on_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def drain(self) -> None:
        """Wait until everything submitted has run (a failure stays with its own future)."""
        last = self._last
        if last is not None and not self.on_thread():
            concurrent.futures.wait([last])

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.drain()
        self._queue.put(None)
        if not self.on_thread():
            self._thread.join()
        sys.setswitchinterval(self._interval)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fn, future = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as e:  # delivered to whoever waits for the step
                future.set_exception(e)


class LaunchedState:
    """An attribute of an object with a `launcher` (StepLauncher or None) that waits for the
    launcher's queued work whenever it is read or written off the launcher's thread."""

    def __set_name__(self, owner, name: str) -> None:
        self._attr = "_" + name

    def __get__(self, obj, owner=None):
        if obj is None:
            return self
        if obj.launcher is not None:
            obj.launcher.drain()
        return getattr(obj, self._attr)

    def __set__(self, obj, value) -> None:
        if obj.launcher is not None:
            obj.launcher.drain()
        setattr(obj, self._attr, value)
