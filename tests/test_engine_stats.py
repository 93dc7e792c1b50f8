"""The step loop's host bookkeeping: many histogram observations in one update, and the host phase
split of `EngineStats`."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram, generate_latest

from jaxinfer.engine.metrics import EngineStats, observe_many


def _exposition(amounts: list[tuple[float, int]], bulk: bool) -> str:
    registry = CollectorRegistry()
    h = Histogram("gap_seconds", "gaps", buckets=(0.001, 0.01, 0.1), registry=registry)
    for amount, count in amounts:
        if bulk:
            observe_many(h, amount, count)
        else:
            for _ in range(count):
                h.observe(amount)
    return "\n".join(line for line in generate_latest(registry).decode().splitlines()
                     if not line.startswith("gap_seconds_created"))


def test_observe_many_exposes_what_one_at_a_time_would():
    # (powers of two: the sum is exact either way)
    amounts = [(2.0 ** -8, 256), (2.0 ** -11, 3), (2.0 ** -4, 1), (7.0, 2), (2.0 ** -7, 4)]
    bulk = _exposition(amounts, bulk=True)
    assert bulk == _exposition(amounts, bulk=False)
    assert 'gap_seconds_bucket{le="0.01"} 263.0' in bulk and "gap_seconds_count 266.0" in bulk


def test_engine_stats_split_host_phases_per_step():
    st = EngineStats()
    st.record_dispatch(10.0, 10.001, 10.003, 10.006)  # schedule 1 ms, build 2, launch 3
    st.record_dispatch(20.0, 20.003, None, 20.004)    # not split: build 0, launch 1
    st.record_process(0.005, wait_s=0.004)
    ms = st.breakdown_ms()
    assert ms == dict(schedule=2.0, build=1.0, launch=2.0, wait=4.0, process=1.0)
    assert st.steps == 2 and abs(st.host_ms_per_step - 5.0) < 1e-9
