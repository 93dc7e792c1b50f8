"""The GPU benchmarks' and tools' host-side parts: bench_decode's per-call cost inside a program,
dump_kernels' ptxas report, mosaic_ir's listing (the timing and compiling themselves need the
H200)."""

import jax.numpy as jnp
import pytest

from jaxinfer.bench import kernel_decode as bench_decode


def test_marginal_time_cancels_the_per_jit_launch(monkeypatch):
    # A jit call of a chain of n calls takes 6 us of launch + 40 us per call.
    def fake_time_paged(fn, case):
        return (6e-6 + 40e-6 * case["chain"]) / case["chain"]

    monkeypatch.setattr(bench_decode, "time_paged", fake_time_paged)
    t = bench_decode.time_marginal(None, 1, 64)
    assert t == pytest.approx(40e-6)
    # ... where the per-call figure of a 4-call chain carries a quarter of the launch.
    assert fake_time_paged(None, {"chain": 4}) == pytest.approx(41.5e-6)


def test_paged_case_takes_the_chain_it_is_given():
    case = bench_decode.make_paged_case(1, 64, hq=4, hkv=1, d=64, chain=6)
    assert case["chain"] == 6 and case["sets"] % 6 == 0


def test_dump_kernels_reports_registers_and_spills(tmp_path):
    from jaxinfer.bench.profile.dump_kernels import ptxas_reports
    (tmp_path / "flash_attention_0.ptxas").write_text(
        "ptxas warning : Registers are spilled to local memory in function 'k', 8 bytes spill "
        "stores, 8 bytes spill loads\nptxas info    : Compile time = 1 ms\n"
        "ptxas info    : Used 168 registers, used 16 barriers\n")
    (tmp_path / "flash_attention_0.ptx").write_text("// not a report")
    [line] = ptxas_reports(tmp_path)
    assert line.startswith("flash_attention_0: ptxas warning") and "Used 168 registers" in line
    assert "Compile time" not in line


def test_prefill_timing_interleaves_the_implementations():
    from jaxinfer.bench import kernel_prefill as bench_prefill
    log = []

    def call(name):
        def f():
            log.append(name)
            return jnp.zeros(())
        return f

    times = bench_prefill.bench_interleaved({"ours": (call("ours"), ()),
                                             "cudnn": (call("cudnn"), ())}, reps=3, inner=2)
    assert set(times) == {"ours", "cudnn"} and all(t > 0 for t in times.values())
    warm = ["ours"] * 2 + ["cudnn"] * 2
    assert log == warm + (["ours"] * 2 + ["cudnn"] * 2) * 3  # one sample of each per rep


def test_decode_table_marks_a_negative_slope_as_noise():
    row = {"batch": 1, "ctx": 4096, "kv_bytes": 17e6, "kernels": {
        "mosaic": {"us": 10.9, "TBps": 1.54, "pct_ceiling": 34.0},
        "mosaic_marginal": {"us": -0.4, "TBps": -40.0, "pct_ceiling": -1014.0}}}
    line = bench_decode.table({"rows": [row]}).splitlines()[-1]
    assert "| 10.9 | 1.54 | 34% | noise | noise |" in line and "-1014" not in line


def test_same_size_read_anchor_times_its_chain_and_shows_in_the_table():
    case = {"chain": 2, "sets": 3, "kv_bytes": 2 * 4096}
    assert bench_decode.time_read_same_size(case) > 0
    row = {"batch": 1, "ctx": 32768, "kv_bytes": 134e6, "kernels": {
        "mosaic": {"us": 41.0, "TBps": 3.27, "pct_ceiling": 72.0},
        "read_same_size": {"us": 35.0, "TBps": 3.83, "pct_ceiling": 84.6}}}
    line = bench_decode.table({"rows": [row]}).splitlines()[-1]
    assert "| 35.0 | 85% |" in line


def test_mosaic_ir_prints_each_kernel_normalised():
    import functools
    import re

    import jax

    from jaxinfer.bench.profile import mosaic_ir
    from pallas_kernels.attention import flash_prefill as fp
    assert (mosaic_ir.normalise('%12 = "a.b"(%arg3, %7#1) : (i32) -> i32 loc("x"(#loc1))')
            == '%v = "a.b"(%v, %v) : (i32) -> i32')
    q = jax.ShapeDtypeStruct((1, 256, 4, 64), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 256, 1, 64), jnp.bfloat16)
    lowered = jax.jit(functools.partial(fp.flash_attention, causal=True)).trace(q, kv, kv).lower(
        lowering_platforms=("cuda",))
    [text] = mosaic_ir.mosaic_modules(lowered)
    assert "mbarrier" in text and "wgmma" in text
    assert re.search(r"%\d", text) is None and "loc(" not in text
