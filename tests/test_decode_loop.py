"""The on-device decode loop (`--decode-steps-per-call K`, step_programs.decode_loop): a fixed trip count
XLA knows, and the same greedy tokens, texts and finish reasons as the step-by-step engine while
rows finish part-way through a loop (stop token ids, min_tokens, stop strings, length limits) and
the others go on. (test_engine_greedy checks loops against the oracle under continuous batching.)"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from jaxinfer.sampling_params import SamplingParams
from jaxinfer.parallel.transfer import pack_step_inputs
from jaxinfer.worker.sampler import BASE_SAMPLER
from test_engine_greedy import WORKLOAD, oracle
from test_engine_support import assert_all_free, make_engine, run_all, tiny_tokenizer
from jaxinfer.bench.profile.hlo_text import parse

pytestmark = pytest.mark.filterwarnings("error:Some donated buffers were not usable")

K = 4
# Room for all 16 requests at once: loops run only while nothing waits.
ROOMY = dict(max_num_seqs=16, max_num_batched_tokens=256, long_prefill_chunk=256)


def test_the_loop_has_a_trip_count_xla_knows():
    """The loop's while (the one the entry computation runs) carries `known_trip_count` = K in its
    backend config: on the GPU its iterations then run without reading a predicate back."""
    runner = make_engine(decode_steps_per_call=K).runner
    packed, apart, packing = pack_step_inputs(runner.step_batch([], 8, 8, 8, BASE_SAMPLER),
                                              runner.plan)
    hlo = runner.programs.jitted["decode loop"].lower(
        runner.params, runner.kv_cache, runner.last_tokens, packed, apart, np.zeros(8, np.int32),
        packing=packing, variant=BASE_SAMPLER, num_steps=K).compile().as_text()
    module = parse(hlo)
    loops = [i for i in module.comps[module.entry] if i.opcode == "while"]
    assert len(loops) == 1
    config = re.search(r"backend_config=(\{.*\})", loops[0].attrs).group(1)
    assert json.loads(config)["known_trip_count"] == {"n": str(K)}


def _params(i: int, cont: list[int]) -> SamplingParams:
    """Request i's limits, chosen from its greedy continuation `cont` so that it stops early."""
    kind = i % 4
    if kind == 0:
        return SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[cont[2]])
    if kind == 1:
        text = tiny_tokenizer().decode(cont)
        mid = len(text) // 2
        return SamplingParams(temperature=0.0, max_tokens=12, stop=[text[mid:mid + 2]])
    if kind == 2:
        return SamplingParams(temperature=0.0, max_tokens=1 + i % 7)
    return SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[cont[0]], min_tokens=3)


def _run(decode_steps_per_call: int) -> tuple[dict, list, int]:
    """The workload's results, the token arrays of every loop the engine ran, and how many loops
    were dispatched while the previous loop's tokens were still unprocessed."""
    engine = make_engine(decode_steps_per_call=decode_steps_per_call, **ROOMY)
    for i, (prompt, _) in enumerate(WORKLOAD):
        engine.add_request(f"r{i}", prompt, _params(i, oracle(prompt, 12)))
    runner, loops, overlapped = engine.runner, [], 0
    execute = runner.execute

    def recording(sched):
        nonlocal overlapped
        previous = engine._inflight  # the engine processes it after this dispatch, if it overlaps
        handle = execute(sched)
        if handle.is_loop:
            loops.append(handle)
            overlapped += previous is not None and previous.is_loop
        return handle
    runner.execute = recording
    results = run_all(engine)
    assert_all_free(engine)
    return results, [h.result().tokens for h in loops], overlapped


def test_rows_that_finish_mid_loop_match_single_steps():
    """Loops overlap like single steps (the next one is dispatched before the previous one's
    tokens are processed; rows that finished in it are dropped from the next one's results)."""
    stepped, no_loops, _ = _run(1)
    looped, loops, overlapped = _run(K)
    assert not no_loops and looped == stepped
    assert overlapped >= 1
    reasons = {r[0][2] for r in stepped.values()}
    assert reasons == {"stop", "length"}
    # Some loop masked a finished row (-1 after its last token) while another row went on to the
    # last iteration: the fixed trip count, not a stop at the first finisher.
    assert any((t < 0).any() and (t[-1] >= 0).any() for t in loops)


def test_the_default_loop_runs_for_few_sequences_only():
    """Default: AUTO_DECODE_STEPS steps per loop for at most AUTO_LOOP_MAX_SEQS sequences; a given
    --decode-steps-per-call loops for any number unless --decode-loop-max-seqs says otherwise;
    speculative decoding keeps the default loop off."""
    from jaxinfer.engine.args import AUTO_DECODE_STEPS, AUTO_LOOP_MAX_SEQS, EngineArgs
    assert EngineArgs().decode_loop() == (AUTO_DECODE_STEPS, AUTO_LOOP_MAX_SEQS) == (8, 8)
    assert EngineArgs(max_num_seqs=4).decode_loop() == (8, 4)
    assert EngineArgs(decode_steps_per_call=4).decode_loop() == (4, 256)
    assert EngineArgs(decode_steps_per_call=4, decode_loop_max_seqs=2).decode_loop() == (4, 2)
    assert EngineArgs(decode_steps_per_call=1).decode_loop()[0] == 1
    assert EngineArgs(speculative_method="ngram", num_speculative_tokens=2).decode_loop()[0] == 1


def _loop_sizes(engine, requests: int, late: int | None = None) -> list[tuple[int, bool]]:
    """(rows, is_loop) of each step of `requests` greedy requests; with `late`, one more request
    is added after that many loops ran: -1 marks the step that first schedules it."""
    steps: list[tuple[int, bool]] = []
    execute = engine.runner.execute

    def recording(sched):
        handle = execute(sched)
        late_in = any(e.seq.request.request_id == "late" for e in sched.scheduled)
        if late_in and not any(r == -1 for r, _ in steps):
            steps.append((-1, handle.is_loop))
        steps.append((len(sched.scheduled), handle.is_loop))
        return handle
    engine.runner.execute = recording
    for i, (prompt, _) in enumerate(WORKLOAD[:requests]):
        engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0.0, max_tokens=24,
                                                           ignore_eos=True))
    while engine.has_unfinished_requests():
        if late is not None and sum(loop for _, loop in steps) == late:
            engine.add_request("late", WORKLOAD[5][0], SamplingParams(max_tokens=4))
            late = None
        engine.step()
    assert_all_free(engine)
    return steps


def test_the_default_engine_loops_while_few_decode_and_none_waits():
    steps = _loop_sizes(make_engine(), 2, late=1)
    assert sum(loop for _, loop in steps) >= 2
    late = [i for i, (r, _) in enumerate(steps) if r == -1][0]
    # the late request's prefill came right after the loop it arrived during, in a single step
    assert steps[late - 1][1] and not steps[late][1]
    # past the loop limit: single steps only
    assert not any(loop for _, loop in _loop_sizes(make_engine(decode_loop_max_seqs=2), 3))
