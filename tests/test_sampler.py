"""The in-jit sampler: each filter against a numpy reading of its definition, seeded reproducibility
whatever the batch, logprobs against the model's raw distribution."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.errors import InvalidRequestError
from jaxinfer.worker.sampler import BASE_SAMPLER, FULL_SAMPLER, SamplingTensors, sample
from jaxinfer.sampling_params import MAX_STOP_TOKEN_IDS, SamplingParams
from test_engine_support import make_engine, prompt_ids, run_all

# A step whose KV cache could not be donated would copy the whole cache every step.
pytestmark = pytest.mark.filterwarnings("error:Some donated buffers were not usable")

V = 12


def tensors(s: int, **overrides) -> SamplingTensors:
    base = dict(temperature=np.ones(s, np.float32), top_k=np.zeros(s, np.int32),
                top_p=np.ones(s, np.float32), min_p=np.zeros(s, np.float32),
                seed=np.arange(s, dtype=np.uint32), out_pos=np.zeros(s, np.int32),
                min_tokens=np.zeros(s, np.int32),
                stop_ids=np.full((s, MAX_STOP_TOKEN_IDS), -1, np.int32),
                repetition_penalty=np.ones(s, np.float32), presence_penalty=np.zeros(s, np.float32),
                frequency_penalty=np.zeros(s, np.float32), history=np.full((s, 8), -1, np.int32),
                prompt_len=np.zeros(s, np.int32))
    base.update(overrides)
    return SamplingTensors(**{k: jnp.asarray(v) for k, v in base.items()})


def draw(logits: np.ndarray, n: int, variant=FULL_SAMPLER, **kw) -> np.ndarray:
    """n samples of one row of logits: rows share the logits, differ by seed."""
    rows = jnp.broadcast_to(jnp.asarray(logits, jnp.float32), (n, logits.shape[-1]))
    kw = {k: np.broadcast_to(np.asarray(v), (n,) + np.asarray(v).shape[1:]).copy()
          for k, v in kw.items()}
    return np.asarray(jax.jit(sample, static_argnums=2)(rows, tensors(n, **kw), variant).tokens)


LOGITS = np.array([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -1.5, -2.0, -2.5, -3.0, -3.5], np.float32)


def test_greedy_is_argmax_and_unseeded_noise_is_ignored():
    toks = draw(LOGITS[::-1], 16, BASE_SAMPLER, temperature=np.zeros(1, np.float32))
    assert (toks == V - 1).all()


def test_temperature_sampling_follows_softmax():
    n = 4000
    toks = draw(LOGITS, n, BASE_SAMPLER, temperature=np.full(1, 0.8, np.float32))
    freq = np.bincount(toks, minlength=V) / n
    p = np.exp(LOGITS / 0.8) / np.exp(LOGITS / 0.8).sum()
    assert np.abs(freq - p).max() < 0.03


_P = np.exp(LOGITS) / np.exp(LOGITS).sum()


@pytest.mark.parametrize("field,value,allowed", [
    ("top_k", 3, {0, 1, 2}),
    # the smallest set whose mass reaches top_p: p0 < top_p <= p0 + p1 keeps tokens 0 and 1
    ("top_p", _P[0] + _P[1] / 2, {0, 1}),
    ("top_p", _P[0] / 2, {0}),
    ("min_p", 0.5, {0, 1}),            # p1/p0 = e^-0.5 = .61 >= .5, p2/p0 = .37 < .5
])
def test_truncation_keeps_only_the_allowed_tokens(field, value, allowed):
    dtype = np.int32 if field == "top_k" else np.float32
    toks = draw(LOGITS, 2000, **{field: np.full(1, value, dtype)})
    assert set(toks.tolist()) == allowed


def test_penalties_follow_vllm_definitions():
    logits = np.array([[1.0, -1.0, 2.0, 0.5]], np.float32)
    hist = np.array([[0, 1, 2, 2, -1, -1, -1, -1]], np.int32)  # prompt [0, 1]; output [2, 2]
    from jaxinfer.worker.sampler import apply_penalties, token_counts
    t = tensors(1, repetition_penalty=np.full(1, 2.0, np.float32),
                presence_penalty=np.full(1, 0.5, np.float32),
                frequency_penalty=np.full(1, 0.25, np.float32), history=hist,
                prompt_len=np.full(1, 2, np.int32))
    counts, seen = token_counts(t.history, t.prompt_len, 4)
    out = np.asarray(apply_penalties(jnp.asarray(logits), counts, seen, t))
    want = np.array([[1.0 / 2, -1.0 * 2, 2.0 / 2 - 0.25 * 2 - 0.5, 0.5]], np.float32)
    np.testing.assert_allclose(out, want, rtol=1e-6)


def test_min_tokens_bans_stop_ids_until_reached():
    stop = np.full((1, MAX_STOP_TOKEN_IDS), -1, np.int32)
    stop[0, 0] = 0
    greedy = dict(temperature=np.zeros(1, np.float32), stop_ids=stop,
                  min_tokens=np.full(1, 3, np.int32))
    assert (draw(LOGITS, 4, BASE_SAMPLER, out_pos=np.full(1, 2, np.int32), **greedy) == 1).all()
    assert (draw(LOGITS, 4, BASE_SAMPLER, out_pos=np.full(1, 3, np.int32), **greedy) == 0).all()


@pytest.mark.parametrize("params,param", [
    (dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p"), (dict(top_k=-2), "top_k"),
    (dict(min_p=1.5), "min_p"), (dict(n=0), "n"), (dict(max_tokens=0), "max_tokens"),
    (dict(min_tokens=5, max_tokens=2), "min_tokens"), (dict(logprobs=21), "logprobs"),
    (dict(stop_token_ids=[10_000]), "stop_token_ids"), (dict(stop=[""]), "stop"),
    (dict(presence_penalty=3), "presence_penalty"), (dict(repetition_penalty=0), "repetition_penalty"),
    (dict(seed=1.5), "seed"), (dict(temperature=float("nan")), "temperature"),
])
def test_validation_names_the_field(params, param):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**params).validate(vocab_size=100)
    assert e.value.param == param and param in str(e.value)


# ---- engine level -------------------------------------------------------------------------------

def _seeded(engine, others: int, other_params: SamplingParams) -> list[int]:
    engine.add_request("target", prompt_ids(1, 6), SamplingParams(temperature=0.9, seed=1234,
                                                                  max_tokens=12, ignore_eos=True))
    for i in range(others):
        engine.add_request(f"o{i}", prompt_ids(50 + i, 3 + i), other_params)
    return run_all(engine)["target"][0][0]


def test_seeded_sampling_is_reproducible_across_batches():
    alone = _seeded(make_engine(), 0, SamplingParams())
    mixed = _seeded(make_engine(), 5, SamplingParams(temperature=1.0, top_p=0.8, max_tokens=20,
                                                     logprobs=2))  # full sampler variant
    looped = _seeded(make_engine(decode_steps_per_call=3), 2, SamplingParams(max_tokens=4))
    assert alone == mixed == looped
    other_seed = make_engine()
    other_seed.add_request("t", prompt_ids(1, 6), SamplingParams(temperature=0.9, seed=99,
                                                                 max_tokens=12, ignore_eos=True))
    assert run_all(other_seed)["t"][0][0] != alone


@pytest.mark.parametrize("s, v", [(1, 5), (3, 12), (6, 37)])
def test_every_variant_returns_the_sampled_tokens_raw_logprob(s, v):
    """The base variant too (what logprobs=0 runs), equal to the full one's to the bit."""
    logits = jnp.asarray(np.random.default_rng(s * v).normal(scale=3, size=(s, v)), jnp.float32)
    temp = np.where(np.arange(s) % 2, 0.7, 0.0).astype(np.float32)  # greedy and sampled rows
    t = tensors(s, temperature=temp, num_top_logprobs=np.zeros(s, np.int32))
    run = jax.jit(sample, static_argnums=2)
    base, full = run(logits, t, BASE_SAMPLER), run(logits, t, FULL_SAMPLER)
    assert (base.tokens == full.tokens).all() and (base.logprob == full.logprob).all()
    ref = np.asarray(jax.nn.log_softmax(logits, axis=-1))[np.arange(s), np.asarray(base.tokens)]
    np.testing.assert_allclose(np.asarray(base.logprob), ref, atol=1e-5)
    assert base.top_ids is None


@pytest.mark.parametrize("logprobs, temperature", [(3, 0.0), (0, 1.0)])
def test_logprobs_are_the_raw_model_logprobs(logprobs, temperature):
    from test_engine_greedy import _dense_logits, MAX_LEN
    engine = make_engine()
    prompt = prompt_ids(3, 7)
    params = dict(temperature=temperature, seed=11, max_tokens=4, ignore_eos=True)
    request = engine.add_request("r", prompt, SamplingParams(**params, logprobs=logprobs))
    # logprobs=0 runs the base sampler variant (the sampled token's logprob rides with the token)
    assert request.needs_full_sampler == bool(logprobs)
    lps = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            lps += out.outputs[0].new_logprobs
    toks = [lp.token_id for lp in lps]
    buf = np.zeros((1, MAX_LEN), np.int32)
    seq = prompt + toks
    buf[0, :len(seq)] = seq
    ref = jax.nn.log_softmax(_dense_logits()(jnp.asarray(buf))[0], axis=-1)
    for i, lp in enumerate(lps):
        row = np.asarray(ref[len(prompt) - 1 + i])
        assert lp.logprob == pytest.approx(float(row[lp.token_id]), abs=1e-4)
        assert [t for t, _ in lp.top] == list(np.argsort(-row)[:logprobs])
        if logprobs:
            assert lp.top[0][0] == lp.token_id  # greedy: the sampled token is the most likely
    engine.add_request("plain", prompt, SamplingParams(**params))
    assert run_all(engine)["plain"][0][0] == toks  # asking for logprobs changes no token


def _mixed_params(i: int, max_tokens: int) -> SamplingParams:
    kinds = [dict(temperature=0.9), dict(temperature=0.7, top_p=0.8),
             dict(temperature=1.0, top_k=5, logprobs=2),
             dict(temperature=0.8, repetition_penalty=1.2, presence_penalty=0.3),
             dict(temperature=0.0)]
    return SamplingParams(n=1 + i % 2, max_tokens=max_tokens, seed=1000 + i,
                          stop=["ab"] if i % 3 == 0 else [], **kinds[i % len(kinds)])


def test_seeded_outputs_do_not_depend_on_the_schedule():
    """Each request run alone vs. all of them under random schedules (arrivals, chunk sizes, a pool
    small enough to preempt, decode loop on/off, overlap on/off): identical tokens, text and finish
    reasons for every choice, with top-p/top-k/penalties/logprobs/stop strings/n = 2 in the mix."""
    from test_engine_greedy import WORKLOAD
    solo = {}
    for i, (prompt, m) in enumerate(WORKLOAD):
        engine = make_engine()
        engine.add_request("x", prompt, _mixed_params(i, m))
        solo[i] = run_all(engine)["x"]
    for seed in range(3):
        rng = np.random.default_rng(seed)
        engine = make_engine(num_blocks=24, long_prefill_chunk=int(rng.integers(2, 9)),
                             decode_steps_per_call=int(rng.choice([1, 3])),
                             async_scheduling=bool(seed % 2))
        todo = list(range(len(WORKLOAD)))
        rng.shuffle(todo)
        got: dict = {}
        while todo or engine.has_unfinished_requests():
            if todo and rng.random() < 0.7:
                i = todo.pop()
                engine.add_request(f"r{i}", WORKLOAD[i][0], _mixed_params(i, WORKLOAD[i][1]))
            for out in engine.step():
                for c in out.outputs:
                    got.setdefault(int(out.request_id[1:]), {})[c.index] = (
                        c.token_ids, c.text, c.finish_reason)
        assert got == solo
        assert engine.scheduler.kv.num_free_blocks == engine.num_total_blocks


def test_full_variant_skips_unused_extras_without_changing_any_row():
    """A batch in the full variant only for logprobs skips the sort and the penalty scatter on the
    device: its tokens are the base variant's. One row with top_k=1 (or a penalty) turns them on
    for the batch, which changes that row only."""
    n = 16
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(n, V)), jnp.float32)
    history = np.tile(np.arange(8, dtype=np.int32), (n, 1))  # every row has seen tokens 0..7
    run = jax.jit(sample, static_argnums=2)
    base = np.asarray(run(logits, tensors(n, history=history), BASE_SAMPLER).tokens)
    full = np.asarray(run(logits, tensors(n, history=history), FULL_SAMPLER).tokens)
    assert (full == base).all()
    top1 = np.zeros(n, np.int32)
    top1[3] = 1
    trunc = np.asarray(run(logits, tensors(n, top_k=top1, history=history), FULL_SAMPLER).tokens)
    assert trunc[3] == int(jnp.argmax(logits[3])) and (np.delete(trunc, 3) == np.delete(base, 3)).all()
    rep = np.ones(n, np.float32)
    rep[5] = 1e6  # every seen token (0..7) is all but banned for row 5
    pen = np.asarray(run(logits, tensors(n, repetition_penalty=rep, history=history),
                         FULL_SAMPLER).tokens)
    assert pen[5] >= 8 and (np.delete(pen, 5) == np.delete(base, 5)).all()
    # logprobs=0 everywhere: no top-k of the vocabulary; the sampled tokens' logprobs are the same.
    with_top = run(logits, tensors(n, history=history, num_top_logprobs=np.ones(n, np.int32)),
                   FULL_SAMPLER)
    no_top = run(logits, tensors(n, history=history, num_top_logprobs=np.zeros(n, np.int32)),
                 FULL_SAMPLER)
    assert (no_top.tokens == with_top.tokens).all() and (no_top.logprob == with_top.logprob).all()
    assert (with_top.top_ids[:, 0] == jnp.argmax(logits, -1)).all() and (no_top.top_ids == 0).all()


def test_full_variant_batches_without_penalties_keep_the_history_on_the_device():
    """No [S, max_model_len] history crosses from the host unless a row uses penalties."""
    engine = make_engine()
    built = []
    build = engine.runner.build

    def spy(sched):
        built.append(build(sched))
        return built[-1]
    engine.runner.build = spy
    engine.add_request("top-p", prompt_ids(1, 5),
                       SamplingParams(temperature=0.8, top_p=0.9, seed=1, max_tokens=3))
    run_all(engine)
    history = [batch.sampling.history for batch, variant, _ in built if variant.penalties]
    assert history and all(h is history[0] for h in history)  # one device array, reused
    assert isinstance(history[0], jax.Array) and (np.asarray(history[0]) == -1).all()
    built.clear()
    prompt = prompt_ids(2, 5)
    engine.add_request("penalised", prompt, SamplingParams(temperature=0.8, repetition_penalty=1.3,
                                                           seed=1, max_tokens=3))
    run_all(engine)
    history = [batch.sampling.history for batch, variant, _ in built]
    assert all(isinstance(h, np.ndarray) for h in history)
    assert history[-1][0, :len(prompt)].tolist() == prompt
