"""Whether the host is on the critical path of the engine's steady decode steps, and why: a probe
over `steps` engine steps of running requests (issue 26: at batch 1 the FP8-weight engine left
the H200 idle between steps where the bf16 engine overlapped its host work with the device).

    from jaxinfer.bench.profile.engine_host_probe import probe_host
    figures = probe_host(engine, [prompt_ids], steps=32)

What it reports, per step:
- `step_ms`: wall time of `engine.step()`; `host` (EngineStats): schedule, build, launch, then
  wait (blocked on the previous step's tokens) and process. With the steps overlapped, a `wait`
  near 0 says the device finished before the host asked: the host is the critical path, and the
  other phases say where its time goes;
- `launch_cpu_ms`: this thread's CPU time in the launch phase (the inputs' device_put and the
  executables' dispatch): a dispatch that spends its wall time busy (kernel launches, argument
  handling) rather than blocked shows here; `dispatch_ms` / `dispatch_cpu_ms`: the last step
  dispatched `replays` more times back to back after the steps (its inputs' transfer and its
  program; no scheduling, no building), its host cost alone;
- `compiles`, `traces` (jax.monitoring events) and `python_dispatches`: jit calls that missed the
  C++ fast path (a re-trace, or arguments the fast path refuses), each costing Python work;
- `implicit_transfer`: the steps run under `jax.transfer_guard("disallow")`, so an implicit
  device->host read (a sync in the step loop) or host->device copy raises; None when none did
  (the engine's own device_get of the tokens and device_put of the inputs are explicit). On the
  CPU a device->host read is no transfer, so only a GPU run sees those;
- `forward_bucket`: (tokens, rows, decode rows) of the last step's forward.
"""

from __future__ import annotations

import contextlib
import time

import jax

from jaxinfer.engine.metrics import EngineStats
from jaxinfer.worker.programs import forward_key
from jaxinfer.bench.profile.trace_engine_step import single_steps, start_decoding, stop_requests

_EVENTS = {"/jax/core/compile/backend_compile_duration": "compiles",
           "/jax/core/compile/jaxpr_trace_duration": "traces"}


@contextlib.contextmanager
def _counting():
    """Counts of compiles, traces and jit calls that took the Python path, while inside."""
    counts = {"compiles": 0, "traces": 0, "python_dispatches": 0}

    def on_event(name, secs, **kwargs):
        if name in _EVENTS:
            counts[_EVENTS[name]] += 1
    jax.monitoring.register_event_duration_secs_listener(on_event)
    from jax._src import pjit  # private: every jit call the C++ fast path declines runs this
    infer = getattr(pjit, "_infer_params", None)
    if infer is None:
        counts["python_dispatches"] = None
    else:
        def counted(*args, **kwargs):
            counts["python_dispatches"] += 1
            return infer(*args, **kwargs)
        pjit._infer_params = counted
    try:
        yield counts
    finally:
        if infer is not None:
            pjit._infer_params = infer
        jax.monitoring.unregister_event_duration_listener(on_event)


class LaunchTimer:
    """Wraps the runner's `_launch` (the launch phase when no launcher thread dispatches): this
    thread's CPU time in it, the launches by kind ("step", "loop": a decode loop), the last
    launch's arguments for the replay, and (`seen`) the last launch's arguments per kind of work
    ("step": decodes only, "prefill", "loop"), block copies left out, as `_launch` takes them."""

    def __init__(self, runner):
        self.runner, self.launch = runner, runner._launch
        self.cpu_s, self.calls, self.last = 0.0, 0, None
        self.kinds = {"step": 0, "loop": 0}
        self.seen: dict[str, tuple] = {}

    def __call__(self, batch, variant, copies, allowed, *rest):
        c0 = time.thread_time()
        try:
            return self.launch(batch, variant, copies, allowed, *rest)
        finally:
            self.cpu_s += time.thread_time() - c0
            self.calls += 1
            self.kinds["step" if allowed is None else "loop"] += 1
            self.last = (batch, variant, (copies, allowed, *rest))
            work = ("loop" if allowed is not None else
                    "step" if batch.md.num_decodes == batch.md.num_seqs else "prefill")
            self.seen[work] = (batch, variant, [], allowed, *rest)

    def __enter__(self):
        self.runner._launch = self
        return self

    def __exit__(self, *exc):
        del self.runner._launch  # the instance attribute: the method again


def _replay(runner, batch, variant, n: int) -> tuple[float, float]:
    """(wall ms, thread CPU ms) per dispatch of a step (its inputs' transfer and its program),
    `n` back to back on the built host arrays; waits for them after timing."""
    runner._run_step(batch, variant)  # (the first after a step may wait on its donation)
    jax.block_until_ready(runner.last_tokens)
    t0, c0 = time.perf_counter(), time.thread_time()
    for _ in range(n):
        runner._run_step(batch, variant)
    wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
    jax.block_until_ready(runner.last_tokens)
    return 1e3 * wall / n, 1e3 * cpu / n


def probe_host(engine, prompts: list[list[int]], steps: int = 32, replays: int = 16) -> dict:
    """The figures of the module docstring over `steps` steady decode steps of `prompts` (greedy,
    no EOS), single steps (the engine's decode loop, if any, is off meanwhile); the requests are
    aborted after."""
    runner = engine.runner
    if runner.launcher is not None:
        return {"error": "probe_host measures one dispatched step per engine step on the engine's "
                         "thread (no async launch)"}
    with single_steps(engine):
        return _probe(engine, prompts, steps, replays)


def _probe(engine, prompts: list[list[int]], steps: int, replays: int) -> dict:
    runner = engine.runner
    rids = start_decoding(engine, prompts, steps + 8, "probe")
    for _ in range(3):  # past the first decode steps (their buckets' first calls)
        engine.step()
    saved, engine.stats = engine.stats, EngineStats()
    transfer = None
    done = 0
    try:
        with LaunchTimer(runner) as timer, _counting() as counts:
            t0 = time.perf_counter()
            with jax.transfer_guard("disallow"):
                try:
                    for _ in range(steps):
                        engine.step()
                        done += 1
                except Exception as e:  # what the probe looks for
                    transfer = repr(e)[:300]
            wall = time.perf_counter() - t0
        failed = engine.take_failed()  # a dispatch that raised fails its requests instead
        if failed and transfer is None:
            cause = failed[0][1].__cause__ or failed[0][1]
            transfer = repr(cause)[:300]
        stats = engine.stats
        out = dict(steps=done, step_ms=round(1e3 * wall / max(done, 1), 3),
                   host=stats.breakdown_ms(), host_ms=round(stats.host_ms_per_step, 3),
                   launch_cpu_ms=round(1e3 * timer.cpu_s / max(timer.calls, 1), 3),
                   idle_dispatches=stats.idle_dispatches, sync_gaps=stats.sync_gaps,
                   **counts, implicit_transfer=transfer,
                   params_leaves=len(jax.tree_util.tree_leaves(runner.params)))
        if timer.last is not None:
            batch, variant, _ = timer.last
            out["forward_bucket"] = list(forward_key(batch))
            stop_requests(engine, rids)
            rids = []
            wall_ms, cpu_ms = _replay(runner, batch, variant, replays)
            out.update(dispatch_ms=round(wall_ms, 3), dispatch_cpu_ms=round(cpu_ms, 3))
    finally:
        engine.stats = saved
        if rids:
            stop_requests(engine, rids)
    return out
