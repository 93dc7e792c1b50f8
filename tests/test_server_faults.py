"""The OpenAI-compatible server under load and faults, over a real AsyncEngine (tiny random-weight
llama) on loopback: disconnects under load, client timeouts, a table of bad inputs, auth / body limit /
overload. The server is the session-wide `server` fixture (tests/conftest.py), shared with
test_server_api.py."""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time

import aiohttp

from server_harness import API_KEY, MODEL, NO_EOS, metric, metric_delta, scrape, wait_pool_free

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
    errors = [r for r in results
              if isinstance(r, BaseException) and not isinstance(r, asyncio.CancelledError)]
    assert not errors, errors[:3]
    assert sum(r is not None and not isinstance(r, BaseException) for r in results) == 64 - len(quitters)
    # Freed by aborts, at once: a quitter's 200 tokens could not have run to the end in this time.
    wait_pool_free(server, timeout=10.0)
    after = scrape(server.urls["main"])
    # Quitters that got headers had reached the engine (headers wait for its first output), so each
    # was aborted; the 7 cancelled while waiting may have left before the engine ever saw them.
    aborts = metric_delta(before, after, "jaxinfer:request_success_total", finished_reason="abort")
    assert len(quitters) - len(early_quitters(quitters)) <= aborts <= len(quitters)
    finished = metric_delta(before, after, "jaxinfer:request_success_total", finished_reason="length")
    assert finished == 64 - len(quitters)
    assert metric(after, "jaxinfer:http_requests_total", status="500") == 0


async def until(condition, what: str, limit_s: float = 120.0) -> None:
    """Wait for `condition` (state another thread changes); the limit only turns a hang into a
    failure, so a slow machine waits longer instead of failing."""
    deadline = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < deadline, f"still waiting for {what} after {limit_s} s"
        await asyncio.sleep(0.01)


def test_client_timeouts_then_new_request_is_fast(in_process_server, monkeypatch):
    """200 clients time out mid-request, after the engine has taken every one and is decoding; a
    new request is then served at once, every one of the 200 was aborted and none ran on. (The
    engine core in this process: the test holds its steps.)

    The timeouts fire on events, not after a fixed time (0.3 s let no request reach the engine on a
    loaded machine): the engine's steps are held until all 200 requests are in it, then the
    timeouts fire once the first stream has its first token. Each client's deadline is an
    asyncio.timeout, as aiohttp's ClientTimeout is: the task is cancelled and its connection closed."""
    import openai
    server = in_process_server
    client = openai.OpenAI(base_url=server.urls["main"] + "/v1", api_key="unused", max_retries=0,
                           timeout=60)
    url = server.urls["main"] + "/v1/completions"
    engine = server.engine.engine
    steps_allowed, first_token = threading.Event(), asyncio.Event()
    step = engine.step

    def held_step():  # on the engine's thread; requests are still added between steps
        steps_allowed.wait()
        return step()

    deadlines = []

    async def one(i, session):
        body = {"model": MODEL, "prompt": [7, 8, 9 + i % 100], "max_tokens": 200, "ignore_eos": True,
                "stream": i % 2 == 0}
        try:
            async with asyncio.timeout(None) as deadline:
                deadlines.append(deadline)
                async with session.post(url, json=body) as r:
                    if body["stream"]:  # a stream's headers come with its first token
                        first_token.set()
                    await r.read()
            return "completed"
        except TimeoutError:
            return "timeout"

    async def main():
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            tasks = [asyncio.create_task(one(i, session)) for i in range(200)]
            try:
                # Nothing runs while the steps are held: all 200 wait in the engine, or in its queue.
                await until(lambda: server.engine.num_waiting == 200, "the engine to hold 200 requests")
            finally:
                steps_allowed.set()
            await asyncio.wait_for(first_token.wait(), 120)
            now = asyncio.get_running_loop().time()
            for deadline in deadlines:
                deadline.reschedule(now)
            return await asyncio.gather(*tasks)

    # The same request idle first, so the bound below times the aborts, not its steps' compile.
    client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, extra_body=NO_EOS)
    before = scrape(server.urls["main"])
    monkeypatch.setattr(engine, "step", held_step)
    assert asyncio.run(main()) == ["timeout"] * 200
    t0 = time.monotonic()
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, extra_body=NO_EOS)
    assert time.monotonic() - t0 < 5.0 and r.usage.completion_tokens == 4
    wait_pool_free(server, timeout=10.0)
    after = scrape(server.urls["main"])
    # Every one reached the engine before its timeout, and none ran on to its 200 tokens: the first
    # stream had one token when they timed out.
    aborts = metric_delta(before, after, "jaxinfer:request_success_total", finished_reason="abort")
    assert aborts == 200
    finished = metric_delta(before, after, "jaxinfer:request_success_total", finished_reason="length")
    assert finished == 1  # "Hello" after the timeouts


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
    ("/v1/completions", {"prompt": "hi", "max_tokens": -1}, None, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "prompt_logprobs": 21}, None, 400, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "hi", "echo": True, "logprobs": 21}, None, 400, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "9"}, None, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "n": 0}, None, 400, "n"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 99}, None, 400, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "stream": "yes"}, None, 400, "stream"),
    ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, None, 400,
     "stream_options"),
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
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, None,
     400, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"content": "hi"}]}, None, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, None, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, None, 400,
     "top_logprobs"),
    ("/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, None, 400, "tools"),
    ("/detokenize", {"tokens": [-1]}, None, 400, "tokens"),
    ("/tokenize", {}, None, 400, "prompt"),
    ("/tokenize", {"messages": [{"role": "user", "content": "hi"}],
                   "chat_template_kwargs": {"add_generation_prompt": False}}, None, 400,
     "chat_template_kwargs"),
    ("/v1/completions", {"prompt": "hi", "n": 17}, None, 400, "n"),  # more than --max-num-seqs 16
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
            for method, path in (("GET", "/v1/nothing"), ("GET", "/v1/completions")):
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
