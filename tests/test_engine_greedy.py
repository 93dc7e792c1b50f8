"""Greedy outputs of the engine equal a cache-free oracle (dense causal forward, argmax) whatever the
scheduling: one request at a time, continuous batching of 16 mixed-length requests arriving at
different steps, small prefill chunks, prefix-cache hits, preemption under a tiny pool, on-device
decode loops, and with or without host/device overlap."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.model.transformer import train_forward
from jaxinfer.sampling_params import SamplingParams
from test_engine_support import MAX_LEN, assert_all_free, make_engine, prompt_ids, run_all, tiny_model

# A step whose KV cache could not be donated would copy the whole cache every step.
pytestmark = pytest.mark.filterwarnings("error:Some donated buffers were not usable")

GREEDY = dict(temperature=0.0, ignore_eos=True)


@functools.lru_cache(maxsize=None)
def _dense_logits():
    cfg, params = tiny_model()
    return jax.jit(lambda toks: train_forward(params, cfg, toks))


def oracle(prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy continuation with a full recompute per token (padding after the end is causal-masked)."""
    toks = list(prompt)
    for _ in range(max_tokens):
        buf = np.zeros((1, MAX_LEN), np.int32)
        buf[0, :len(toks)] = toks
        logits = _dense_logits()(jnp.asarray(buf))
        toks.append(int(jnp.argmax(logits[0, len(toks) - 1])))
    return toks[len(prompt):]


# 16 requests: prompt lengths 1..29, output lengths 1..12.
WORKLOAD = [(prompt_ids(100 + i, 1 + (i * 7) % 29), 1 + (i * 5) % 12) for i in range(16)]


@functools.lru_cache(maxsize=None)
def expected() -> list[list[int]]:
    return [oracle(p, m) for p, m in WORKLOAD]


def run_staggered(engine, arrivals_per_step: int = 3) -> list[list[int]]:
    """Add the workload a few requests per step (so they join a running batch)."""
    pending = list(enumerate(WORKLOAD))
    results: dict = {}
    while pending or engine.has_unfinished_requests():
        for _ in range(min(arrivals_per_step, len(pending))):
            i, (p, m) = pending.pop(0)
            engine.add_request(f"r{i}", p, SamplingParams(max_tokens=m, **GREEDY))
        for out in engine.step():
            for c in out.outputs:
                results[out.request_id] = c.token_ids
    return [results[f"r{i}"] for i in range(len(WORKLOAD))]


def test_one_by_one_matches_oracle():
    engine = make_engine()
    for i, (p, m) in enumerate(WORKLOAD[:6]):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=m, **GREEDY))
        assert run_all(engine)[f"r{i}"][0][0] == expected()[i]
    assert_all_free(engine)


@pytest.mark.parametrize("options", [
    dict(),                                            # continuous batching, overlap on
    dict(async_scheduling=False),                      # no overlap
    dict(long_prefill_chunk=3),                        # chunked prefill, small chunks
    dict(decode_steps_per_call=4),                     # on-device decode loop
    dict(enable_prefix_caching=False),
], ids=["batched", "sync", "chunk3", "decode_loop4", "no_prefix_cache"])
def test_continuous_batching_matches_oracle(options):
    engine = make_engine(**options)
    assert run_staggered(engine) == expected()
    assert_all_free(engine)


def test_prefix_cache_hit_gives_same_tokens():
    engine = make_engine()
    shared = prompt_ids(5, 17)
    p1, p2 = shared + prompt_ids(6, 3), shared + prompt_ids(7, 5)
    engine.add_request("a", p1, SamplingParams(max_tokens=6, **GREEDY))
    first = run_all(engine)["a"][0][0]
    hits = engine.scheduler.kv_cache_stats()[-1].hits
    engine.add_request("b", p2, SamplingParams(max_tokens=6, **GREEDY))
    second = run_all(engine)["b"][0][0]
    # 4 whole blocks of the 17 shared tokens
    assert engine.scheduler.kv_cache_stats()[-1].hits - hits == 16
    assert first == oracle(p1, 6) and second == oracle(p2, 6)
    assert_all_free(engine)


def test_preemption_under_a_tiny_pool():
    # 24 blocks of 4 tokens for 16 requests of up to 41 tokens: admission and decode growth run out.
    engine = make_engine(num_blocks=24)
    assert run_staggered(engine, arrivals_per_step=16) == expected()
    assert engine.scheduler.num_preemptions > 0
    assert_all_free(engine)


def test_prefills_that_fill_the_pool_do_not_wait_for_each_other_forever():
    # 16 blocks of 4 tokens hold one 64-token sequence. Three 56-token prompts, 4-token chunks and
    # 8 tokens a step: the prefills fill the pool part-way through their prompts, nothing decodes.
    engine = make_engine(num_blocks=16, max_num_batched_tokens=8, long_prefill_chunk=4)
    prompts = [prompt_ids(200 + i, 56) for i in range(3)]
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=4, **GREEDY))
    got = {}
    for _ in range(500):
        for out in engine.step():
            for c in out.outputs:
                got[out.request_id] = c.token_ids
        if not engine.has_unfinished_requests():
            break
    assert not engine.has_unfinished_requests(), "the prefills wait for each other's blocks"
    assert got == {f"r{i}": oracle(p, 4) for i, p in enumerate(prompts)}
    assert engine.scheduler.num_preemptions > 0
    assert_all_free(engine)


@pytest.mark.parametrize("seed", [0, 1])
def test_random_schedule_with_aborts_forks_and_preemption(seed):
    """Random arrivals, aborts, n in {1, 2}, small chunks and a small pool (so preemption and COW
    happen), with and without the decode loop: every request that was not aborted gets exactly the
    oracle's greedy tokens (each choice of an n = 2 request too), and nothing leaks."""
    rng = np.random.default_rng(seed)
    engine = make_engine(num_blocks=20, long_prefill_chunk=int(rng.integers(2, 9)),
                         decode_steps_per_call=int(rng.choice([1, 3])))
    todo = list(range(len(WORKLOAD)))
    rng.shuffle(todo)
    live, aborted, got, num_choices = set(), set(), {}, {}
    step = 0
    while todo or engine.has_unfinished_requests():
        if todo and rng.random() < 0.7:
            i = todo.pop()
            p, m = WORKLOAD[i]
            n = int(rng.choice([1, 2]))
            engine.add_request(f"r{i}", p, SamplingParams(n=n, max_tokens=m, **GREEDY))
            live.add(f"r{i}")
            num_choices[f"r{i}"] = n
        if live and rng.random() < 0.08:
            rid = sorted(live)[int(rng.integers(len(live)))]
            engine.abort(rid)
            live.discard(rid)
            aborted.add(rid)
        for out in engine.step():
            assert out.request_id not in aborted
            for c in out.outputs:
                got.setdefault(out.request_id, {})[c.index] = c.token_ids
            if out.finished:
                live.discard(out.request_id)
        step += 1
        assert step < 2000
    assert set(got) | aborted == set(num_choices)
    for rid in set(num_choices) - aborted:
        want = expected()[int(rid[1:])]
        assert sorted(got[rid]) == list(range(num_choices[rid])), rid
        assert all(toks == want for toks in got[rid].values()), rid
    assert engine.scheduler.num_preemptions > 0
    assert_all_free(engine)
