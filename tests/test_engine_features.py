"""Engine behaviours beyond greedy equality: n > 1 forks, stop strings split across tokens,
min_tokens, aborts mid-prefill and mid-decode, request validation, priorities, the compilation bound
and KV-cache donation."""

from __future__ import annotations

import contextlib
import warnings

import jax
import jax.numpy as jnp
import pytest

from jaxinfer.frontends.llm import LLM
from jaxinfer.errors import InvalidRequestError
from jaxinfer.sampling_params import SamplingParams
from jaxinfer.structured import StructuredOutputsParams
from test_engine_support import (MAX_LEN, assert_all_free, make_engine, prompt_ids, run_all,
                                 tiny_tokenizer)

# A step whose KV cache could not be donated would copy the whole cache every step.
pytestmark = pytest.mark.filterwarnings("error:Some donated buffers were not usable")

GREEDY = dict(temperature=0.0, ignore_eos=True)


def test_n3_choices_share_the_prompt_blocks():
    engine = make_engine(long_prefill_chunk=4)
    prompt = prompt_ids(11, 14)  # 13 shared tokens = 3 full blocks + 1 token in a shared block
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=6, ignore_eos=True)
    engine.add_request("r", prompt, params)
    shared_seen = False
    results: dict = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            for c in out.outputs:
                results[c.index] = c.token_ids
        choices = [s for s in engine.scheduler.running if s.index >= 0]
        if len(choices) == 3 and not shared_seen:
            tables = [engine.scheduler.kv.get_block_ids(s.seq_id) for s in choices]
            assert tables[0][:3] == tables[1][:3] == tables[2][:3]  # the 3 full prompt blocks
            assert len({t[3] for t in tables}) == 3  # the partly filled block was copied (COW)
            shared_seen = True
    assert shared_seen and len(results) == 3
    assert len({tuple(t) for t in results.values()}) > 1  # the choices sample differently
    # Choice 0 samples exactly as the n == 1 request with the same seed.
    single = make_engine()
    single.add_request("s", prompt, SamplingParams(temperature=1.0, seed=5, max_tokens=6,
                                                   ignore_eos=True))
    assert run_all(single)["s"][0][0] == results[0]
    assert_all_free(engine)


def _greedy_text(engine, prompt, max_tokens=16):
    engine.add_request("probe", prompt, SamplingParams(max_tokens=max_tokens, **GREEDY))
    ids, text, _ = run_all(engine)["probe"][0]
    return ids, text


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_across_token_boundary_is_never_streamed(include):
    engine = make_engine()
    tok = tiny_tokenizer()
    prompt = prompt_ids(21, 5)
    ids, text = _greedy_text(engine, prompt)
    # The last character of one token's text + the first character of the next token's text.
    pieces = [tok.decode([t]) for t in ids]
    ends = [sum(len(p) for p in pieces[:i + 1]) for i in range(len(pieces))]
    k = next(i for i in range(2, len(pieces)) if pieces[i - 1] and pieces[i])
    stop = text[ends[k - 1] - 1:ends[k - 1] + 1]
    first = text.find(stop)
    engine.add_request("s", prompt, SamplingParams(max_tokens=16, stop=[stop],
                                                   include_stop_str_in_output=include, **GREEDY))
    streamed = ""
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            c = out.outputs[0]
            streamed += c.new_text
            final = c
    want = text[:first + len(stop)] if include else text[:first]
    assert streamed == final.text == want
    assert final.finish_reason == "stop" and final.stop_reason == stop
    assert_all_free(engine)


def test_stop_token_id_and_min_tokens():
    engine = make_engine()
    prompt = prompt_ids(31, 4)
    ids, _ = _greedy_text(engine, prompt, 20)
    target = ids[1]
    first = ids.index(target)
    engine.add_request("a", prompt, SamplingParams(max_tokens=20, stop_token_ids=[target], **GREEDY))
    out = run_all(engine)["a"][0]
    assert out[0] == ids[:first + 1] and out[2] == "stop"
    engine.add_request("b", prompt, SamplingParams(max_tokens=20, stop_token_ids=[target],
                                                   min_tokens=first + 3, **GREEDY))
    got = run_all(engine)["b"][0][0]
    assert target not in got[:first + 3]  # banned while short of min_tokens
    assert len(got) >= first + 3
    assert_all_free(engine)


def test_abort_mid_prefill_and_mid_decode_frees_everything():
    engine = make_engine(long_prefill_chunk=3)
    engine.add_request("prefill", prompt_ids(41, 30), SamplingParams(max_tokens=10, **GREEDY))
    engine.add_request("decode", prompt_ids(42, 3), SamplingParams(max_tokens=40, **GREEDY))
    engine.add_request("fork", prompt_ids(43, 20), SamplingParams(n=3, max_tokens=10, **GREEDY))
    engine.step()
    engine.step()
    prefill_seq = engine.requests["prefill"].choices[0]
    assert 0 < prefill_seq.num_computed < 30  # still in its prompt
    out = engine.abort("prefill")
    assert out.finished and out.outputs[0].finish_reason == "abort"
    out = engine.abort("fork")  # its shared prompt part is still being computed: no choice yet
    assert out.finished and [c.finish_reason for c in out.outputs] == ["abort"] * 3
    for _ in range(4):
        engine.step()
    assert engine.requests["decode"].choices[0].num_output_tokens > 0
    engine.abort("decode")
    while engine.has_unfinished_requests():
        assert not engine.step()  # nothing more is reported for aborted requests
    assert_all_free(engine)
    assert engine.abort("decode") is None


@pytest.mark.parametrize("prompt,params,param", [
    ([], SamplingParams(), "prompt"),
    ([10_000], SamplingParams(), "prompt"),
    ([2] * (MAX_LEN - 4), SamplingParams(max_tokens=8), "max_tokens"),
    ([2] * MAX_LEN, SamplingParams(max_tokens=1), "prompt"),
    ([2, 3], SamplingParams(top_p=2.0), "top_p"),
])
def test_invalid_requests_are_rejected_before_scheduling(prompt, params, param):
    engine = make_engine()
    with pytest.raises(InvalidRequestError) as e:
        engine.add_request("bad", prompt, params)
    assert e.value.param == param
    assert not engine.has_unfinished_requests() and engine.num_waiting == 0


def test_priority_is_honoured_when_given():
    engine = make_engine(max_num_seqs=8, max_num_batched_tokens=8, long_prefill_chunk=8)
    engine.add_request("low", prompt_ids(1, 8), SamplingParams(max_tokens=1, **GREEDY), priority=5)
    engine.add_request("high", prompt_ids(2, 8), SamplingParams(max_tokens=1, **GREEDY), priority=0)
    sched = engine.scheduler.schedule()
    assert [s.seq.request.request_id for s in sched.scheduled] == ["high"]


def test_llm_generate_text_and_token_prompts():
    llm = LLM(engine=make_engine())
    outs = llm.generate(["abcd", prompt_ids(3, 5)], SamplingParams(max_tokens=5, **GREEDY),
                        use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [5, 5]
    assert outs[0].prompt_token_ids == tiny_tokenizer().encode("abcd")
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in outs)


@contextlib.contextmanager
def counting_compilations():
    """Yields a one-element list that counts the XLA backend compilations (cache hits excluded,
    any function) while inside, from jax's monitoring events."""
    count = [0]

    def listener(event: str, duration_s: float, **_) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            count[0] += 1

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield count
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


def test_mixed_workload_compiles_nothing_beyond_warmup_and_donates_the_cache():
    engine = make_engine(num_blocks=96, decode_steps_per_call=3, long_prefill_chunk=5)
    prompts = [prompt_ids(60 + i, 2 + 3 * i) for i in range(12)]
    with warnings.catch_warnings(), counting_compilations() as compilations:
        warnings.filterwarnings("error", message=".*[Dd]onat.*")
        before_warmup = compilations[0]
        engine.warmup(progress=False)
        compiled = compilations[0]
        # The bound: forward per step bucket, sampler per sequence bucket x 3 variants (base, full,
        # masked), loop per decode bucket x 2 (never masked), block copy per copy bucket. (The
        # steps take their packed inputs whole: no unpacking jit.) Forwards and loops see the
        # pool size, which no other test uses, so they are fresh compilations; a sampler may come
        # from an earlier test.
        shapes = engine.runner.warmup_shapes()
        fresh = [s for s in shapes if s[0] in ("mixed", "decode", "loop")]
        assert len(fresh) <= compiled - before_warmup <= len(shapes) == 9
        kv_before = engine.runner.kv_cache[0][0]
        kinds = [SamplingParams(max_tokens=9, **GREEDY),
                 SamplingParams(temperature=0.8, max_tokens=7, seed=3),
                 SamplingParams(temperature=0.7, top_k=5, top_p=0.9, logprobs=2, max_tokens=6),
                 SamplingParams(n=2, temperature=1.0, max_tokens=5),
                 SamplingParams(repetition_penalty=1.3, frequency_penalty=0.5, max_tokens=6),
                 SamplingParams(max_tokens=6, structured_outputs=StructuredOutputsParams(
                     regex="[a-z ]+"))]
        for i in range(12):
            engine.add_request(f"r{i}", prompts[i], kinds[i % len(kinds)])
            engine.step()
        run_all(engine)
        assert compilations[0] == compiled
        jax.jit(lambda x: x * 3 + 1)(jnp.arange(7))  # the counter does count compilations
        assert compilations[0] > compiled
    assert kv_before.is_deleted()  # donated: the step reused its buffer instead of copying
    assert_all_free(engine)


def test_requests_and_pools_that_could_never_run_are_refused():
    # n choices decode side by side: more than --max-num-seqs would wait forever for slots.
    engine = make_engine(max_num_seqs=4)
    with pytest.raises(InvalidRequestError, match="max-num-seqs") as e:
        engine.add_request("r", prompt_ids(1, 6), SamplingParams(n=5))
    assert e.value.param == "n" and not engine.has_unfinished_requests()
    # A pool smaller than one max_model_len sequence (64 tokens) would stall it forever.
    from jaxinfer.errors import ConfigError
    with pytest.raises(ConfigError, match="num-blocks"):
        make_engine(num_blocks=15)


def test_engine_args_cli_round_trip_and_errors():
    import argparse
    from jaxinfer.engine.args import EngineArgs
    from jaxinfer.errors import ConfigError
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    ns = parser.parse_args(["--model", "m", "--max-num-seqs", "4", "--max-num-batched-tokens", "64",
                            "--no-enable-prefix-caching", "--no-warmup", "--decode-steps-per-call",
                            "8", "--decode-loop-max-seqs", "2", "--block-size", "32",
                            "--served-model-name", "demo"])
    args = EngineArgs.from_cli_args(ns)
    assert (args.max_num_seqs, args.max_num_batched_tokens, args.decode_steps_per_call) == (4, 64, 8)
    assert args.decode_loop() == (8, 2)
    assert EngineArgs.from_cli_args(parser.parse_args([])).decode_steps_per_call is None
    assert not args.enable_prefix_caching and not args.warmup and args.block_size == 32
    assert args.model_name == "demo"
    with pytest.raises(ConfigError, match="max-num-batched-tokens"):
        EngineArgs(max_num_seqs=8, max_num_batched_tokens=4)


def test_profile_dir_writes_a_trace(tmp_path):
    engine = make_engine(profile_dir=str(tmp_path), profile_steps=2)
    engine.add_request("r", prompt_ids(1, 5), SamplingParams(max_tokens=4, **GREEDY))
    run_all(engine)
    assert list(tmp_path.rglob("*.xplane.pb"))
