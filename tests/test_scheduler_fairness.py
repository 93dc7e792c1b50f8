"""One request may not starve the others (issue 38): a request of many long prompts (ids
`<id>#<i>`, as the server names them) admitted FCFS held a later small request in the queue until
all of its prompts were in. Admission now goes round-robin across requests: the small request
finishes in at most 3 x the steps it takes alone, and the whole workload takes the same steps.

The steps run on the host only (the engine's scheduler and output processing, each row sampling a
fixed token): no device work, no compiles."""

from __future__ import annotations

import numpy as np

from jaxinfer.core.scheduler import prompt_index
from jaxinfer.sampling_params import SamplingParams
from jaxinfer.worker.runner import StepHandle, StepResult
from test_engine_support import make_engine, prompt_ids



def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n)


def host_step(engine) -> list[str]:
    """One step without the device; the ids of the requests that finished."""
    sched = engine.scheduler.schedule()
    handle = StepHandle(sched, None, 1, 0.0, False)
    handle._result = StepResult(np.full((1, len(sched.scheduled)), 7, np.int32), None, None, None)
    return [o.request_id for o in engine._collect(engine._process(handle)) if o.finished]


def run(engine, small_first: bool | None) -> tuple[int | None, int]:
    """12 prompts of 40 tokens (request "big") and one of 8 (request "small", added after the
    big one's first step unless `small_first`; None: no big request). -> (steps from the small
    request's arrival to its finish, steps until everything finished)."""
    engine.scheduler.reset_prefix_cache()  # (each run computes every prompt)
    def small():
        engine.add_request("small", prompt_ids(1, 8), greedy(4))
    if small_first:
        small()
    if small_first is not None:
        for i in range(12):
            engine.add_request(f"big#{i}", prompt_ids(100 + i, 40), greedy(2))
    steps, arrived, small_steps = 0, 0, None
    while engine.has_unfinished_requests() or small_steps is None and steps < 200:
        if steps == 1 and small_first is False or small_first is None and steps == 0:
            small()
            arrived = steps
        finished = host_step(engine)
        steps += 1
        if "small" in finished:
            small_steps = steps - arrived
    return small_steps, steps


def test_a_small_request_is_not_held_behind_a_many_prompt_request():
    engine = make_engine(max_num_seqs=16, num_blocks=256)
    idle, _ = run(engine, None)
    busy, total = run(engine, small_first=False)
    _, total_small_first = run(engine, small_first=True)
    print(idle, busy, total, total_small_first)
    assert idle == 4  # one prefill step, three decodes
    assert busy <= 3 * idle, (busy, idle)
    assert abs(total - total_small_first) <= 0.05 * total_small_first + 1


def test_prompt_index_names_the_round_robin_key():
    assert [prompt_index(r) for r in ("cmpl-1#0", "cmpl-1#12", "offline-3", "a#b", "#7")] == [
        0, 12, 0, 0, 7]
