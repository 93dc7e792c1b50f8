"""benchmarks/trace_decode.py's timeline summary (the GPU trace itself needs the H200)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.trace_decode import RUNS, summarize  # noqa: E402


def chained(call, period_ns, calls=2):
    """RUNS runs of `calls` chained calls: each call's (name, start, end) events, shifted by the
    call's start."""
    return [(name, t + start, t + end) for t in range(0, RUNS * calls * period_ns, period_ns)
            for name, start, end in call]


def test_summary_per_call_durations_gaps_and_period():
    # Each call: a 30 µs kernel, 1 µs idle, a 2 µs combine, 1 µs idle.
    events = chained([("decode_kernel", 0, 30_000), ("combine", 31_000, 33_000)], 34_000)
    out = summarize(events, calls=2)
    assert out["kernels"]["0:decode_kernel"] == {"mean_us": 30.0, "gap_before_us": 1.0}
    assert out["kernels"]["1:combine"] == {"mean_us": 2.0, "gap_before_us": 1.0}
    assert out["period_us"] == (2 * 34_000 - 1_000) / 1e3 / 2


def test_summary_tells_same_named_kernels_apart_and_shows_overlap():
    # Two kernels of one name per call; the second starts 5 µs before the first ends (PDL).
    out = summarize(chained([("k", 0, 30_000), ("k", 25_000, 32_000)], 33_000), calls=2)
    assert out["kernels"]["0:k"] == {"mean_us": 30.0, "gap_before_us": 1.0}
    assert out["kernels"]["1:k"] == {"mean_us": 7.0, "gap_before_us": -5.0}
