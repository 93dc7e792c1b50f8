"""lm-evaluation-harness's `local-completions` request shapes against the server over loopback
(without lm-eval itself, which pulls torch): loglikelihood and loglikelihood_rolling send token-id
prompts with `echo`, `logprobs: 1`, `max_tokens: 1`, and read `token_logprobs[ctxlen:-1]` and
`top_logprobs` (lm_eval/models/openai_completions.py: parse_logprobs); generate_until sends token-id
prompts with `stop` and `max_tokens`. The numbers are checked against the offline API and against a
dense jnp log-softmax of the model's logits."""

from __future__ import annotations

import asyncio
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import aiohttp

from jaxinfer.model.transformer import train_forward
from jaxinfer.sampling_params import SamplingParams
from server_harness import MODEL

EOT = 382  # the tiny tokenizer's <|im_end|>, lm-eval's prefix token for rolling windows


@pytest.fixture(scope="module")
def server(in_process_server):
    """The shared tiny server with its engine core in this process:
    the scores read the engine's own weights."""
    return in_process_server


def post_raw(server, body: dict) -> str:
    async def go():
        async with aiohttp.ClientSession() as s:
            async with s.post(server.urls["main"] + "/v1/completions",
                              json={"model": MODEL, **body}) as r:
                text = await r.text()
                assert r.status == 200, text
                return text
    return asyncio.run(go())


def post(server, body: dict) -> dict:
    return json.loads(post_raw(server, body))


def parse_logprobs(out: dict, ctxlens: list[int]) -> list[tuple[float, bool]]:
    """lm-eval's LocalCompletionsAPI.parse_logprobs, as it reads the response."""
    res = []
    for choice, ctxlen in zip(sorted(out["choices"], key=lambda c: c["index"]), ctxlens):
        lps = choice["logprobs"]["token_logprobs"][ctxlen:-1]
        tops = choice["logprobs"]["top_logprobs"][ctxlen:-1]
        res.append((sum(lps), all(tok == max(top.values()) for tok, top in zip(lps, tops))))
    return res


@functools.lru_cache(maxsize=None)
def _log_softmax(engine):
    cfg, params = engine.cfg, engine.runner.params
    return jax.jit(lambda toks: jax.nn.log_softmax(train_forward(params, cfg, toks), axis=-1))


DENSE_LEN = 32  # every sequence `dense` scores is padded to this length: one compile for all


def dense(server, tokens: list[int], ctxlen: int) -> tuple[float, bool]:
    """Sum of log p(tokens[i] | tokens[:i]) over the continuation, and whether it is greedy. The
    padding after the tokens changes none of their logits (causal attention)."""
    assert len(tokens) <= DENSE_LEN
    padded = tokens + [0] * (DENSE_LEN - len(tokens))
    lp = np.asarray(_log_softmax(server.engine.engine)(jnp.asarray([padded], jnp.int32)))[0]
    cont = range(ctxlen, len(tokens))
    return (float(sum(lp[i - 1, tokens[i]] for i in cont)),
            all(int(np.argmax(lp[i - 1])) == tokens[i] for i in cont))


def final_output(server, prompt: list[int], params: SamplingParams, request_id: str):
    """The last RequestOutput of a request run through the server's engine directly."""
    async def run():
        final = None
        async for out in server.engine.generate(prompt, params, request_id):
            final = out
        return final
    return server.call(run())


def offline(server, tokens: list[int], ctxlen: int) -> float:
    """The same sum from the engine API (RequestOutput.prompt_logprobs)."""
    plp = final_output(server, tokens, SamplingParams(max_tokens=1, temperature=0.0,
                                                      prompt_logprobs=1), "offline-check").prompt_logprobs
    assert plp[0] is None
    return float(sum(plp[i].logprob for i in range(ctxlen, len(tokens))))


def greedy_ids(server, n: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(n).integers(0, 381, n)]


def test_loglikelihood_requests(server):
    tok = server.engine.tokenizer
    pairs = [("The quick brown fox", " jumps over"), ("one two three", " four five six"),
             ("Hello", " world! Serving")]
    inputs = [tok.encode(c) + tok.encode(x) for c, x in pairs]
    ctxlens = [len(tok.encode(c)) for c, _ in pairs]
    out = post(server, {"prompt": inputs, "temperature": 0, "max_tokens": 1, "logprobs": 1,
                        "seed": 1234, "echo": True})
    for choice, ids in zip(out["choices"], inputs):
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(ids) + 1
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    got = parse_logprobs(out, ctxlens)
    for (total, greedy), ids, ctxlen in zip(got, inputs, ctxlens):
        ref_total, ref_greedy = dense(server, ids, ctxlen)
        assert total == pytest.approx(ref_total, abs=1e-3) and greedy == ref_greedy
        assert total == pytest.approx(offline(server, ids, ctxlen), abs=1e-5)
    # A greedy continuation (the engine's own greedy ids) is reported greedy.
    ctx = tok.encode("one two three four")
    cont = final_output(server, ctx, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
                        "greedy-check").outputs[0].token_ids
    (_, greedy), = parse_logprobs(post(server, {"prompt": [ctx + cont], "max_tokens": 1, "logprobs": 1,
                                                "temperature": 0, "echo": True}), [len(ctx)])
    assert greedy


def test_loglikelihood_rolling_windows_sum_to_the_sequence(server):
    tokens = greedy_ids(server, 40)
    # lm-eval's rolling windows of max_length 24: [EOT] + first 23 tokens, then the rest with the
    # preceding tokens as context.
    windows = [([EOT] + tokens[:23], 1), (tokens[23 - 7:], 7)]
    out = post(server, {"prompt": [w for w, _ in windows], "temperature": 0, "max_tokens": 1,
                        "logprobs": 1, "seed": 1234, "echo": True})
    got = parse_logprobs(out, [c for _, c in windows])
    for (total, _), (ids, ctxlen) in zip(got, windows):
        assert total == pytest.approx(dense(server, ids, ctxlen)[0], abs=1e-3)


def test_generate_until_and_echo_only_scoring(server):
    prompt = greedy_ids(server, 12)
    body = {"prompt": [prompt], "max_tokens": 8, "temperature": 0, "seed": 1234, "ignore_eos": True}
    text = post(server, body)["choices"][0]["text"]
    stop = next((ch for ch in text[1:] if ch.strip() and ch != "\ufffd"), None)
    if stop is not None:
        cut = post(server, {**body, "stop": [stop]})["choices"][0]
        assert cut["text"] == text[:text.index(stop)] and cut["finish_reason"] == "stop"
    # max_tokens 0 + echo: the prompt and its logprobs only; nothing generated or counted.
    out = post(server, {"prompt": [prompt], "max_tokens": 0, "echo": True, "logprobs": 2,
                        "temperature": 0})
    choice = out["choices"][0]
    assert choice["text"] == server.engine.tokenizer.decode(prompt, skip_special_tokens=False)
    assert len(choice["logprobs"]["token_logprobs"]) == len(prompt)
    assert choice["finish_reason"] == "length" and out["usage"]["completion_tokens"] == 0
    assert len(choice["prompt_logprobs"]) == len(prompt) and choice["prompt_logprobs"][0] is None
    assert all(len(top) >= 2 for top in choice["logprobs"]["top_logprobs"][1:])


def test_streamed_echo_logprobs_match_the_full_response(server):
    prompt = greedy_ids(server, 9)
    body = {"prompt": [prompt], "max_tokens": 3, "echo": True, "logprobs": 1,
            "temperature": 0, "ignore_eos": True}
    full = post(server, body)["choices"][0]["logprobs"]
    merged: dict[str, list] = {"tokens": [], "token_logprobs": [], "text_offset": []}
    for line in post_raw(server, {**body, "stream": True}).splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            for choice in json.loads(line[6:])["choices"]:
                for key in merged:
                    merged[key] += choice["logprobs"][key]
    assert merged == {key: full[key] for key in merged}
