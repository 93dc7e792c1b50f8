"""jaxinfer/bench/profile/trace_decode.py's timeline summary (the GPU trace itself needs the H200)."""

from jaxinfer.bench.profile.trace_decode import RUNS, summarize


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


def test_prefill_timeline_row_separates_the_attention_kernel():
    from jaxinfer.bench.profile.trace_prefill import timeline_row
    # Each call: two 2 µs table ops, 1 µs idle, a 900 µs attention kernel, 1 µs idle.
    call = [("fusion", 0, 2_000), ("sort", 2_000, 4_000), ("flash_attention", 5_000, 905_000)]
    row = timeline_row(chained(call, 906_000, calls=4), calls=4, flops=540e12 * 900e-6)
    assert row["main_kernel"] == "2:flash_attention" and row["main_kernel_us"] == 900.0
    assert row["other_kernels_us"] == 4.0
    assert abs(row["TFLOPs_kernel"] - 540.0) < 1e-9
    assert row["TFLOPs_call"] < row["TFLOPs_kernel"]


def test_prefill_trace_implementations_lower_for_cuda():
    import jax
    import jax.numpy as jnp

    from jaxinfer.bench.profile.trace_prefill import implementations
    bf16, i32 = jnp.bfloat16, jnp.int32
    args = (jax.ShapeDtypeStruct((2, 256, 32, 128), bf16),
            *[jax.ShapeDtypeStruct((2, 256, 8, 128), bf16)] * 2,
            jax.ShapeDtypeStruct((2,), i32), jax.ShapeDtypeStruct((2,), i32))
    texts = {name: jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
             for name, fn in implementations(2, 256, causal=False).items() if name != "cudnn"}
    assert all("mosaic_gpu" in t for t in texts.values())
    # The A/B variant builds its table on the device; the default entry has it as a constant.
    assert "stablehlo.sort" in texts["ours_table_on_device"] and "stablehlo.sort" not in texts["ours"]
