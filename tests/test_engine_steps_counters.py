"""`jaxinfer bench serve`'s reading of the server engine's step loop from /metrics (its server_*
keys, host-path's served_<run>_core_*): the counters EngineMetrics exports for an engine's
EngineStats, differenced over a run."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest

from jaxinfer.bench.http_client import engine_steps, server_counters
from jaxinfer.engine.metrics import EngineMetrics, EngineStats


def test_core_steps_are_the_step_loops_deltas_per_dispatched_step():
    metrics, stats = EngineMetrics("m"), EngineStats()
    metrics.track_stats(lambda: stats)
    stats.record_dispatch(0.0, 0.001, 0.003, 0.006)  # schedule 1 ms, build 2, launch 3
    before = server_counters(generate_latest(metrics.registry).decode())
    for step in range(4):
        stats.record_dispatch(0.0, 0.0005, 0.001, 0.004)  # 0.5 + 0.5 + 3 ms
        stats.record_process(0.010, 0.008)  # waited 8 ms, processed 2
    metrics.generation_tokens.inc(4 * 64)
    after = server_counters(generate_latest(metrics.registry).decode())
    core = engine_steps(before, after, duration_s=0.1)
    assert core["steps"] == 4 and core["tokens_per_step"] == 64
    assert core["step_period_ms"] == pytest.approx(25.0)
    assert core["schedule_ms"] == pytest.approx(0.5) and core["launch_ms"] == pytest.approx(3.0)
    assert core["host_ms"] == pytest.approx(4.0)
    assert core["wait_ms"] == pytest.approx(8.0) and core["process_ms"] == pytest.approx(2.0)


def test_no_stats_no_steps():
    metrics = EngineMetrics("m")
    metrics.track_stats(lambda: None)  # an engine gone
    text = generate_latest(metrics.registry).decode()
    assert "jaxinfer:engine_steps_total" not in text
    assert engine_steps(server_counters(text), server_counters(text), 1.0) == {}
