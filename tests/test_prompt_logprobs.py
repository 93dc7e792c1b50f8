"""Prompt logprobs (SamplingParams.prompt_logprobs) against a dense jnp log-softmax of the model's
logits: chunked prefill, a prompt whose prefix is cached, n > 1 (the shared prompt sequence),
preemption, and the offline API's output; steps of other requests never compute them."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.frontends.llm import LLM
from jaxinfer.model.transformer import train_forward
from jaxinfer.sampling_params import SamplingParams
from jaxinfer.errors import InvalidRequestError
from test_engine_support import MAX_LEN, assert_all_free, make_engine, prompt_ids, tiny_model

K = 3


@functools.lru_cache(maxsize=None)
def _dense_logprobs():
    cfg, params = tiny_model()
    return jax.jit(lambda toks: jax.nn.log_softmax(train_forward(params, cfg, toks), axis=-1))


def reference(prompt: list[int]) -> np.ndarray:
    """log p(prompt[i] | prompt[:i]) for i >= 1, and each position's full log-softmax row."""
    buf = np.zeros((1, MAX_LEN), np.int32)
    buf[0, :len(prompt)] = prompt
    return np.asarray(_dense_logprobs()(jnp.asarray(buf)))[0]


def check(prompt: list[int], plp) -> None:
    ref = reference(prompt)
    assert len(plp) == len(prompt) and plp[0] is None
    for i in range(1, len(prompt)):
        row = ref[i - 1]
        entry = plp[i]
        assert entry.token_id == prompt[i]
        np.testing.assert_allclose(entry.logprob, row[prompt[i]], atol=2e-5)
        assert entry.rank == 1 + int(np.sum(row > row[prompt[i]] + 1e-6))
        top_ids = np.argsort(-row)[:K]
        assert [t for t, _ in entry.top] == top_ids.tolist()
        np.testing.assert_allclose([v for _, v in entry.top], row[top_ids], atol=2e-5)


def _run(engine, prompts, params):
    """Step until idle; -> {rid: (prompt_logprobs of its first output, final output)}."""
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    first, last = {}, {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            first.setdefault(out.request_id, out.prompt_logprobs)
            last[out.request_id] = out
    return first, last


@pytest.mark.parametrize("chunk", [4, 32])
def test_prompt_logprobs_match_dense_log_softmax(chunk):
    engine = make_engine(long_prefill_chunk=chunk)
    prompts = [prompt_ids(40 + i, n) for i, n in enumerate((2, 9, 23))]
    first, _ = _run(engine, prompts, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True,
                                                    prompt_logprobs=K))
    for i, p in enumerate(prompts):
        check(p, first[f"r{i}"])  # complete in the request's first output
    assert_all_free(engine)


def test_prefix_cache_hit_is_not_taken_and_n2_computes_once():
    engine = make_engine()
    prompt = prompt_ids(50, 21)
    engine.add_request("warm", prompt, SamplingParams(max_tokens=1, temperature=0.0))
    while engine.has_unfinished_requests():
        engine.step()
    hits = engine.scheduler.kv.stats.hits
    first, last = _run(engine, [prompt], SamplingParams(n=2, max_tokens=3, temperature=1.0, seed=1,
                                                        ignore_eos=True, prompt_logprobs=K))
    check(prompt, first["r0"])
    assert engine.scheduler.kv.stats.hits == hits  # the cached prefix was not used
    assert last["r0"].finished and len(last["r0"].prompt_logprobs) == len(prompt)
    assert_all_free(engine)


def test_preemption_keeps_prompt_logprobs_and_plain_requests_skip_them(monkeypatch):
    engine = make_engine(num_blocks=18, long_prefill_chunk=8)  # 72 slots: preempts
    prompts = [prompt_ids(60 + i, 17) for i in range(4)]
    calls = []
    import jaxinfer.worker.runner as runner_mod
    real = runner_mod.gather_hidden_reads
    monkeypatch.setattr(runner_mod, "gather_hidden_reads", lambda rows: calls.append(1) or real(rows))
    first, last = _run(engine, prompts, SamplingParams(max_tokens=10, temperature=0.0,
                                                       ignore_eos=True, prompt_logprobs=K))
    assert engine.scheduler.num_preemptions > 0
    for i, p in enumerate(prompts):
        check(p, last[f"r{i}"].prompt_logprobs)
    calls.clear()
    _run(engine, [prompts[0]], SamplingParams(max_tokens=3, temperature=0.0))
    assert not calls  # no step of a plain request runs the prompt-logprob path


def test_offline_api_and_validation():
    llm = LLM(engine=make_engine())
    prompt = prompt_ids(70, 12)
    out = llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True,
                                                prompt_logprobs=0), use_tqdm=False)[0]
    ref = reference(prompt)
    assert out.prompt_logprobs[0] is None and all(e.top == [] for e in out.prompt_logprobs[1:])
    np.testing.assert_allclose([e.logprob for e in out.prompt_logprobs[1:]],
                               [ref[i - 1, prompt[i]] for i in range(1, len(prompt))], atol=2e-5)
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(prompt_logprobs=21).validate(100)
    assert e.value.param == "prompt_logprobs"


def test_offline_logprobs_are_complete_and_chat_renders_the_template():
    from test_engine_support import tiny_tokenizer
    llm = LLM(engine=make_engine())
    prompt = prompt_ids(80, 6)
    out = llm.generate([prompt], SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True,
                                                logprobs=2), use_tqdm=False)[0].outputs[0]
    ref = reference(prompt + out.token_ids)
    assert [lp.token_id for lp in out.logprobs] == out.token_ids and len(out.token_ids) == 9
    np.testing.assert_allclose([lp.logprob for lp in out.logprobs],
                               [ref[len(prompt) - 1 + i, t] for i, t in enumerate(out.token_ids)],
                               atol=2e-5)
    tok = tiny_tokenizer()
    tok.chat_template = ("{% for m in messages %}{{ m['role'][0] }}#{{ m['content'] }}.{% endfor %}"
                         "{% if add_generation_prompt %}a#{% endif %}{{ x }}")
    conv = [{"role": "user", "content": "hello"}]
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    try:
        chats = llm.chat([conv, conv], params, use_tqdm=False, chat_template_kwargs={"x": "ab"})
    finally:
        tok.chat_template = None
    expected = tok.encode("u#hello.a#ab", add_special_tokens=False)
    assert chats[0].prompt_token_ids == chats[1].prompt_token_ids == expected
    plain = llm.generate([expected], params, use_tqdm=False)[0]
    assert chats[0].outputs[0].token_ids == plain.outputs[0].token_ids
