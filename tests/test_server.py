"""The OpenAI-compatible server over a real AsyncEngine (tiny random-weight llama) on loopback: the
official openai client, raw SSE framing, disconnects under load, client timeouts, a table of bad
inputs, auth / body limit / overload, and /metrics. One server is shared by the whole module."""

from __future__ import annotations

import asyncio
import json
import random
import time

import aiohttp
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from server_harness import ServerThread, make_tiny_model_dir, server_args

MODEL = "tiny-llama"
MAX_MODEL_LEN = 256
API_KEY = "sk-test-key"
NO_EOS = {"ignore_eos": True}  # random weights may sample EOS; fixed lengths keep counts exact


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from jaxinfer.engine_args import EngineArgs
    model_dir = make_tiny_model_dir(tmp_path_factory.mktemp("tiny-llama"))
    # Small batches keep the CPU compile count low (shapes compile lazily, warm-up off); 64 concurrent
    # streams then also exercise the waiting queue.
    engine_args = EngineArgs(model=str(model_dir), served_model_name=MODEL, dtype="float32",
                             max_model_len=MAX_MODEL_LEN, block_size=16, num_blocks=256, max_num_seqs=16,
                             max_num_batched_tokens=64, compilation_cache_dir="", attention_backend="reference",
                             warmup=False)
    st = ServerThread(engine_args, {
        "main": server_args(),
        # Strict flags on a second port over the same engine: auth, a small body limit, no queue.
        "strict": server_args(api_key=API_KEY, max_request_bytes=2048, max_waiting=0),
    }).start()
    yield st
    st.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.urls["main"] + "/v1", api_key="unused", max_retries=0, timeout=60)


def kv_pool_state(server) -> tuple[int, int, list]:
    async def read():
        m = server.engine.kv_cache_manager
        return m.num_free_blocks, m.num_blocks, m.request_ids()
    return server.call(read())


def wait_pool_free(server, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        free, total, live = kv_pool_state(server)
        if free == total and not live:
            return
        assert time.monotonic() < deadline, f"KV pool not freed: {free}/{total} free, live requests {live}"
        time.sleep(0.05)


# ---- metrics helpers -----------------------------------------------------------------------------

def scrape(url: str) -> dict[tuple[str, tuple], float]:
    async def get():
        async with aiohttp.ClientSession() as s:
            async with s.get(url + "/metrics") as r:
                assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
                return await r.text()
    samples = {}
    for family in text_string_to_metric_families(asyncio.run(get())):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def metric(samples, name: str, **labels) -> float:
    return sum(v for (n, ls), v in samples.items() if n == name and all(dict(ls).get(k) == v2
                                                                        for k, v2 in labels.items()))


def metric_delta(before, after, name: str, **labels) -> float:
    return metric(after, name, **labels) - metric(before, name, **labels)


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
        r = client.completions.create(model=MODEL, prompt="Hello world", max_tokens=3, echo=True, temperature=0,
                                      extra_body={**NO_EOS, "frobnicate": 1})
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

    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                       temperature=0, logprobs=True, top_logprobs=2, extra_body=NO_EOS)
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
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == r.choices[0].message.content


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
    for i, chunk in enumerate(chunks):
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


# ---- load and faults -----------------------------------------------------------------------------

def early_quitters(quitters: set[int]) -> list[int]:
    """The quitters cancelled while still waiting for response headers."""
    return sorted(quitters)[:7]


def test_disconnects_under_load_free_everything(server):
    """64 concurrent streams; a random third disconnect mid-prefill or mid-decode. Every other stream
    completes correctly, nothing answers 5xx, and the KV pool is entirely free afterwards."""
    url = server.urls["main"] + "/v1/completions"
    rng = random.Random(0)
    quitters = set(rng.sample(range(64), 21))

    async def one(i: int, session: aiohttp.ClientSession):
        quits = i in quitters
        body = {"model": MODEL, "prompt": [5 + i % 50, 9, 13], "max_tokens": 200 if quits else 8,
                "temperature": 0.8, "seed": i, "stream": True, "ignore_eos": True}
        async with session.post(url, json=body) as r:
            assert r.status == 200, await r.text()
            if quits:  # disconnect after 0..2 events: before or after the first token
                for _ in range(rng.randrange(3)):
                    await r.content.readuntil(b"\n\n")
                r.close()
                return None
            raw = await r.read()
        events = raw.split(b"\n\n")
        assert events[-2] == b"data: [DONE]"
        chunks = [json.loads(e[6:]) for e in events[:-2]]
        assert [c["choices"][0]["finish_reason"] for c in chunks].count("length") == 1
        return sum(len(c["choices"][0]["text"]) for c in chunks)

    async def main():
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            # A third of the quitters leave while still waiting for headers (mid-prefill).
            tasks = [asyncio.create_task(one(i, session)) for i in range(64)]
            early = [tasks[i] for i in early_quitters(quitters)]
            await asyncio.sleep(0.05)
            for t in early:
                t.cancel()
            return await asyncio.gather(*tasks, return_exceptions=True)

    before = scrape(server.urls["main"])
    results = asyncio.run(main())
    errors = [r for r in results if isinstance(r, BaseException) and not isinstance(r, asyncio.CancelledError)]
    assert not errors, errors[:3]
    assert sum(r is not None and not isinstance(r, BaseException) for r in results) == 64 - len(quitters)
    # Freed by aborts, at once: a quitter's 200 tokens could not have run to the end in this time.
    wait_pool_free(server, timeout=10.0)
    after = scrape(server.urls["main"])
    # Quitters that got headers had reached the engine (headers wait for its first output), so each
    # was aborted; the 7 cancelled while waiting may have left before the engine ever saw them.
    aborts = metric_delta(before, after, "jaxinfer:request_success_total", finished_reason="abort")
    assert len(quitters) - len(early_quitters(quitters)) <= aborts <= len(quitters)
    assert metric_delta(before, after, "jaxinfer:request_success_total", finished_reason="length") == 64 - len(quitters)
    assert metric(after, "jaxinfer:http_requests_total", status="500") == 0


def test_client_timeouts_then_new_request_is_fast(server, client):
    url = server.urls["main"] + "/v1/completions"
    timeout = aiohttp.ClientTimeout(total=0.3)

    async def one(i, session):
        body = {"model": MODEL, "prompt": [7, 8, 9 + i % 100], "max_tokens": 200, "ignore_eos": True,
                "stream": i % 2 == 0}
        try:
            async with session.post(url, json=body, timeout=timeout) as r:
                await r.read()
            return "completed"
        except asyncio.TimeoutError:
            return "timeout"

    async def main():
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            return await asyncio.gather(*(one(i, session) for i in range(200)))

    before = scrape(server.urls["main"])
    assert asyncio.run(main()) == ["timeout"] * 200
    t0 = time.monotonic()
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, extra_body=NO_EOS)
    assert time.monotonic() - t0 < 5.0 and r.usage.completion_tokens == 4
    wait_pool_free(server, timeout=10.0)
    after = scrape(server.urls["main"])
    # None ran on to its 200 tokens: every one the engine saw was aborted (one that timed out before
    # its handler reached the engine never became a request, so "all 200" is not guaranteed).
    aborts = metric_delta(before, after, "jaxinfer:request_success_total", finished_reason="abort")
    assert 0 < aborts <= 200
    assert metric_delta(before, after, "jaxinfer:request_success_total", finished_reason="length") == 1  # "Hello"


# ---- bad inputs ----------------------------------------------------------------------------------

LONG = [5] * 200
BAD_INPUTS = [
    # (path, body or raw bytes, content type, status, param)
    ("/v1/completions", b"{not json", "application/json", 400, None),
    ("/v1/completions", b'{"prompt": "hi"}', "text/plain", 400, None),
    ("/v1/completions", b"[1, 2]", "application/json", 400, None),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, None, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, None, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, None, 400, "top_p"),
    ("/v1/completions", {"prompt": "hi", "top_p": 1.5}, None, 400, "top_p"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, None, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "9"}, None, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "n": 0}, None, 400, "n"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 99}, None, 400, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "stream": "yes"}, None, 400, "stream"),
    ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, None, 400, "stream_options"),
    ("/v1/completions", {"prompt": "hi", "stop": [1]}, None, 400, "stop"),
    ("/v1/completions", {"prompt": ""}, None, 400, "prompt"),
    ("/v1/completions", {"prompt": []}, None, 400, "prompt"),
    ("/v1/completions", {"prompt": [[]]}, None, 400, "prompt"),
    ("/v1/completions", {"prompt": 42}, None, 400, "prompt"),
    ("/v1/completions", {"max_tokens": 3}, None, 400, "prompt"),
    ("/v1/completions", {"prompt": [1, 384]}, None, 400, "prompt"),
    ("/v1/completions", {"prompt": [1, -2]}, None, 400, "prompt"),
    ("/v1/completions", {"prompt": LONG, "max_tokens": 100}, None, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-4"}, None, 404, "model"),
    ("/v1/completions", {"prompt": "hi", "model": "../../etc/passwd"}, None, 404, "model"),
    ("/v1/chat/completions", {"max_tokens": 3}, None, 400, "messages"),
    ("/v1/chat/completions", {"messages": "hi"}, None, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"content": "hi"}]}, None, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, None, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, None, 400,
     "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]},
     None, 400, "tools"),
    ("/detokenize", {"tokens": [-1]}, None, 400, "tokens"),
    ("/tokenize", {}, None, 400, "prompt"),
]


def check_error_shape(raw: bytes, status: int, param=None) -> dict:
    error = json.loads(raw)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status and isinstance(error["type"], str) and error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error


def test_bad_inputs_get_clear_errors_and_server_stays_healthy(server, client):
    base = server.urls["main"]

    async def main():
        out = []
        async with aiohttp.ClientSession() as s:
            for path, body, ctype, *_ in BAD_INPUTS:
                data = body if isinstance(body, bytes) else json.dumps(body).encode()
                async with s.post(base + path, data=data,
                                  headers={"Content-Type": ctype or "application/json"}) as r:
                    out.append((r.status, await r.read()))
            for method, path, status in (("GET", "/v1/nothing", 404), ("GET", "/v1/completions", 405)):
                async with s.request(method, base + path) as r:
                    out.append((r.status, await r.read()))
            async with s.get(base + "/health") as r:
                out.append((r.status, b""))
        return out

    results = asyncio.run(main())
    for (path, body, _, status, param), (got, raw) in zip(BAD_INPUTS, results):
        assert got == status, (path, body, raw)
        check_error_shape(raw, status, param)
    long_error = json.loads(results[BAD_INPUTS.index(next(b for b in BAD_INPUTS if b[1] == {
        "prompt": LONG, "max_tokens": 100}))][1])["error"]["message"]
    assert "256" in long_error and "300" in long_error and "200" in long_error  # says the numbers
    assert [s for s, _ in results[len(BAD_INPUTS):]] == [404, 405, 200]
    for _, raw in results[len(BAD_INPUTS):-1]:
        check_error_shape(raw, json.loads(raw)["error"]["code"])
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=2).choices[0].finish_reason
    wait_pool_free(server)


def test_auth_body_limit_and_overload(server):
    base = server.urls["strict"]
    auth = {"Authorization": f"Bearer {API_KEY}"}
    ok_body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}

    async def main():
        async with aiohttp.ClientSession() as s:
            out = {}
            async with s.post(base + "/v1/completions", json=ok_body) as r:
                out["no_key"] = (r.status, await r.read(), r.headers)
            async with s.post(base + "/v1/completions", json=ok_body,
                              headers={"Authorization": "Bearer wrong"}) as r:
                out["bad_key"] = (r.status, await r.read(), r.headers)
            async with s.get(base + "/health") as r:
                out["health"] = (r.status, b"", r.headers)
            async with s.post(base + "/v1/completions", headers=auth,
                              json={**ok_body, "prompt": "x" * 4096}) as r:
                out["too_big"] = (r.status, await r.read(), r.headers)
            async with s.post(base + "/v1/completions", json=ok_body, headers=auth) as r:
                out["overloaded"] = (r.status, await r.read(), r.headers)
            return out

    out = asyncio.run(main())
    for key in ("no_key", "bad_key"):
        assert out[key][0] == 401
        check_error_shape(out[key][1], 401)
    assert out["health"][0] == 200
    assert out["too_big"][0] == 413
    check_error_shape(out["too_big"][1], 413)
    assert out["overloaded"][0] == 503 and out["overloaded"][2]["Retry-After"] == "1"
    check_error_shape(out["overloaded"][1], 503)


# ---- the benchmark client ------------------------------------------------------------------------

@pytest.mark.parametrize("chat", [False, True])
def test_bench_serving_client(server, capsys, chat):
    """benchmarks/bench_serving.py parses this server's streams: every request succeeds, the token
    counts come from usage, and vLLM's result block is printed."""
    import sys
    from pathlib import Path

    import numpy as np
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import bench_serving

    requests = bench_serving.random_requests(server.engine.tokenizer, 6, 8, 4, 0.0, np.random.default_rng(0),
                                             as_text=chat)
    url = server.urls["main"] + ("/v1/chat/completions" if chat else "/v1/completions")
    results, duration = asyncio.run(bench_serving.run_benchmark(url, MODEL, chat, requests, float("inf"), 2,
                                                                ignore_eos=True, seed=0))
    metrics = bench_serving.summarize(results, duration, float("inf"), 2)
    assert metrics["completed"] == 6 and metrics["failed"] == 0, metrics["errors"]
    assert metrics["total_output_tokens"] == 24 and metrics["mean_ttft_ms"] > 0 and metrics["mean_itl_ms"] > 0
    bench_serving.print_result(metrics)
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
    for name in ("jaxinfer:num_requests_running", "jaxinfer:num_requests_waiting", "jaxinfer:kv_cache_usage_perc",
                 "jaxinfer:prefix_cache_queries_total", "jaxinfer:prefix_cache_hits_total",
                 "jaxinfer:num_preemptions_total", "jaxinfer:inter_token_latency_seconds_count",
                 "jaxinfer:request_queue_time_seconds_count"):
        assert any(n == name for n, _ in after), name
    assert metric(after, "jaxinfer:num_requests_running") == 0
    assert delta("jaxinfer:http_requests_total", handler="/v1/completions", status="400") == 1
