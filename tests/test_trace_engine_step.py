"""bench/profile/trace_engine_step.py's summary of a profiled decode step, on synthetic device
events."""

from jaxinfer.bench.profile.trace_engine_step import busy_ns, summarize_steps


def test_busy_time_counts_overlapping_kernels_once_and_gaps_as_idle():
    events = [("gemm", 0, 10), ("attn", 5, 20), ("gemm", 30, 40), ("sort", 32, 35),
              ("gemm", 50, 60)]
    assert busy_ns(events) == 20 + 10 + 10
    s = summarize_steps([(n, a * 1000, b * 1000) for n, a, b in events], steps=2)
    assert s["step_period_us"] == 30.0 and s["busy_us_per_step"] == 20.0
    assert s["idle_us_per_step"] == 10.0 and s["kernels_per_step"] == 2.5
    assert s["top_kernels_us_per_step"] == {"gemm": 15.0, "attn": 7.5, "sort": 1.5}
