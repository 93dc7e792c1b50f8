"""The step loop's host bookkeeping: many histogram observations in one update, the host phase
split of `EngineStats`, and requests that want only their final output."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram, generate_latest

from jaxinfer.frontends.llm import LLM
from jaxinfer.engine.metrics import EngineStats, observe_many
from jaxinfer.sampling_params import SamplingParams
from test_engine_support import make_engine, prompt_ids, run_all


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


def test_final_output_only_requests_report_once_with_the_same_tokens():
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    engine = make_engine()
    for i in range(3):
        engine.add_request(f"r{i}", prompt_ids(i, 5), params)
    streamed = run_all(engine)
    reports: dict[str, int] = {}
    for i in range(3):
        engine.add_request(f"f{i}", prompt_ids(i, 5), params, final_output_only=True)
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.finished
            reports[out.request_id] = reports.get(out.request_id, 0) + 1
            assert out.outputs[0].token_ids == streamed[f"r{out.request_id[1:]}"][0][0]
    assert reports == {"f0": 1, "f1": 1, "f2": 1}
    outs = LLM(engine=engine).generate([prompt_ids(i, 5) for i in range(3)], params,
                                       use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [streamed[f"r{i}"][0][0] for i in range(3)]
