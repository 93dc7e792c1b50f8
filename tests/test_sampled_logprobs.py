"""Sampled logprobs kept as flat lists: the views read as the TokenLogprob lists they replace
(top-k, slices, snapshots), streamed outputs add up to the final one (n > 1, multi-token steps),
and `to_rollout_batch` fills the same arrays from the lists as from TokenLogprob objects."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from jaxinfer.frontends.llm import LLM
from jaxinfer.core.outputs import TokenLogprob
from jaxinfer.engine.rollout import to_rollout_batch
from jaxinfer.core.sampled_logprobs import LogprobsView, SampledLogprobs
from jaxinfer.sampling_params import SamplingParams
from test_engine_support import make_engine, prompt_ids


def filled(k: int, n: int, seed: int = 0) -> tuple[SampledLogprobs, list[TokenLogprob]]:
    """A store of n random entries, and the TokenLogprobs the output processor used to build."""
    rng = np.random.default_rng(seed)
    ids, lps = rng.integers(0, 1000, (n, 1 + k)), -rng.random((n, 1 + k)).astype(np.float32)
    store, objects = SampledLogprobs(k), []
    for i in range(n):
        top_ids, top_lps = ids[i, 1:].tolist(), lps[i, 1:].tolist()
        store.append(int(ids[i, 0]), float(lps[i, 0]), top_ids if k else None,
                     top_lps if k else None)
        objects.append(TokenLogprob(int(ids[i, 0]), float(lps[i, 0]),
                                    list(zip(top_ids, top_lps)) if k else []))
    return store, objects


@pytest.mark.parametrize("k", [0, 3])
def test_view_reads_as_the_token_logprob_list(k):
    store, objects = filled(k, 7)
    view = store.view()
    assert len(view) == 7 and view == objects and list(view) == objects
    assert view[0] == objects[0] and view[-1] == objects[-1] and view[3].rank is None
    assert view[2:5] == objects[2:5] and isinstance(view[2:5], LogprobsView)
    assert view[2:5][1] == objects[3] and view[::2] == objects[::2] and view[5:2] == []
    assert store.view(4) == objects[4:] and store.view(4)[0] == objects[4]
    assert view.values() == [o.logprob for o in objects]
    with pytest.raises(IndexError):
        view[7]
    with pytest.raises(IndexError):
        view[-8]
    # a view is a snapshot: later tokens do not show in it
    store.append(1, -0.5, [2] * k if k else None, [-1.0] * k if k else None)
    assert len(view) == 7 and view == objects and len(store.view()) == 8
    assert bool(store.view(8)) is False and store.view(8) == []


def test_view_top_arrays():
    store, objects = filled(4, 5)
    ids, lps = store.view(1, 4).top(2)
    assert ids.dtype == np.int32 and lps.dtype == np.float32 and ids.shape == (3, 2)
    assert ids.tolist() == [[t for t, _ in o.top[:2]] for o in objects[1:4]]
    np.testing.assert_array_equal(lps, [[v for _, v in o.top[:2]] for o in objects[1:4]])


def streamed(engine, prompts, params) -> tuple[dict, dict]:
    """{(request, choice): concatenated new_logprobs} and {(request, choice): final CompletionOutput},
    checking on the way that an output's logprobs do not change as the request goes on."""
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    news, finals, seen = {}, {}, []
    while engine.has_unfinished_requests():
        for out in engine.step():
            for c in out.outputs:
                key = (out.request_id, c.index)
                news.setdefault(key, []).extend(c.new_logprobs)
                assert len(c.logprobs) == len(c.token_ids)
                seen.append((c.logprobs, list(c.logprobs)))
                if c.finished:
                    finals[key] = c
    assert all(view == frozen for view, frozen in seen)
    return news, finals


@pytest.mark.parametrize("steps_per_call", [1, 3])
def test_streamed_logprobs_add_up_to_the_final_ones(steps_per_call):
    prompts = [prompt_ids(5, 6), prompt_ids(6, 9)]
    params = SamplingParams(n=2, temperature=0.0, max_tokens=7, ignore_eos=True, logprobs=3)
    news, finals = streamed(make_engine(decode_steps_per_call=steps_per_call), prompts, params)
    assert len(finals) == 4
    for key, c in finals.items():
        assert news[key] == list(c.logprobs) and len(c.token_ids) == 7
        assert [lp.token_id for lp in c.logprobs] == c.token_ids
        for lp in c.logprobs:  # greedy: the sampled token is the best alternative
            assert len(lp.top) == 3 and lp.top[0] == (lp.token_id, pytest.approx(lp.logprob))
            assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)


def test_multi_token_steps_keep_the_logprobs_of_single_steps():
    prompts = [prompt_ids(11, 7), prompt_ids(12, 5)]
    params = SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True, logprobs=2)
    one, _ = streamed(make_engine(), prompts, params)
    three, _ = streamed(make_engine(decode_steps_per_call=3), prompts, params)
    assert one.keys() == three.keys()
    for key in one:
        assert [lp.token_id for lp in one[key]] == [lp.token_id for lp in three[key]]
        np.testing.assert_allclose([lp.logprob for lp in one[key]],
                                   [lp.logprob for lp in three[key]], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("logprobs, top_k", [(0, None), (3, 2)])
def test_rollout_arrays_from_the_flat_lists_equal_those_from_objects(logprobs, top_k):
    llm = LLM(engine=make_engine())
    prompts = [prompt_ids(7, 5), prompt_ids(8, 9), prompt_ids(9, 3)]
    params = SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=6, min_tokens=1,
                            logprobs=logprobs)
    outs = llm.generate(prompts, params, use_tqdm=False)
    as_objects = [dataclasses.replace(o, outputs=[dataclasses.replace(c, logprobs=list(c.logprobs))
                                                  for c in o.outputs]) for o in outs]
    fast = to_rollout_batch(outs, max_completion_len=8, top_k=top_k)
    slow = to_rollout_batch(as_objects, max_completion_len=8, top_k=top_k)
    for field in dataclasses.fields(fast):
        a, b = getattr(fast, field.name), getattr(slow, field.name)
        assert (a is None) == (b is None), field.name
        if a is not None:
            np.testing.assert_array_equal(a, b, err_msg=field.name)
    assert fast.logprobs is not None and (fast.top_ids is not None) == bool(top_k)
    if top_k:
        with pytest.raises(ValueError, match="top_k=4 but the completions were sampled with "
                                             "logprobs=3"):
            to_rollout_batch(outs, top_k=4)
        with pytest.raises(ValueError, match="top_k=4"):
            to_rollout_batch(as_objects, top_k=4)
