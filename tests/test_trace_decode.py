"""benchmarks/trace_decode.py's timeline summary (the GPU trace itself needs the H200)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.trace_decode import RUNS, summarize  # noqa: E402


def test_summary_per_call_durations_gaps_and_period():
    # RUNS runs of 2 chained calls; each call: a 30 µs kernel, 1 µs idle, a 2 µs combine, 1 µs idle.
    events, t = [], 0
    for _ in range(RUNS * 2):
        events += [("decode_kernel", t, t + 30_000), ("combine", t + 31_000, t + 33_000)]
        t += 34_000
    out = summarize(events, calls=2)
    assert out["kernels"]["0:decode_kernel"] == {"mean_us": 30.0, "gap_before_us": 1.0}
    assert out["kernels"]["1:combine"] == {"mean_us": 2.0, "gap_before_us": 1.0}
    assert out["period_us"] == (2 * 34_000 - 1_000) / 1e3 / 2


def test_summary_tells_same_named_kernels_apart_and_shows_overlap():
    # Two kernels of one name per call; the second starts 25 µs into the first (an early launch).
    events, t = [], 0
    for _ in range(RUNS * 2):
        events += [("k", t, t + 30_000), ("k", t + 25_000, t + 32_000)]
        t += 33_000
    out = summarize(events, calls=2)
    assert out["kernels"]["0:k"] == {"mean_us": 30.0, "gap_before_us": 1.0}
    assert out["kernels"]["1:k"] == {"mean_us": 7.0, "gap_before_us": -5.0}
