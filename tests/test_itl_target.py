"""--itl-target-ms (issue 61): the step-time model the engine fits from its own steps, the cap it
derives for the scheduler, the flag's parsing and defaults, and the scheduler's decode-only cap.
(A short request beside a prefill burst on the demo model: tests/test_scheduler_fairness.py.)"""

from __future__ import annotations

import argparse
import types

import pytest

from jaxinfer.cli.main import build_parser
from jaxinfer.engine.args import EngineArgs
from jaxinfer.engine.itl_target import (AUTO, MAX_STEPS_WITHOUT_PROMPTS, MIN_PREFILL_TOKENS,
                                        ItlTarget, StepTimeModel, parse_itl_target)
from jaxinfer.errors import ConfigError
from jaxinfer.worker.buckets import Buckets

MS = 1e-3
BUCKETS = Buckets.make(max_num_seqs=64, max_num_batched_tokens=2048)  # tokens 16 .. 2048


def linear(model: StepTimeModel, sizes, base_ms=10.0, per_token_ms=0.02, times=3):
    for _ in range(times):
        for x in sizes:
            model.observe(x, (base_ms + per_token_ms * x) * MS)


def test_the_model_interpolates_the_measured_sizes_and_inverts_them():
    m = StepTimeModel()
    assert m.predict(64) is None and m.tokens_within(1.0) is None  # nothing measured
    linear(m, [64, 256, 1024])
    assert m.predict(256) == pytest.approx(15.12 * MS)
    assert m.predict(640) == pytest.approx((10 + 0.02 * 640) * MS)  # between two sizes
    assert m.predict(32) == pytest.approx(11.28 * MS / 2)  # below: proportional to the first
    assert m.tokens_within(20 * MS) == 500
    assert m.tokens_within((10 + 0.02 * 1024) * MS) == 1024


def test_the_model_reaches_one_doubling_past_its_largest_step():
    m = StepTimeModel()
    linear(m, [64, 128])  # a flat start says little about larger steps
    assert m.predict(256) == pytest.approx((10 + 0.02 * 256) * MS)
    assert m.predict(257) is None
    assert m.tokens_within(1.0) == 256  # however loose the target
    one = StepTimeModel()
    one.observe(100, 10 * MS)
    assert one.predict(200) == pytest.approx(20 * MS)  # one point: proportional


def test_one_slow_step_moves_nothing_and_times_never_fall_with_more_tokens():
    m = StepTimeModel()
    linear(m, [64, 512])
    m.observe(512, 5.0)  # a compile, a preempted host: not kept
    assert m.predict(512) == pytest.approx(20.24 * MS)
    assert m._steps[9][-1][1] == pytest.approx(20.24 * MS)
    m.observe(512, 5.0)
    m.observe(512, 5.0)  # two in a row: the step did get slower
    assert m.predict(512) == pytest.approx(20.24 * MS)  # (still the median of the last 8)
    for _ in range(3):
        m.observe(512, 5.0)
    assert m.predict(512) == 5.0
    m = StepTimeModel()
    for t in (30, 31, 29):
        m.observe(64, t * MS)
        m.observe(512, 20 * MS)  # noise: faster than the smaller step
    assert m.predict(512) == pytest.approx(30 * MS)


def handle(decodes: int, prompt_tokens: int, dispatch: float, ready: float, loop=False):
    prefills = [types.SimpleNamespace(num_tokens=prompt_tokens)] if prompt_tokens else []
    sched = types.SimpleNamespace(decodes=[None] * decodes, prefills=prefills, num_proposed=0,
                                  num_tokens=decodes + prompt_tokens)
    return types.SimpleNamespace(sched=sched, dispatch_time=dispatch, ready_time=ready,
                                 is_loop=loop)


def test_steps_are_timed_from_the_previous_result_and_the_first_of_a_shape_is_skipped():
    target = ItlTarget(30.0, None, BUCKETS)
    t = 100.0
    target.step_done(handle(64, 0, t, t + 0.5), 64)  # the first decode-64 step compiled
    assert target.model.predict(64) is None
    # Back to back: dispatched before the previous result came back, so timed from that result.
    target.step_done(handle(64, 0, t + 0.45, t + 0.51), 64)
    target.step_done(handle(64, 0, t + 0.5, t + 0.52), 64)
    assert target.model.predict(64) == pytest.approx(0.01)
    # After an idle gap: from its own dispatch.
    target.step_done(handle(64, 0, t + 5.0, t + 5.03), 64)
    target.step_done(handle(64, 0, t + 9.0, t + 9.03), 64)
    target.step_done(handle(64, 0, t + 12.0, t + 12.03), 64)
    assert target.model.curve() == ([64], [pytest.approx(0.03)])  # median of .01 .01 .03 .03 .03
    target.step_done(handle(8, 0, t + 20.0, t + 25.0, loop=True), 8)  # a decode loop: skipped
    target.step_done(handle(8, 0, t + 30.0, t + 35.0, loop=True), 8)
    assert target.model.curve()[0] == [64]


def test_a_fixed_target_caps_a_decoding_step_at_the_bucket_that_fits():
    target = ItlTarget(20.0, None, BUCKETS)
    # Nothing measured yet: the floor (64 decodes + MIN_PREFILL_TOKENS), filling its bucket.
    assert target.cap(64) == 128 > 64 + MIN_PREFILL_TOKENS
    linear(target.model, [64, 128, 256, 512, 1024, 2048], base_ms=10, per_token_ms=0.02)
    # 20 ms fit 500 tokens; the step pads to a bucket, so the cap is the bucket below: 256.
    assert target.cap(64) == 256
    assert target.cap(0) is None  # no decodes: the cap does not apply
    # 250 decodes: 500 tokens fit, but in the bucket below (256) prompts' quarter of the cap would
    # spill the step into 512 anyway, so the cap is what fits.
    assert target.cap(250) == 500
    assert ItlTarget(20.0, 128, BUCKETS, target.model).cap(64) == 128  # the flag bounds it too
    assert ItlTarget(None, 128, BUCKETS, target.model).cap(64) == 128  # off: the flag alone
    assert ItlTarget(None, None, BUCKETS, target.model).cap(64) is None


def test_auto_targets_twice_the_decodes_alone():
    target = ItlTarget(AUTO, None, BUCKETS)
    linear(target.model, [64, 128, 256, 512, 1024], base_ms=10, per_token_ms=0.02)
    # 64 decodes alone: 11.28 ms, so 22.56 ms: 628 tokens, bucket 512.
    assert target.target_seconds(64) == pytest.approx(2 * 11.28 * MS)
    assert target.cap(64) == 512
    assert target.cap(1024) == 2048  # slower decode steps, a larger budget (one doubling up)


def test_auto_counts_the_waiting_sequences_in_the_batch_they_will_make():
    """A burst of short requests is admitted at the pace of the batch it makes (host_path_h100's
    served c = 256 ran half-full steps when only the running decodes counted); a few long
    prompts beside many streams barely move the target."""
    target = ItlTarget(AUTO, None, BUCKETS, max_num_seqs=256)
    linear(target.model, [8, 64, 128, 256, 512, 1024], base_ms=10, per_token_ms=0.05)
    assert target.target_seconds(8) == pytest.approx(2 * 10.4 * MS)
    assert target.target_seconds(8, num_waiting=248) == pytest.approx(2 * 22.8 * MS)
    assert target.target_seconds(8, num_waiting=10_000) == target.target_seconds(8, 248)
    assert target.cap(8, num_waiting=248) > target.cap(8)
    assert target.target_seconds(64, num_waiting=4) == pytest.approx(2 * 13.4 * MS)
    # Past a doubling of the largest step measured the curve is unknown: the target stops there.
    short = ItlTarget(AUTO, None, BUCKETS)
    linear(short.model, [8, 16], base_ms=10, per_token_ms=0.02)
    assert short.target_seconds(8, num_waiting=500) == pytest.approx(2 * short.model.predict(32))


def test_where_no_prompt_step_fits_prompts_run_in_a_duty_cycle_and_never_starve():
    target = ItlTarget(20.0, None, BUCKETS)
    for _ in range(3):
        target.model.observe(1, 10 * MS)   # decode step
        target.model.observe(16, 50 * MS)  # the smallest step with prompt tokens
    # (50 - 10) / (20 - 10): one prompt step in 4 keeps the mean at the target.
    caps = [target.cap(1) for _ in range(8)]
    assert caps == [0, 0, 0, 16] * 2
    assert target.cap(1) == 0
    slow = ItlTarget(5.0, None, BUCKETS, target.model)  # even decoding alone misses it
    assert [slow.cap(1) for _ in range(3)] == [16] * 3
    for _ in range(8):
        target.model.observe(16, 1.0)  # a prompt step far slower: at most 7 steps skipped
    caps = [target.cap(1) for _ in range(2 * (MAX_STEPS_WITHOUT_PROMPTS + 1))]
    assert caps.count(16) == 2 and max(len(run) for run in "".join(
        "p" if c else "." for c in caps).split("p")) <= MAX_STEPS_WITHOUT_PROMPTS


def test_the_flag_parses_and_defaults_to_auto_for_serve_only():
    assert parse_itl_target("auto") == AUTO and parse_itl_target("off") is None
    assert parse_itl_target("25") == 25.0
    for bad in ("0", "-3", "fast", "nan", "inf"):
        with pytest.raises(argparse.ArgumentTypeError, match="milliseconds"):
            parse_itl_target(bad)
    with pytest.raises(ConfigError, match="itl-target-ms"):
        EngineArgs(model="tiny", itl_target_ms=0)
    assert EngineArgs(model="tiny").itl_target_ms is None  # offline LLM: off
    parser = build_parser()
    assert parser.parse_args(["serve"]).itl_target_ms == AUTO
    assert parser.parse_args(["serve", "--itl-target-ms", "off"]).itl_target_ms is None
    assert parser.parse_args(["serve", "--itl-target-ms", "40"]).itl_target_ms == 40.0
    assert parser.parse_args(["generate", "--prompt", "x"]).itl_target_ms is None


def test_a_zero_cap_makes_a_decoding_step_decode_only():
    from jaxinfer.sampling_params import SamplingParams
    from test_engine_support import make_engine, prompt_ids
    engine = make_engine()
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=8)
    engine.add_request("a", prompt_ids(1, 4), params)
    engine.step()
    engine.add_request("b", prompt_ids(2, 30), params)
    engine.scheduler.max_step_tokens_while_decoding = 0
    out = engine.scheduler.schedule()
    assert len(out.decodes) == 1 and not out.prefills  # "b" waits a step
    engine.scheduler.max_step_tokens_while_decoding = 1
    out = engine.scheduler.schedule()
    assert [(e.seq.request.request_id, e.num_tokens) for e in out.scheduled] == [
        ("a", 1), ("b", 1)]  # any other cap: prompts still advance
