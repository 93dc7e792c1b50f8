"""The engine loop survives any single request (issue 19): a failure while building, dispatching or
processing one request's step fails that request only (a clean error to its client, its blocks
freed, finish reason "error"), and the other requests complete. Faults are injected for requests
with a marker seed, against the session-wide `server` fixture (tests/conftest.py)."""

from __future__ import annotations

import json
import threading

import pytest

from server_harness import (
    completion_text,
    health_ok,
    raw_json,
    MODEL,
    NO_EOS,
    check_error_shape,
    metric_delta,
    post_raw,
    scrape,
    wait_pool_free,
)


# ---- the engine loop survives one request's failure ----------------------------------------------

MARK_SEED = 4242  # requests with this seed are the ones the injected faults hit


@pytest.fixture(scope="module")
def server(in_process_server):
    """The shared tiny server with its engine core in this process:
    faults are injected into the engine's objects."""
    return in_process_server


def run_with_faulty_request(server, stream: bool) -> tuple[tuple, list]:
    url = server.urls["main"]
    others: list = []

    def normal(i):
        others.append(
            post_raw(
                url,
                "/v1/completions",
                raw_json({"model": MODEL, "prompt": [5 + i, 9, 13], "max_tokens": 12, "seed": i, **NO_EOS}),
            )
        )

    threads = [threading.Thread(target=normal, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    bad = post_raw(
        url,
        "/v1/completions",
        raw_json(
            {
                "model": MODEL,
                "prompt": [7, 8, 9],
                "max_tokens": 12,
                "seed": MARK_SEED,
                "stream": stream,
                **NO_EOS,
            }
        ),
    )
    for t in threads:
        t.join(60)
    return bad, others


@pytest.mark.parametrize("stage", ["build", "process"])
@pytest.mark.parametrize("stream", [False, True])
def test_failure_in_one_requests_step_fails_only_that_request(server, stage, stream):
    """The fault hits the marked request after its third token, mid-decode, among six others."""
    llm = server.engine.engine
    before = scrape(server.urls["main"])
    if stage == "build":  # the defect: building the sampling row raised on the engine thread
        target, name = llm.runner.sampling_table, "row_of"
        real = target.row_of

        def faulty(seq):
            if seq.request.params.seed == MARK_SEED and seq.num_output_tokens >= 3:
                raise OverflowError("injected: Python int too large to convert to C long")
            return real(seq)
    else:  # applying a step's sampled tokens to one sequence (detokenizing, stop checks)
        target, name = llm.outputs, "_append"
        real = target._append

        def faulty(seq, *args):
            if seq.request.params.seed == MARK_SEED and seq.num_output_tokens >= 3:
                raise UnicodeError("injected")
            return real(seq, *args)

    setattr(target, name, faulty)
    try:
        (status, _, raw), others = run_with_faulty_request(server, stream)
    finally:
        delattr(target, name)
    if stream:  # headers were sent with the first output: the error comes in-band, then [DONE]
        events = raw.split(b"\n\n")
        assert status == 200 and events[-2] == b"data: [DONE]", raw[-500:]
        err = json.loads(events[-3][len(b"data: ") :])
        assert err["error"]["code"] == 500 and "injected" in err["error"]["message"]
    else:
        assert status == 500, raw
        assert "injected" in check_error_shape(raw, 500)["message"]
    assert [s for s, _, _ in others] == [200] * 6
    for _, _, body in others:
        assert json.loads(body)["usage"]["completion_tokens"] == 12
    assert server.engine.errored is None
    health_ok(server.urls["main"])
    wait_pool_free(server)  # the failed request's blocks were freed
    after = scrape(server.urls["main"])
    assert metric_delta(before, after, "jaxinfer:request_success_total", finished_reason="error") == 1
    assert completion_text(server.urls["main"])


def test_dispatch_failure_rolls_back_the_step(server):
    """A step that cannot be dispatched (no request named) fails the requests in that step only; the
    sequences' state is rolled back, the engine goes on."""
    llm = server.engine.engine
    real = llm.runner.execute
    calls = {"n": 0}

    def flaky(sched):
        calls["n"] += 1
        if any(e.seq.request.params.seed == MARK_SEED for e in sched.scheduled) and calls["n"] % 2:
            raise RuntimeError("injected dispatch failure")
        return real(sched)

    llm.runner.execute = flaky
    try:
        status, _, raw = post_raw(
            server.urls["main"],
            "/v1/completions",
            raw_json({"model": MODEL, "prompt": [7, 8, 9], "max_tokens": 4, "seed": MARK_SEED, **NO_EOS}),
        )
    finally:
        del llm.runner.execute
    assert status == 500 and "injected" in check_error_shape(raw, 500)["message"]
    assert server.engine.errored is None
    wait_pool_free(server)
    assert completion_text(server.urls["main"])
