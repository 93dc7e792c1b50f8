"""The OpenAI-compatible server's API and formats, over a real AsyncEngine (tiny random-weight llama)
on loopback: the official openai client, raw SSE framing, the benchmark client and /metrics. The server
is the session-wide `server` fixture (tests/conftest.py), shared with test_server_faults.py."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import openai
import pytest

from jaxinfer.engine.metrics import STEP_PHASES
from server_harness import MAX_MODEL_LEN, MODEL, NO_EOS, metric, metric_delta, scrape, wait_pool_free

# ---- the official openai client ------------------------------------------------------------------

def test_completion_basic_n2_and_multi_prompt(client, server):
    tok = server.engine.tokenizer
    r = client.completions.create(model=MODEL, prompt="Hello world", max_tokens=6, temperature=0,
                                  extra_body=NO_EOS)
    assert r.object == "text_completion" and r.id.startswith("cmpl-") and r.model == MODEL
    assert len(r.choices) == 1 and r.choices[0].index == 0 and r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(tok.encode("Hello world"))
    assert r.usage.completion_tokens == 6 and r.usage.total_tokens == r.usage.prompt_tokens + 6

    r = client.completions.create(model=MODEL, prompt="Hello world", max_tokens=5, n=2, temperature=1.0,
                                  seed=3, extra_body=NO_EOS)
    assert sorted(c.index for c in r.choices) == [0, 1] and r.usage.completion_tokens == 10

    r = client.completions.create(model=MODEL, prompt=["one two", "three four"], max_tokens=3, n=2,
                                  temperature=0.5, seed=1, extra_body=NO_EOS)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.usage.prompt_tokens == len(tok.encode("one two")) + len(tok.encode("three four"))
    assert r.usage.completion_tokens == 12


def test_echo_and_unknown_fields(client, caplog):
    with caplog.at_level("WARNING", logger="serve.protocol"):
        r = client.completions.create(model=MODEL, prompt="Hello world", max_tokens=3, echo=True,
                                      temperature=0, extra_body={**NO_EOS, "frobnicate": 1})
    plain = client.completions.create(model=MODEL, prompt="Hello world", max_tokens=3, temperature=0,
                                      extra_body=NO_EOS)
    assert r.choices[0].text == "Hello world" + plain.choices[0].text
    assert "frobnicate" in caplog.text  # ignored, with a log line


def test_stop_string(client):
    greedy = client.completions.create(model=MODEL, prompt="The quick", max_tokens=16, temperature=0,
                                       extra_body=NO_EOS).choices[0].text
    # A printable character whose first occurrence is past the start, so the expected text is known.
    stops = [ch for i, ch in enumerate(greedy) if i >= 1 and greedy.index(ch) == i and ch.isprintable()
             and not ch.isspace() and ch != "\ufffd"]
    assert stops, f"greedy text {greedy!r} has no usable stop character"
    stop = stops[0]
    r = client.completions.create(model=MODEL, prompt="The quick", max_tokens=16, temperature=0, stop=[stop],
                                  extra_body=NO_EOS)
    choice = r.choices[0]
    assert choice.text == greedy[:greedy.index(stop)]
    assert choice.finish_reason == "stop" and choice.model_extra["stop_reason"] == stop


def test_logprobs(client):
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0, logprobs=2,
                                  extra_body=NO_EOS)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 4
    for sampled, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert sampled <= 0 and 2 <= len(top) <= 3
        assert sampled == pytest.approx(max(top.values()), abs=1e-4)  # greedy picks the best

    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=3, temperature=0, logprobs=True, top_logprobs=2,
                                       extra_body=NO_EOS)
    content = r.choices[0].logprobs.content
    assert len(content) == 3
    for entry in content:
        assert len(entry.top_logprobs) == 2 and entry.bytes == list(entry.token.encode())
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-4)


def test_chat_streaming_with_usage(client, server):
    messages = [{"role": "user", "content": "count to ten"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0,
                                       extra_body=NO_EOS)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.choices[0].message.role == "assistant" and r.choices[0].finish_reason == "length"
    prompt = server.engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert r.usage.prompt_tokens == len(server.engine.tokenizer.encode(prompt, add_special_tokens=False))

    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body=NO_EOS))
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    assert chunks[-1].usage.prompt_tokens == r.usage.prompt_tokens
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == r.choices[0].message.content


@pytest.mark.parametrize("n", [1, 2])
def test_streamed_text_equals_non_streamed(client, n):
    kw = dict(model=MODEL, max_tokens=12, temperature=0.9, seed=11, n=n, extra_body=NO_EOS)
    full = client.completions.create(prompt="Once upon a time", **kw)
    streamed = {i: "" for i in range(n)}
    for chunk in client.completions.create(prompt="Once upon a time", stream=True, **kw):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert streamed == {c.index: c.text for c in full.choices}

    messages = [{"role": "user", "content": "Once upon a time"}]
    full = client.chat.completions.create(messages=messages, **kw)
    streamed = {i: "" for i in range(n)}
    for chunk in client.chat.completions.create(messages=messages, stream=True, **kw):
        for c in chunk.choices:
            streamed[c.index] += c.delta.content or ""
    assert streamed == {c.index: c.message.content for c in full.choices}


def test_models_tokenize_detokenize_version(client, server):
    url = server.urls["main"]

    async def go():
        async with aiohttp.ClientSession() as s:
            async with s.post(f"{url}/tokenize", json={"prompt": "Hello world"}) as r:
                tok = await r.json()
            async with s.post(f"{url}/detokenize", json={"tokens": tok["tokens"]}) as r:
                detok = await r.json()
            async with s.get(f"{url}/version") as r:
                version = await r.json()
        return tok, detok, version

    tok, detok, version = asyncio.run(go())
    assert tok["count"] == len(tok["tokens"]) > 0 and tok["max_model_len"] == MAX_MODEL_LEN
    assert detok["prompt"] == "Hello world" and isinstance(version["version"], str)
    assert [m.id for m in client.models.list().data] == [MODEL]


# ---- raw SSE framing -----------------------------------------------------------------------------

async def post_raw(url: str, body: dict, headers: dict | None = None) -> tuple[int, dict, bytes]:
    async with aiohttp.ClientSession() as s:
        async with s.post(url, json=body, headers=headers) as r:
            return r.status, dict(r.headers), await r.read()


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_sse_framing(server, endpoint):
    chat = endpoint.endswith("chat/completions")
    body = {"model": MODEL, "max_tokens": 6, "n": 2, "temperature": 1.0, "seed": 5, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi there"})
    status, headers, raw = asyncio.run(post_raw(server.urls["main"] + endpoint, body))
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    assert raw.endswith(b"\n\n") and raw.count(b"data: [DONE]\n\n") == 1 and raw.endswith(b"data: [DONE]\n\n")
    events = raw[:-2].split(b"\n\n")
    assert all(e.startswith(b"data: ") and b"\n" not in e for e in events)
    chunks = [json.loads(e[len(b"data: "):]) for e in events[:-1]]
    usage_chunk, chunks = chunks[-1], chunks[:-1]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 12
    finished = {}
    for chunk in chunks:
        assert chunk["object"] == ("chat.completion.chunk" if chat else "text_completion")
        assert len(chunk["choices"]) == 1
        choice = chunk["choices"][0]
        assert choice["index"] not in finished, "a chunk after the choice's finish_reason"
        if choice["finish_reason"] is not None:
            finished[choice["index"]] = choice["finish_reason"]
    assert finished == {0: "length", 1: "length"}  # exactly once per choice
    if chat:  # each choice opens with the role
        for index in (0, 1):
            first = next(c for c in chunks if c["choices"][0]["index"] == index)
            assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}


def test_error_after_stream_start_is_an_event():
    """An engine failure mid-stream cannot change the status any more: it is a data: {"error"} event
    followed by [DONE]."""
    from aiohttp import web
    from aiohttp.test_utils import TestClient, TestServer

    from serve.sse import stream_chunks

    async def failing():
        yield {"choices": [{"index": 0, "text": "a"}]}
        raise RuntimeError("device lost")

    async def handler(request):
        return await stream_chunks(request, failing())

    async def go():
        app = web.Application()
        app.router.add_get("/", handler)
        async with TestClient(TestServer(app)) as c:
            r = await c.get("/")
            return r.status, await r.read()

    status, raw = asyncio.run(go())
    events = raw.split(b"\n\n")
    assert status == 200 and events[-1] == b"" and events[-2] == b"data: [DONE]"
    error = json.loads(events[1][len(b"data: "):])["error"]
    assert error["code"] == 500 and "device lost" in error["message"]


# ---- the benchmark client ------------------------------------------------------------------------

@pytest.mark.parametrize("chat", [False, True])
def test_bench_serving_client(server, capsys, chat):
    """`jaxinfer bench serve`'s client parses this server's streams: every request succeeds, the
    token counts come from usage, and vLLM's result block is printed."""
    import numpy as np

    from jaxinfer.bench import http_client, serving_metrics
    from jaxinfer.bench.datasets import random_requests

    requests = random_requests(server.engine.tokenizer, 6, 8, 4, 0.0, np.random.default_rng(0), as_text=chat)
    url = server.urls["main"] + ("/v1/chat/completions" if chat else "/v1/completions")
    results, duration = asyncio.run(http_client.run_benchmark(url, MODEL, chat, requests, float("inf"), 2,
                                                              ignore_eos=True, seed=0))
    metrics = serving_metrics.summarize(results, duration, float("inf"), 2)
    assert metrics["completed"] == 6 and metrics["failed"] == 0, metrics["errors"]
    assert metrics["total_output_tokens"] == 24 and metrics["mean_ttft_ms"] > 0 and metrics["mean_itl_ms"] > 0
    assert metrics["output_lens"] == [4] * 6 and metrics["itls"] == [r.itl for r in results]
    assert metrics["ttfts"] == [r.ttft for r in results] and metrics["errors"] == [""] * 6
    # At most 2 in flight (the cap), and the busiest second saw at least one token.
    assert 1 <= metrics["max_concurrent_requests"] <= 2 and metrics["max_output_tokens_per_s"] >= 1
    texts = [r.generated_text for r in results]
    assert all(texts) and metrics["generated_texts"] == texts
    serving_metrics.print_result(metrics)
    assert "============ Serving Benchmark Result ============" in capsys.readouterr().out


# ---- metrics -------------------------------------------------------------------------------------

def test_metrics_count_what_was_sent(server, client):
    wait_pool_free(server)
    before = scrape(server.urls["main"])
    for _ in range(3):
        client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=4, extra_body=NO_EOS)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="hi", temperature=-1)
    after = scrape(server.urls["main"])

    def delta(name, **labels):
        return metric_delta(before, after, name, **labels)

    assert delta("jaxinfer:request_success_total", finished_reason="length") == 3
    assert delta("jaxinfer:prompt_tokens_total") == 9
    assert delta("jaxinfer:generation_tokens_total") == 12
    assert delta("jaxinfer:e2e_request_latency_seconds_count") == 3
    assert delta("jaxinfer:time_to_first_token_seconds_count") == 3
    assert delta("jaxinfer:http_requests_total", handler="/v1/completions", status="200") == 3
    # The engine core's step loop: 3 requests of 4 tokens, one at a time, take >= 4 steps each.
    steps = delta("jaxinfer:engine_steps_total", stage="dispatched")
    assert steps >= 12 and 0 < delta("jaxinfer:engine_steps_total", stage="processed") <= steps
    phases = {p: delta("jaxinfer:engine_step_host_seconds_total", phase=p)
              for p in STEP_PHASES}
    assert all(v >= 0 for v in phases.values()) and phases["launch"] > 0, phases
    for name in ("jaxinfer:num_requests_running", "jaxinfer:num_requests_waiting",
                 "jaxinfer:kv_cache_usage_perc",
                 "jaxinfer:prefix_cache_queries_total", "jaxinfer:prefix_cache_hits_total",
                 "jaxinfer:num_preemptions_total", "jaxinfer:inter_token_latency_seconds_count",
                 "jaxinfer:request_queue_time_seconds_count"):
        assert any(n == name for n, _ in after), name
    assert metric(after, "jaxinfer:num_requests_running") == 0
    assert delta("jaxinfer:http_requests_total", handler="/v1/completions", status="400") == 1
