"""Serving before every bucket is compiled (jaxinfer/worker/bucket_compiler.py): a step whose bucket
is not ready runs in the smallest ready one that fits, with the same greedy tokens; the background
compile finishes and its buckets are then used; stopping it mid-way (or exiting the process) is
clean."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from jaxinfer.sampling_params import SamplingParams
from jaxinfer.worker.bucket_compiler import BucketCompiler
from jaxinfer.worker.buckets import Buckets, step_shape
from test_engine_features import counting_compilations
from test_engine_support import make_engine, prompt_ids, run_all

GREEDY = dict(temperature=0.0, ignore_eos=True)
# 16 sequences, 64-token steps: token buckets 16/32/64, decode buckets 8/16. The first set is
# mixed 64, mixed 32 (a short prompt's) + decode 8; decode 16 and mixed 16 come later.
SHAPE = dict(max_num_seqs=16, max_num_batched_tokens=64, long_prefill_chunk=24)
# 12 requests side by side: prefill chunks of every size, then pure decodes of 12 rows (decode 16).
WORKLOAD = [(prompt_ids(500 + i, 3 + 4 * i), 5 + i % 4) for i in range(12)]


def greedy_tokens(engine) -> list[list[int]]:
    for i, (prompt, n) in enumerate(WORKLOAD):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=n, **GREEDY))
    out = run_all(engine)
    return [out[f"r{i}"][0][0] for i in range(len(WORKLOAD))]


@functools.cache
def expected_tokens() -> list[list[int]]:
    """The workload's greedy tokens from an engine without a bucket compiler: every step runs in
    its own bucket, compiled as it comes (computed once: three tests compare with it)."""
    return greedy_tokens(make_engine(**SHAPE))


def record_shapes(engine) -> list[tuple[int, int, int]]:
    """The (tokens, rows, decode rows) of every step the runner builds from now on."""
    shapes, build = [], engine.runner.build

    def recording(sched):
        batch, variant, is_loop = build(sched)
        shapes.append((batch.token_ids.shape[0], batch.md.num_seqs, batch.md.num_decodes))
        return batch, variant, is_loop

    engine.runner.build = recording
    return shapes


def test_step_shape_takes_the_smallest_ready_bucket_that_fits():
    b = Buckets.make(16, 64)
    assert step_shape(b, 20, 3, False, None) == (32, 16, 0)  # no compiler: its own bucket
    ready = {(64, 16, 0), (8, 8, 8)}
    assert step_shape(b, 20, 3, False, ready) == (64, 16, 0)
    assert step_shape(b, 5, 5, True, ready) == (8, 8, 8)
    assert step_shape(b, 12, 12, True, ready) == (64, 16, 0)  # decode 16 not ready: mixed 64
    assert step_shape(b, 12, 12, True, ready | {(32, 16, 0)}) == (32, 16, 0)
    assert step_shape(b, 12, 12, True, ready | {(16, 16, 16)}) == (16, 16, 16)
    # Mixed 16 has 16 rows: a 9-token prefill step of 9 rows fits it.
    assert step_shape(b, 9, 9, False, ready | {(16, 16, 0)}) == (16, 16, 0)
    assert step_shape(b, 40, 2, False, {(8, 8, 8), (32, 16, 0)}) == (64, 16, 0)  # none fits


def test_unready_buckets_are_served_by_larger_ones_with_the_same_tokens(monkeypatch):
    expected = expected_tokens()
    # The background part never runs: only the first set is ever ready.
    monkeypatch.setattr(BucketCompiler, "compile_rest", lambda self, background, bar=None: None)
    engine = make_engine(warmup=True, background_compile=True, **SHAPE)
    compiler = engine.runner.compiler
    assert compiler.ready_forwards == {(64, 16, 0), (32, 16, 0), (8, 8, 8)}
    assert compiler.num_ready == 3 and compiler.num_units == 6  # + the default decode loop's
    shapes = record_shapes(engine)
    with counting_compilations() as compilations:
        assert greedy_tokens(engine) == expected
        assert compilations[0] == 0  # no step waited for a compile
    # 12-row decodes (decode 16 not ready) and 16-token steps (mixed 16) ran in larger buckets
    assert set(shapes) == {(64, 16, 0), (32, 16, 0), (8, 8, 8)}
    assert shapes.count((64, 16, 0)) > 4


def role_engine(monkeypatch, role: str):
    """An engine warmed up as one side of a disaggregated pair, only its first set ever ready."""
    monkeypatch.setattr(BucketCompiler, "compile_rest", lambda self, background, bar=None: None)
    engine = make_engine(background_compile=True, role=role, **SHAPE)
    engine.warmup(progress=False)
    return engine


def test_a_decode_engine_has_every_decode_bucket_before_ready(monkeypatch):
    # Issue 27: a disaggregated decode engine gets many running sequences at once; with only
    # decode 8 ready, a 12-row decode step ran padded into the largest mixed bucket (a prefill
    # chunk's compute per token) until the background compile reached decode 16.
    engine = role_engine(monkeypatch, "decode")
    compiler = engine.runner.compiler
    assert compiler.ready_forwards == {(64, 16, 0), (32, 16, 0), (8, 8, 8), (16, 16, 16)}
    pure, build = [], engine.runner.build

    def recording(sched):
        batch, variant, is_loop = build(sched)
        if not sched.prefills:
            pure.append((batch.token_ids.shape[0], batch.md.num_seqs, batch.md.num_decodes))
        return batch, variant, is_loop

    engine.runner.build = recording
    greedy_tokens(engine)
    # every pure-decode step ran in a decode bucket, none padded into the mixed one
    assert (16, 16, 16) in pure and set(pure) <= {(8, 8, 8), (16, 16, 16)}


def test_a_prefill_engine_compiles_no_decode_bucket(monkeypatch):
    engine = role_engine(monkeypatch, "prefill")
    compiler = engine.runner.compiler
    assert compiler.num_units == 3 and compiler.ready_forwards == {(64, 16, 0), (32, 16, 0)}
    assert not engine.runner.programs.compiled["decode loop"]


def test_the_background_compile_finishes_and_its_buckets_are_then_used():
    engine = make_engine(warmup=True, background_compile=True, decode_steps_per_call=3, **SHAPE)
    compiler = engine.runner.compiler
    assert compiler.wait(timeout=300)
    assert compiler.num_ready == compiler.num_units == 7  # 3 mixed, 2 decode, 2 loops
    assert compiler.ready_loops == {8, 16}
    label = {"model_name": engine.model_name}
    scrape = engine.metrics.registry.get_sample_value
    assert scrape("jaxinfer:compiled_buckets", label) == scrape("jaxinfer:total_buckets", label) == 7
    shapes = record_shapes(engine)
    with counting_compilations() as compilations:
        tokens = greedy_tokens(engine)
        assert compilations[0] == 0
    assert {(32, 16, 0), (16, 16, 16)} <= set(shapes)  # buckets compiled after ready
    assert tokens == expected_tokens()  # (a decode loop's greedy tokens are single steps')


def test_stopping_mid_compile_leaves_a_working_engine():
    engine = make_engine(warmup=True, background_compile=True, **SHAPE)
    compiler = engine.runner.compiler
    compiler.stop()
    assert compiler._thread is None or not compiler._thread.is_alive()
    assert not compiler.wait(timeout=0) or compiler.num_ready == compiler.num_units
    ready = set(compiler.ready_forwards)
    shapes = record_shapes(engine)
    assert greedy_tokens(engine) == expected_tokens()
    assert set(shapes) <= ready


def test_the_process_exits_cleanly_while_buckets_compile(tmp_path):
    """Interpreter exit with the background compile under way: exit status 0, nothing printed to
    stderr about threads, and no waiting for every remaining bucket. The file's shapes, and the
    run's jax cache (conftest.py): the first set this file's engines compiled loads from it."""
    script = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, "tests")
        import conftest  # noqa: F401  (CPU, test XLA flags)
        from test_engine_support import make_engine
        engine = make_engine(warmup=True, background_compile=True, decode_steps_per_call=2,
                             **{SHAPE})
        c = engine.runner.compiler
        print("ready", c.num_ready, c.num_units, flush=True)
        sys.exit(0)
    """)
    root = Path(__file__).resolve().parent.parent
    cache = {k: os.environ[k] for k in ("JAX_COMPILATION_CACHE_DIR",
                                        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS")
             if k in os.environ}
    proc = subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True, text=True,
                          timeout=300, env={"PYTHONPATH": f"{root}:{root / 'tests'}",
                                            "JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin",
                                            **cache})
    assert proc.returncode == 0, proc.stderr[-3000:]
    ready, units = map(int, proc.stdout.split()[1:3])
    assert ready < units == 7  # 3 mixed, 2 decode, 2 loops: it exited part-way through
    assert "Traceback" not in proc.stderr and "Fatal" not in proc.stderr, proc.stderr[-3000:]


def test_the_readme_request_runs_in_buckets_compiled_before_ready(monkeypatch):
    """The README's request (27 prompt tokens, 48 out), sent as soon as `serve` is ready: its
    prefill and its decodes run in buckets of the first set, none padded to the largest (on a
    cold CPU start, seconds per request while the rest compiled: issue 62)."""
    monkeypatch.setattr(BucketCompiler, "compile_rest", lambda self, background, bar=None: None)
    engine = make_engine(warmup=True, background_compile=True, max_num_seqs=256,
                         max_num_batched_tokens=2048)  # `serve`'s defaults
    shapes = record_shapes(engine)
    engine.add_request("readme", prompt_ids(7, 27), SamplingParams(max_tokens=4, **GREEDY))
    run_all(engine)
    assert shapes[0] == (32, 32, 0)  # the prefill, at its own size
    assert set(shapes[1:]) == {(8, 8, 8)}  # the decodes, in the first decode bucket


def test_background_compiles_run_at_the_lowest_cpu_priority(monkeypatch):
    """A cold serve on two cores: the first requests took 10x their steady time while the other
    buckets compiled beside them at the steps' own priority."""
    import threading

    import pytest

    from jaxinfer.worker import compile_priority
    if not sys.platform.startswith("linux"):
        pytest.skip("thread priorities are set on Linux only")
    holding, release = threading.Event(), threading.Event()

    def held(self):  # the background thread stops before its first unit until released
        holding.set()
        release.wait(60)
    monkeypatch.setattr(compile_priority.StepPacer, "wait_for_quiet", held)
    engine = make_engine(warmup=True, background_compile=True, **SHAPE)
    compiler = engine.runner.compiler
    try:
        assert holding.wait(60)
        nice = compiler._pool.submit(
            lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id())).result(60)
        assert nice == compile_priority.BACKGROUND_NICE
        assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) < nice  # the steps'
    finally:
        release.set()
    assert compiler.wait(timeout=300)


def test_background_lowering_waits_for_a_quiet_engine_but_not_forever(monkeypatch):
    import threading
    import time

    from jaxinfer.worker import compile_priority
    monkeypatch.setattr(BucketCompiler, "compile_rest", lambda self, background, bar=None: None)
    compiler = make_engine(warmup=True, background_compile=True, **SHAPE).runner.compiler
    monkeypatch.setattr(compile_priority, "QUIET_S", 0.3)
    monkeypatch.setattr(compile_priority, "MAX_PAUSE_S", 1.5)
    pacer = compiler.pacer
    pacer.step_seen()  # a step just now: wait until QUIET_S has passed since it
    t0 = time.monotonic()
    pacer.wait_for_quiet()
    assert time.monotonic() - t0 >= 0.25
    stepping = threading.Event()

    def steps():  # an engine that never goes quiet
        while not stepping.is_set():
            pacer.step_seen()
            time.sleep(0.01)
    threading.Thread(target=steps, daemon=True).start()
    try:
        t0 = time.monotonic()
        pacer.wait_for_quiet()  # gives up after MAX_PAUSE_S
        assert time.monotonic() - t0 >= 1.5
    finally:
        stepping.set()
