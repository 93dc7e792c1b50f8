"""`--async-launch`: steps dispatched from the launcher thread give the same tokens as dispatches
on the engine's thread (chunked prefill, forks with copy-on-write, the decode loop, seeded
sampling with logprobs, prompt logprobs), the device state read from the engine's thread is the
latest, and a failed dispatch reaches the caller."""

from __future__ import annotations

import pytest

from jaxinfer.sampling_params import SamplingParams
from jaxinfer.worker.launcher import StepLauncher
from test_engine_support import assert_all_free, make_engine, prompt_ids, run_all

GREEDY = dict(temperature=0.0, ignore_eos=True)


def _workload(engine) -> dict:
    kinds = [SamplingParams(max_tokens=9, **GREEDY),
             SamplingParams(temperature=0.8, max_tokens=7, seed=3, logprobs=2),
             SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=5),
             SamplingParams(max_tokens=4, prompt_logprobs=1, **GREEDY)]
    for i in range(8):
        engine.add_request(f"r{i}", prompt_ids(90 + i, 3 + 4 * i), kinds[i % len(kinds)])
        engine.step()
    return run_all(engine)


def test_async_launch_gives_the_same_outputs_and_leaves_the_state_current():
    # (A pool size no other test uses: test_engine_features counts the compilations of its own.)
    sync = make_engine(num_blocks=80, decode_steps_per_call=3, long_prefill_chunk=5)
    expected = _workload(sync)
    engine = make_engine(num_blocks=80, decode_steps_per_call=3, long_prefill_chunk=5,
                         async_launch=True)
    assert engine.runner.launcher is not None
    assert _workload(engine) == expected
    assert_all_free(engine)
    # The engine's thread sees the last dispatch's cache (the property waits for the launcher).
    cache = engine.runner.kv_cache
    assert not any(a.is_deleted() for a in (cache[0][0], engine.runner.last_tokens))
    engine.sleep()
    engine.wake()
    engine.add_request("again", prompt_ids(90, 3), SamplingParams(max_tokens=9, **GREEDY))
    assert run_all(engine)["again"] == expected["r0"]
    engine.runner.set_async_launch(False)
    assert engine.runner.launcher is None


def test_launcher_runs_in_order_and_hands_failures_to_their_future():
    launcher = StepLauncher()
    seen: list[int] = []
    futures = [launcher.submit(lambda i=i: seen.append(i) or i) for i in range(50)]
    bad = launcher.submit(lambda: 1 / 0)
    after = launcher.submit(lambda: "still running")
    launcher.drain()
    assert seen == list(range(50)) and [f.result() for f in futures] == list(range(50))
    with pytest.raises(ZeroDivisionError):
        bad.result()
    assert after.result() == "still running"
    launcher.close()
    with pytest.raises(RuntimeError, match="closed"):
        launcher.submit(lambda: None)
