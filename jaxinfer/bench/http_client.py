"""The serving benchmark's client: streams each request to an OpenAI-compatible server over
aiohttp and times it the way vLLM's client does, and reads the server's /v1/models and /metrics.

Definitions (as vLLM's): TTFT = request sent -> first chunk with choices; ITL = time between
successive chunks with choices; latency ends at the last token, not at [DONE]. Output token counts
come from the server's `usage` (stream_options.include_usage), not from re-tokenizing the text."""

from __future__ import annotations

import asyncio
import json
import re
import time

import aiohttp
import numpy as np

from jaxinfer.bench.datasets import BenchRequest
from jaxinfer.bench.serving_metrics import RequestResult
from jaxinfer.engine.metrics import STEP_PHASES


async def send_request(session: aiohttp.ClientSession, url: str, model: str, chat: bool,
                       req: BenchRequest, ignore_eos: bool, sampling: dict | None = None) -> RequestResult:
    body = {"model": model, "max_tokens": req.output_len, "stream": True, "temperature": 0.0,
            "ignore_eos": ignore_eos, "stream_options": {"include_usage": True}, **(sampling or {})}
    if chat:
        body["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        body["prompt"] = req.prompt
    result = RequestResult(prompt_len=req.prompt_len)
    start = result.start = time.perf_counter()
    last = start
    try:
        async with session.post(url, json=body) as resp:
            if resp.status != 200:
                result.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return result
            buffer = b""
            async for data in resp.content.iter_any():
                buffer += data
                while b"\n\n" in buffer:
                    event, buffer = buffer.split(b"\n\n", 1)
                    if not event.startswith(b"data: "):
                        continue
                    payload = event[len(b"data: "):]
                    if payload == b"[DONE]":
                        continue
                    chunk = json.loads(payload)
                    if "error" in chunk:
                        result.error = chunk["error"].get("message", "error event")
                        return result
                    if chunk.get("usage"):  # the server's own counts (chat adds the template)
                        result.output_tokens = chunk["usage"]["completion_tokens"]
                        result.prompt_len = chunk["usage"]["prompt_tokens"]
                    # As vLLM's client: every chunk with choices is a token event (the chat role
                    # chunk included, which servers send once the first token exists).
                    if chunk.get("choices"):
                        choice = chunk["choices"][0]
                        result.generated_text += (choice.get("delta") or {}).get("content") or \
                            choice.get("text") or ""
                        now = time.perf_counter()
                        if result.ttft == 0.0:
                            result.ttft = now - start
                        else:
                            result.itl.append(now - last)
                        last = now
        result.latency = last - start
        result.success = result.ttft > 0.0
        if not result.success:
            result.error = "no tokens streamed"
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        result.error = f"{type(e).__name__}: {e}"
    return result


def arrival_gaps(n: int, request_rate: float, burstiness: float, seed: int) -> list[float]:
    """Seconds before each request: none for an unlimited rate, else gamma-distributed gaps of mean
    1/rate (burstiness 1: Poisson arrivals; lower: burstier), as vLLM draws them."""
    if request_rate == float("inf"):
        return [0.0] * n
    rng = np.random.default_rng(seed)
    return rng.gamma(burstiness, 1.0 / (request_rate * burstiness), n).tolist()


async def run_benchmark(url: str, model: str, chat: bool, requests: list[BenchRequest],
                        request_rate: float, max_concurrency: int | None, ignore_eos: bool,
                        seed: int, burstiness: float = 1.0, headers: dict | None = None,
                        sampling: dict | None = None) -> tuple[list[RequestResult], float]:
    """Every request, sent at `request_rate` with at most `max_concurrency` in flight: the results
    in request order and the wall time of the whole run."""
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=6 * 3600)

    async with aiohttp.ClientSession(connector=connector, timeout=timeout, headers=headers) as session:
        async def one(req: BenchRequest) -> RequestResult:
            if limit is None:
                return await send_request(session, url, model, chat, req, ignore_eos, sampling)
            async with limit:
                return await send_request(session, url, model, chat, req, ignore_eos, sampling)

        tasks = []
        t0 = time.perf_counter()
        for req, gap in zip(requests, arrival_gaps(len(requests), request_rate, burstiness, seed)):
            if gap:
                await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(one(req)))
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - t0


async def fetch_model_info(base_url: str, headers: dict, wait_s: float = 0.0) -> dict:
    """The server's first model card (`id`, and where the server says them `root`, `max_model_len`);
    a server not answering yet is asked again for up to `wait_s` seconds (one that is still
    starting)."""
    deadline = time.monotonic() + wait_s
    async with aiohttp.ClientSession(headers=headers) as session:
        while True:
            try:
                async with session.get(f"{base_url}/v1/models") as resp:
                    resp.raise_for_status()
                    return (await resp.json())["data"][0]
            except aiohttp.ClientError:
                if time.monotonic() >= deadline:
                    raise
                await asyncio.sleep(0.5)


# /metrics counters read around a timed run: summed over their labels, but for the step loop's
# (EngineMetrics.track_stats), kept per `label` value as `<name>.<value>`.
_COUNTERS = ("prefix_cache_queries_total", "prefix_cache_hits_total", "compiled_buckets",
             "total_buckets", "generation_tokens_total")
_PER_LABEL = {"engine_steps_total": "stage", "engine_step_host_seconds_total": "phase"}


async def fetch_server_counters(base_url: str, headers: dict) -> dict[str, float]:
    """From the server's /metrics, `server_counters` of its text ({} if it has none)."""
    async with aiohttp.ClientSession(headers=headers) as session:
        async with session.get(f"{base_url}/metrics") as resp:
            if resp.status != 200:
                return {}
            return server_counters(await resp.text())


def server_counters(text: str) -> dict[str, float]:
    """The prefix cache's counters (prompt tokens looked up, of those found: jaxinfer's and vLLM's
    `<prefix>:prefix_cache_{queries,hits}_total`), jaxinfer's step buckets (`compiled_buckets`,
    `total_buckets`), generated tokens, and the engine's step loop (`engine_steps_total.<stage>`,
    `engine_step_host_seconds_total.<phase>`); the keys the server exposes."""
    totals: dict[str, float] = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        short = name.split("{")[0].rpartition(":")[2]
        if line.startswith("#") or (short not in _COUNTERS and short not in _PER_LABEL):
            continue
        if short in _PER_LABEL:
            label = re.search(rf'{_PER_LABEL[short]}="([^"]*)"', name)
            short = f"{short}.{label.group(1) if label else ''}"
        totals[short] = totals.get(short, 0.0) + float(value.split()[0])
    return totals


def engine_steps(before: dict, after: dict, duration_s: float) -> dict[str, float]:
    """The server engine's step loop over a run, from two `server_counters`: steps dispatched,
    generated tokens per step, the mean step period (the run's duration over its steps), and the
    host ms per dispatched step of each phase (`host_ms`: schedule + build + launch, as offline
    `host_ms_per_step`). {} from a server without these counters."""
    def delta(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)
    steps = delta("engine_steps_total.dispatched")
    if steps <= 0:
        return {}
    phases = {p: 1e3 * delta(f"engine_step_host_seconds_total.{p}") / steps for p in STEP_PHASES}
    return {"steps": steps,
            "tokens_per_step": delta("generation_tokens_total") / steps,
            "step_period_ms": 1e3 * duration_s / steps,
            "host_ms": phases["schedule"] + phases["build"] + phases["launch"],
            **{f"{p}_ms": ms for p, ms in phases.items()}}


def prefix_hit_rate(before: dict, after: dict) -> float | None:
    key_q, key_h = "prefix_cache_queries_total", "prefix_cache_hits_total"
    if key_q not in before or key_q not in after:
        return None
    queries = after[key_q] - before[key_q]
    return round((after[key_h] - before[key_h]) / queries, 4) if queries else 0.0


def buckets_compiling(counters: dict) -> int | None:
    """Step buckets the server was still compiling (its steps run padded meanwhile)."""
    if "total_buckets" not in counters:
        return None
    return int(counters["total_buckets"] - counters.get("compiled_buckets", 0))
