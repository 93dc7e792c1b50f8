"""Disaggregated requests with n > 1 on CPU: the prefill engine computes the prompt once and forks
it, each choice sampling its own first token as a plain engine does, and the decode side adopts
every choice handed off (frontends/disaggregated.py `Transit`). Greedy and seeded choices equal a
plain engine's, a choice whose first token finishes it stays finished, and aborts mid-transfer
leak no block on either side.

Both engines share the one CPU device (the device-to-device copy is tests/test_disagg.py's)."""

from __future__ import annotations

import pytest

from jaxinfer.engine.args import EngineArgs
from jaxinfer.engine.llm_engine import LLMEngine
from jaxinfer.frontends.disaggregated import DisaggregatedEngine
from jaxinfer.sampling_params import SamplingParams
from test_engine_support import (BLOCK, MAX_LEN, NUM_BLOCKS, assert_all_free,
                                 one_device_disaggregated, prompt_ids, run_all, tiny_model,
                                 tiny_tokenizer)

pytestmark = pytest.mark.filterwarnings("error:Some donated buffers were not usable")

ARGS = dict(model="tiny", max_model_len=MAX_LEN, block_size=BLOCK, num_blocks=NUM_BLOCKS,
            max_num_seqs=8, max_num_batched_tokens=32, long_prefill_chunk=32,
            compilation_cache_dir=None, warmup=False, dtype="float32", background_compile=False,
            decode_steps_per_call=1)
PROMPTS = {"greedy": prompt_ids(60, 9), "seeded": prompt_ids(61, 7), "short": prompt_ids(62, 1),
           "logprobs": prompt_ids(63, 12)}
PARAMS = {"greedy": SamplingParams(n=2, temperature=0.0, max_tokens=6, ignore_eos=True),
          "seeded": SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=6, ignore_eos=True),
          "short": SamplingParams(n=2, temperature=1.0, seed=6, max_tokens=5, ignore_eos=True),
          "logprobs": SamplingParams(n=3, temperature=0.8, seed=7, max_tokens=4, logprobs=2,
                                     ignore_eos=True)}


def plain_engine() -> LLMEngine:
    cfg, params = tiny_model()
    return LLMEngine(cfg, params, tiny_tokenizer(), EngineArgs(**ARGS), num_blocks=NUM_BLOCKS)


@pytest.fixture(scope="module")
def disagg() -> DisaggregatedEngine:
    cfg, params = tiny_model()
    return one_device_disaggregated(cfg, params, tiny_tokenizer(), EngineArgs(**ARGS), NUM_BLOCKS)


@pytest.fixture(scope="module")
def plain() -> LLMEngine:
    return plain_engine()


def run(e, requests: dict) -> dict:
    for rid, (prompt, params) in requests.items():
        e.add_request(rid, prompt, params)
    return run_all(e)


def assert_nothing_held(d: DisaggregatedEngine) -> None:
    assert not d.requests and not d._transit and not d._waiting and not d._in_flight
    for side in (d.prefill, d.decode):
        assert_all_free(side)


def test_choices_equal_a_plain_engine(disagg, plain):
    requests = {rid: (PROMPTS[rid], PARAMS[rid]) for rid in PROMPTS}
    expected = run(plain, requests)
    assert expected["greedy"][0] == expected["greedy"][1]
    assert expected["seeded"][0] != expected["seeded"][1]  # the choices sample apart
    transfers = disagg.transfer_metrics.transfers._value.get()
    assert run(disagg, requests) == expected
    # Every choice was handed over (a 1-token prompt's choices too: no prompt sequence).
    assert disagg.transfer_metrics.transfers._value.get() - transfers == 2 + 2 + 2 + 3
    assert_nothing_held(disagg)


def test_a_choice_its_first_token_finishes_stays_finished(disagg, plain):
    """Choice 1's first token made a stop token: it finishes on the prefill side while choice 0
    is handed over and goes on, as in a plain engine."""
    prompt, params = PROMPTS["seeded"], PARAMS["seeded"]
    first = run(plain, {"probe": (prompt, params)})["probe"]
    stop = first[1][0][0]
    assert first[0][0][0] != stop
    stopping = SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=6, ignore_eos=True,
                              stop_token_ids=[stop])
    expected = run(plain, {"stop": (prompt, stopping)})
    assert expected["stop"][1][2] == "stop" and len(expected["stop"][1][0]) == 1
    transfers = disagg.transfer_metrics.transfers._value.get()
    assert run(disagg, {"stop": (prompt, stopping)}) == expected
    assert disagg.transfer_metrics.transfers._value.get() - transfers == 1
    assert_nothing_held(disagg)


def test_aborts_between_the_engines_leak_nothing(disagg, plain):
    """Aborted with its copies waiting, in flight, or one landed and the other not."""
    prompt, params = PROMPTS["greedy"], PARAMS["greedy"]
    for stage in ("waiting", "in_flight", "one_landed"):
        land, start = disagg._land, disagg._start_transfers
        # Hold the copies back at `stage` (the decode side's room, the transfer's landing).
        if stage == "waiting":
            disagg._start_transfers = lambda: None
        disagg._land = (lambda wait=False: None) if stage != "one_landed" else (
            lambda wait=False: _land_first(disagg, land))
        try:
            disagg.add_request(stage, prompt, params)
            for _ in range(20):
                disagg.step()
                t = disagg._transit.get(stage)
                if t is not None and t.request is not None and {
                        "waiting": len(disagg._waiting) == 2,
                        "in_flight": len(disagg._in_flight) == 2,
                        "one_landed": sum(h.landed for h in t.handoffs) == 1}[stage]:
                    break
            else:
                raise AssertionError(f"never reached {stage}")
        finally:
            disagg._land, disagg._start_transfers = land, start
        out = disagg.abort(stage)
        assert out.finished and [c.finish_reason for c in out.outputs] == ["abort", "abort"]
        assert_nothing_held(disagg)
    # The engines go on serving.
    assert run(disagg, {"after": (prompt, params)}) == run(plain, {"after": (prompt, params)})
    assert_nothing_held(disagg)


def _land_first(d: DisaggregatedEngine, land) -> None:
    """Land only the first copy of a request's two."""
    if len(d._in_flight) == 2:
        held = d._in_flight.pop()
        d._in_flight[0].buffer.block_until_ready()
        land()
        d._in_flight.append(held)


@pytest.mark.parametrize("end", ["abort", "prefill_failure"])
def test_a_request_with_choices_on_both_sides_ends_leaking_nothing(disagg, plain, end):
    """Choice 0 handed off while choice 1 is still on the prefill side (its hand-off held back
    here: choices forked together hand off in one step otherwise), then the request aborted (both
    choices reported aborted) or failed by the prefill side (the hand-over dropped)."""
    outputs = disagg.prefill.outputs
    finish = outputs.finish

    def hold_back_choice_1(seq, reason, stop_reason):
        if seq.index != 1:
            finish(seq, reason, stop_reason)
    outputs.finish = hold_back_choice_1
    try:
        disagg.add_request(end, PROMPTS["greedy"], PARAMS["greedy"])
        for _ in range(20):
            disagg.step()
            t = disagg._transit.get(end)
            if t is not None and t.handoffs:
                break
        else:
            raise AssertionError("choice 0 never handed off")
    finally:
        del outputs.finish
    assert t.request is None and end in disagg.prefill.requests
    if end == "abort":
        out = disagg.abort(end)
        assert out.finished and sorted((c.index, c.finish_reason) for c in out.outputs) == [
            (0, "abort"), (1, "abort")]
    else:
        disagg.prefill._fail(end, RuntimeError("a row failed"))
        assert run_all(disagg) == {}
        assert [rid for rid, _ in disagg.take_failed()] == [end]
    assert_nothing_held(disagg)
