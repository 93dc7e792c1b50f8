"""`jaxinfer/bench/profile/profile_decode.py` reads the traces Mosaic GPU's profiler writes: here a trace is
made by the profiler's own `ProfilerSpec.dump` from a synthetic buffer (2 CTAs x 3 warpgroups)."""

from __future__ import annotations

import io
import json

import numpy as np

from jax.experimental.mosaic.gpu import profiler

from jaxinfer.bench.profile.profile_decode import summarize, to_microseconds


def synthetic_trace(clock_ghz: float) -> list[dict]:
    spec = profiler.ProfilerSpec(64 * 4, dump_path="/tmp",
                                 trace_scope=profiler.ThreadSubset.WARPGROUP)
    for name in ("wait_q", "kv_steps", "merge_store", "producer_item"):
        spec.intern_name(name)
    buf = np.zeros((2, 3, spec.entries_per_warpgroup), np.uint32)
    cycles_per_us = int(clock_ghz * 1000)
    for cta in range(2):
        for wg in range(3):
            buf[cta, wg, 0] = 1_000_000 + 500 * cta  # global timer (ns) at the trace's start
            buf[cta, wg, 1] = cta                    # SM id
            ranges = ([("wait_q", 1), ("kv_steps", 30), ("merge_store", 2)] if wg < 2
                      else [("producer_item", 28)])
            stamps, t = [], 100
            for name, us in ranges:  # `us` microseconds each, 12 cycles apart (a stamp's cost)
                tag = spec.interned_names[name]
                stamps += [tag, t, tag | profiler.ProfilerSpec.EXIT, t + us * cycles_per_us]
                t += us * cycles_per_us + 12
            buf[cta, wg, 2] = len(stamps)
            buf[cta, wg, 3:3 + len(stamps)] = stamps
    f = io.StringIO()
    spec.dump(buf.reshape(-1), f, grid=(2, 1, 1), block=(384, 1, 1))
    return [e for e in json.loads(f.getvalue())["traceEvents"] if e.get("ph") in ("B", "E")]


def test_summary_of_a_profiler_trace_in_microseconds():
    r = summarize(to_microseconds(synthetic_trace(1.5), 1.5))
    assert r["ctas"] == 2
    np.testing.assert_allclose(r["cta_start_spread_us"], 0.5, atol=0.01)
    np.testing.assert_allclose(r["span_us"], 33.5, atol=0.05)  # 33 µs per CTA, CTA 1 starts 0.5 later
    np.testing.assert_allclose(r["first_q_ready_us"], 1.0, atol=0.05)
    kv = r["ranges_us"]["kv_steps"]
    assert kv["n"] == 4
    np.testing.assert_allclose([kv["mean"], kv["max"]], [30, 30], atol=0.05)
    assert r["ranges_us"]["producer_item"]["n"] == 2


def test_read_trace_summarises_the_newest_trace_file(tmp_path, monkeypatch):
    from jaxinfer.bench.profile import profile_decode
    monkeypatch.setattr(profile_decode, "sm_clock_ghz", lambda: 1.5)
    assert "error" in profile_decode.read_trace(tmp_path)
    (tmp_path / "k-1-trace.json").write_text(json.dumps({"traceEvents": synthetic_trace(1.5)}))
    r = profile_decode.read_trace(tmp_path)
    assert r["ctas"] == 2 and r["sm_clock_ghz"] == 1.5 and r["trace"].endswith("k-1-trace.json")
    np.testing.assert_allclose(r["span_us"], 33.5, atol=0.05)


def test_step_breakdown_gives_self_time_per_step_and_role():
    from jaxinfer.bench.profile.profile_decode import breakdown_table, step_breakdown

    def ranges(tid, spans):  # (name, start, end) -> B/E events
        return [e for name, t0, t1 in spans for e in (
            {"tid": tid, "name": name, "ph": "B", "ts": t0},
            {"tid": tid, "name": name, "ph": "E", "ts": t1})]

    step = lambda t: [("wait_k", t, t + 1), ("qk", t + 1, t + 4), ("widen", t + 2, t + 3),
                      ("softmax", t + 4, t + 6)]
    # CTA 0: consumer 0 (tid 1) two 7 µs steps in kv_steps; the producer (tid 3) two steps of
    # two slot waits (K and V) in one item.
    events = ranges(1, [("kv_steps", 0, 14), *step(0), *step(7)])
    events += ranges(3, [("producer_item", 0, 10), ("wait_free", 1, 2), ("wait_free", 3, 3.5),
                         ("wait_free", 5, 6), ("wait_free", 7, 7.5)])
    b = step_breakdown(events, warpgroups=3)
    c0, prod = b["consumer 0"], b["producer"]
    assert c0["steps"] == 2 and prod["steps"] == 2
    per = c0["us_per_step"]
    np.testing.assert_allclose([per["wait_k"], per["qk"], per["widen"], per["softmax"]],
                               [1, 2, 1, 2])  # qk less the widening nested in it
    np.testing.assert_allclose(per["kv_steps"], 1)  # 14 µs less 2 x 6 in named ranges, per step
    np.testing.assert_allclose(prod["us_per_step"]["wait_free"], 1.5)
    np.testing.assert_allclose(prod["us_per_step"]["producer_item"], 3.5)
    table = breakdown_table(b)
    assert "| range | consumer 0 | producer |" in table and "| sum per step | 7.000 | 5.000 |" in table
