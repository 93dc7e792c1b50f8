"""Soak test: N minutes of mixed random load, with disconnects, against `jaxinfer serve`.

Spawns `jaxinfer serve` (the bundled demo model unless --server-args say otherwise) on a free loopback
port, or targets a running server with --port (then --pid gives its RSS). `--concurrency` clients each
loop until the time is up, each request drawn at random from: completions and chat, streamed or not,
n = 2, several prompts at once, a stream the client drops after a few events, a client that gives up
after 50-300 ms, a bad request (must be a 4xx), /tokenize. Every `--sample-s` seconds it records the
server's RSS and the /metrics gauges. At the end it waits for the engine to go idle and reads how many
KV blocks are still held (leaked).

Reports: RSS over time (and its drift after the warm-up), leaked blocks, the count of 5xx answers,
p50/p99 latency of completed requests. Goal: RSS flat within +-10% after warm-up, 0 leaked blocks,
0 responses >= 500.

    jaxinfer bench serve --suite soak --save -- --minutes 20   # -> benchmarks/results/soak_cpu.json
    jaxinfer bench serve --suite soak -- --minutes 1 --port 8000 --pid $(pgrep -f "jaxinfer serve")

Only loopback addresses are targeted; the run stops by itself after --minutes (plus the drain).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
from jaxinfer.bench import results_io
from jaxinfer.bench.common import cli_module
from jaxinfer.paths import REPO_ROOT

WORDS = (
    "the quick brown fox jumps over a lazy dog once upon a time there was a little robot who "
    "liked to count numbers serving language models over http with streaming"
).split()
KINDS = (
    "completion",
    "completion_stream",
    "chat",
    "chat_stream",
    "n2",
    "multi_prompt",
    "disconnect",
    "client_timeout",
    "bad_request",
    "tokenize",
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mb(pid: int | None) -> float | None:
    if pid is None:
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def parse_metrics(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name_labels, _, value = line.rpartition(" ")
        name = name_labels.split("{", 1)[0]
        try:
            out[name] = out.get(name, 0.0) + float(value)
        except ValueError:
            pass
    return out


class Stats:
    def __init__(self):
        self.outcomes: dict[str, int] = {}
        self.status: dict[int, int] = {}
        self.latency: list[float] = []
        self.five_xx: list[str] = []
        self.stream_errors: list[dict] = []  # in-band {"error": ...} events of streams that had begun

    def count(self, key: str) -> None:
        self.outcomes[key] = self.outcomes.get(key, 0) + 1


def prompt_text(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 120)))


def make_request(kind: str, rng: random.Random, model: str) -> tuple[str, dict]:
    max_tokens = rng.randint(1, 48)
    sampling = {
        "temperature": rng.choice([0.0, 0.7, 1.0]),
        "max_tokens": max_tokens,
        "ignore_eos": rng.random() < 0.5,
        "seed": rng.randint(0, 2**31),
    }
    if rng.random() < 0.2:
        sampling.update(top_k=rng.randint(1, 50), top_p=0.9)
    if kind.startswith("chat"):
        return "/v1/chat/completions", {
            "model": model,
            "messages": [{"role": "user", "content": prompt_text(rng)}],
            "stream": kind.endswith("stream"),
            **sampling,
        }
    if kind == "n2":
        return "/v1/completions", {"model": model, "prompt": prompt_text(rng), "n": 2, **sampling}
    if kind == "multi_prompt":
        return "/v1/completions", {
            "model": model,
            "prompt": [prompt_text(rng) for _ in range(rng.randint(2, 4))],
            **sampling,
        }
    if kind == "bad_request":
        bad = rng.choice(
            [
                {"temperature": 10**400},
                {"top_k": 2**31},
                {"prompt": "\ud800"},
                {"max_tokens": -1},
                {"stop": ["x"] * 10_000},
                {"n": 10**9},
                {"min_tokens": 10**12, "max_tokens": None},
            ]
        )
        return "/v1/completions", {"model": model, "prompt": prompt_text(rng), **bad}
    if kind == "tokenize":
        return "/tokenize", {"model": model, "prompt": prompt_text(rng)}
    return "/v1/completions", {
        "model": model,
        "prompt": prompt_text(rng),
        "stream": kind in ("completion_stream", "disconnect", "client_timeout"),
        **sampling,
    }


def sample_row(metrics: dict, pid: int | None, t_start: float) -> dict:
    """One point of the RSS / KV-usage series from a /metrics scrape."""
    return {
        "t_s": round(time.monotonic() - t_start, 1),
        "rss_mb": rss_mb(pid),
        "used_blocks": metrics.get("jaxinfer:kv_cache_used_blocks"),
        "running": metrics.get("jaxinfer:num_requests_running"),
        "waiting": metrics.get("jaxinfer:num_requests_waiting"),
    }


async def one_request(
    session: aiohttp.ClientSession, base: str, kind: str, rng: random.Random, model: str, stats: Stats
) -> None:
    path, body = make_request(kind, rng, model)
    data = json.dumps(body).encode()  # (lone surrogates pass through json's escapes)
    t0 = time.perf_counter()
    timeout = aiohttp.ClientTimeout(total=rng.uniform(0.05, 0.3) if kind == "client_timeout" else 300)
    try:
        async with session.post(
            base + path, data=data, headers={"Content-Type": "application/json"}, timeout=timeout
        ) as r:
            stats.status[r.status] = stats.status.get(r.status, 0) + 1
            if r.status >= 500:
                stats.five_xx.append(f"{kind} {r.status}: {(await r.text())[:300]}")
                stats.count(f"{kind}:5xx")
                return
            if kind == "disconnect" and r.status == 200:
                for _ in range(rng.randint(0, 3)):
                    await r.content.readuntil(b"\n\n")
                r.close()
                stats.count("disconnect:dropped")
                return
            raw = await r.read()
            if kind == "bad_request":
                stats.count("bad_request:4xx" if 400 <= r.status < 500 else f"bad_request:{r.status}")
                return
            if r.status != 200:
                stats.count(f"{kind}:{r.status}")
                return
            if body.get("stream") and b"data: [DONE]" not in raw:
                stats.count(f"{kind}:incomplete_stream")
                return
            if body.get("stream"):
                errors = [
                    e
                    for e in (json.loads(ev[6:]) for ev in raw.split(b"\n\n") if ev.startswith(b"data: {"))
                    if "error" in e
                ]
                if errors:
                    stats.stream_errors.append(errors[0]["error"])
                    stats.count(f"{kind}:stream_error_{errors[0]['error'].get('code')}")
                    return
            stats.latency.append(time.perf_counter() - t0)
            stats.count(f"{kind}:ok")
    except asyncio.TimeoutError:
        stats.count(f"{kind}:client_timeout")
    except aiohttp.ClientError as e:
        stats.count(f"{kind}:client_error:{type(e).__name__}")


async def client_loop(base: str, deadline: float, rng: random.Random, model: str, stats: Stats) -> None:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=4)) as session:
        while time.monotonic() < deadline:
            kind = rng.choices(KINDS, weights=(4, 4, 3, 3, 1, 1, 2, 1, 1, 1))[0]
            await one_request(session, base, kind, rng, model, stats)


async def scrape(session: aiohttp.ClientSession, base: str) -> dict[str, float]:
    async with session.get(base + "/metrics") as r:
        return parse_metrics(await r.text())


async def sampler(
    base: str, pid: int | None, t_start: float, every: float, series: list, stop: asyncio.Event
):
    async with aiohttp.ClientSession() as session:
        while True:
            m = await scrape(session, base)
            series.append(sample_row(m, pid, t_start))
            try:
                await asyncio.wait_for(stop.wait(), every)
                return
            except asyncio.TimeoutError:
                pass


async def wait_healthy(base: str, proc: subprocess.Popen | None, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                raise SystemExit(f"server exited early with status {proc.returncode}")
            try:
                async with s.get(base + "/health") as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientConnectionError:
                pass
            await asyncio.sleep(0.5)
    raise SystemExit("server did not become healthy")


async def run(args, base: str, pid: int | None, proc) -> dict:
    await wait_healthy(base, proc, args.startup_timeout)
    async with aiohttp.ClientSession() as s:
        async with s.get(base + "/v1/models") as r:
            model = (await r.json())["data"][0]["id"]
    stats, series = Stats(), []
    t_start = time.monotonic()
    deadline = t_start + args.minutes * 60
    stop = asyncio.Event()
    sample_task = asyncio.create_task(sampler(base, pid, t_start, args.sample_s, series, stop))
    rng = random.Random(args.seed)
    await asyncio.gather(
        *(
            client_loop(base, deadline, random.Random(rng.random()), model, stats)
            for _ in range(args.concurrency)
        )
    )
    # Drain: the engine must go idle with every block back in the pool.
    async with aiohttp.ClientSession() as s:
        idle_deadline = time.monotonic() + 60
        while True:
            m = await scrape(s, base)
            idle = not m.get("jaxinfer:num_requests_running") and not m.get("jaxinfer:num_requests_waiting")
            if (idle and not m.get("jaxinfer:kv_cache_used_blocks")) or time.monotonic() > idle_deadline:
                break
            await asyncio.sleep(0.5)
    stop.set()
    await sample_task
    series.append(sample_row(m, pid, t_start))
    return summarize(args, stats, series, m)


def percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def summarize(args, stats: Stats, series: list, final: dict) -> dict:
    rss = [p["rss_mb"] for p in series if p["rss_mb"] is not None]
    warm = [p["rss_mb"] for p in series if p["rss_mb"] is not None and p["t_s"] >= args.warmup_s]
    drift = None
    if len(warm) >= 2:
        drift = {
            "after_warmup_first_mb": round(warm[0], 1),
            "after_warmup_min_mb": round(min(warm), 1),
            "after_warmup_max_mb": round(max(warm), 1),
            "last_mb": round(warm[-1], 1),
            "max_deviation_pct": round(100 * max(abs(x - warm[0]) for x in warm) / warm[0], 2),
        }
    total = sum(stats.status.values())
    return {
        "requests_sent": sum(stats.outcomes.values()),
        "responses_by_status": {str(k): v for k, v in sorted(stats.status.items())},
        # HTTP statuses >= 500, plus in-band error events >= 500 of streams that had begun.
        "responses_5xx": sum(v for k, v in stats.status.items() if k >= 500)
        + sum(1 for e in stats.stream_errors if (e.get("code") or 500) >= 500),
        "stream_errors": stats.stream_errors[:10],
        "five_xx_samples": stats.five_xx[:10],
        "outcomes": dict(sorted(stats.outcomes.items())),
        "completed_ok": len(stats.latency),
        "latency_s": {
            "p50": percentile(stats.latency, 50),
            "p99": percentile(stats.latency, 99),
            "max": max(stats.latency) if stats.latency else None,
        },
        "leaked_blocks": final.get("jaxinfer:kv_cache_used_blocks"),
        "idle_at_end": not final.get("jaxinfer:num_requests_running")
        and not final.get("jaxinfer:num_requests_waiting"),
        "kv_total_blocks": final.get("jaxinfer:kv_cache_total_blocks"),
        "rss_mb": {
            "start": round(rss[0], 1) if rss else None,
            "peak": round(max(rss), 1) if rss else None,
            "end": round(rss[-1], 1) if rss else None,
            "drift": drift,
        },
        "http_responses_seen": total,
        "series": series,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=5.0)
    ap.add_argument("--concurrency", type=int, default=8, help="clients, each one request at a time")
    ap.add_argument(
        "--port", type=int, help="target a running server on 127.0.0.1:PORT instead of spawning one"
    )
    ap.add_argument("--pid", type=int, help="the targeted server's pid (for RSS) when --port is given")
    ap.add_argument("--server-args", default="", help="extra `jaxinfer serve` flags for the spawned server")
    ap.add_argument("--sample-s", type=float, default=10.0, help="seconds between RSS / gauge samples")
    ap.add_argument("--warmup-s", type=float, default=120.0, help="RSS drift is measured after this")
    ap.add_argument("--startup-timeout", type=float, default=600.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--server-log", default="/tmp/jaxinfer_soak_server.log", help="the spawned server's stderr goes here"
    )
    ap.add_argument("--note", default="", help="free text stored with the result (e.g. machine load)")
    results_io.add_save_arg(ap, "soak_cpu")
    args = ap.parse_args(argv)

    commit = results_io.git_commit()  # of the code the server runs (the tree may change during the run)
    proc = None
    if args.port:
        port, pid = args.port, args.pid
    else:
        port = free_port()
        cmd = [
            sys.executable,
            "-m",
            cli_module(),
            "serve",
            "--port",
            str(port),
            *shlex.split(args.server_args),
        ]
        print("spawning:", " ".join(cmd), file=sys.stderr)
        log = open(args.server_log, "w")  # the server's whole life
        proc = subprocess.Popen(
            cmd,
            cwd=REPO_ROOT,
            stdout=subprocess.DEVNULL,
            stderr=log,
            env={**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")},
        )
        pid = proc.pid
    base = f"http://127.0.0.1:{port}"
    try:
        metrics = asyncio.run(run(args, base, pid, proc))
    finally:
        exit_status = None
        if proc is not None:
            proc.terminate()
            try:
                exit_status = proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                exit_status = proc.wait()
    metrics["server_exit_status"] = exit_status
    summary = {k: v for k, v in metrics.items() if k not in ("series", "outcomes")}
    print(json.dumps(summary, indent=2))
    if args.save:  # the client runs no jax: the machine is the host, the server's note beside it
        results_io.save(args.save, args.name or "soak_cpu", commit=commit,
                        machine_info={**results_io.machine(), "note": args.note},
                        config={k: v for k, v in vars(args).items() if k not in ("save", "name")},
                        metrics=metrics)
    ok = (
        metrics["responses_5xx"] == 0
        and not metrics["leaked_blocks"]
        and (metrics["rss_mb"]["drift"] or {}).get("max_deviation_pct", 0) <= 10
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
