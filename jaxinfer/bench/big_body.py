"""What a huge request body costs the streams already running: --streams streaming completions of
--output-len tokens run on a server, and one --body-mb MB JSON body (a prompt of that much text,
which the server parses and tokenizes before refusing it for its length) is posted while they
run; the same streams run again without it. Reports the streams' inter-token latency p50 / p99
both times and the p99's difference (`big_body_itl_p99_delta_ms`).

    jaxinfer bench serve --big-body 30 --port 8000 [--max-concurrency 8 --random-output-len 200]
"""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import numpy as np


async def _stream(session, url: str, model: str, output_len: int, gaps: list, seed: int) -> None:
    body = {"model": model, "prompt": f"Request {seed}: once upon a time", "max_tokens": output_len,
            "ignore_eos": True, "temperature": 0.0, "stream": True}
    last = None
    async with session.post(url + "/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        async for line in r.content:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            now = time.perf_counter()
            if last is not None:
                gaps.append(now - last)
            last = now


def _big_body(model: str, mb: float) -> bytes:
    """Made before the streams start: building 30 MB of JSON takes ~90 ms, which in this client's
    event loop would stall its own reading of the streams and count as the server's."""
    words = "hello world " * int(mb * 1e6 / 12)
    return json.dumps({"model": model, "prompt": words, "max_tokens": 1}).encode()


async def _post_big(session, url: str, data: bytes, delay_s: float) -> tuple[int, float]:
    await asyncio.sleep(delay_s)
    t0 = time.perf_counter()
    async with session.post(url + "/v1/completions", data=data,
                            headers={"Content-Type": "application/json"}) as r:
        await r.read()
        return r.status, time.perf_counter() - t0


async def _run(url: str, model: str, streams: int, output_len: int, body: bytes | None) -> dict:
    gaps: list[float] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        tasks = [_stream(session, url, model, output_len, gaps, i) for i in range(streams)]
        big = None
        if body:
            # posted once every stream is well under way (and far from its end)
            big = asyncio.ensure_future(_post_big(session, url, body, 0.2))
        await asyncio.gather(*tasks)
        status, seconds = await big if big is not None else (None, None)
    ms = np.asarray(gaps) * 1e3
    return {"itl_p50_ms": float(np.percentile(ms, 50)), "itl_p99_ms": float(np.percentile(ms, 99)),
            "itl_max_ms": float(ms.max()), "big_body_status": status, "big_body_s": seconds}


def big_body(url: str, model: str, streams: int = 8, output_len: int = 200,
             body_mb: float = 30.0) -> dict:
    asyncio.run(_run(url, model, streams, output_len, None))  # warm: every step shape compiled
    quiet = asyncio.run(_run(url, model, streams, output_len, None))
    loaded = asyncio.run(_run(url, model, streams, output_len, _big_body(model, body_mb)))
    result = {"quiet_" + k: v for k, v in quiet.items() if v is not None}
    result.update({"big_body_" + k.removeprefix("big_body_"): v for k, v in loaded.items()
                   if v is not None})
    result["big_body_itl_p99_delta_ms"] = loaded["itl_p99_ms"] - quiet["itl_p99_ms"]
    print(f"{streams} streams x {output_len} tokens: ITL p99 {quiet['itl_p99_ms']:.1f} ms quiet, "
          f"{loaded['itl_p99_ms']:.1f} ms with a {body_mb:g} MB body posted (answered "
          f"{loaded['big_body_status']} in {loaded['big_body_s']:.2f} s): delta "
          f"{result['big_body_itl_p99_delta_ms']:.1f} ms (max gap {loaded['itl_max_ms']:.1f} ms)")
    return result
