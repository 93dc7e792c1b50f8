"""`jaxinfer bench startup`: `jaxinfer serve` from process start to `/health` 200, cold and warm.

    jaxinfer bench startup [--model DIR] [--warm-runs 2] [--save [DIR]] [-- extra serve flags]
    jaxinfer bench startup --checkpoint-load [--shape qwen2.5-0.5b]   # load time alone

Each run is a fresh `jaxinfer serve` process (the Python module the installed `jaxinfer` command
runs). The cold run gets an empty
compilation cache directory (persistent XLA cache and executable cache); the warm runs reuse what
the cold run wrote. The server logs its phases once ready (jaxinfer/engine/startup.py): config,
tokenizer, weights, KV plan + allocation, warm-up, and inside warm-up jax's tracing, lowering, XLA
compile and cache-read seconds (summed over threads) and the executables loaded from the
executable cache. `before_engine_s` is the rest: process start, imports, server set-up.

Then, as a user does after `make serve` says it is serving, the README's first request (the
demo's `class Point` completion, 48 greedy tokens) goes out at once: `first_request_s`. Once the
server's background compiles are done (`jaxinfer:compiled_buckets` = `total_buckets` on
/metrics, or after 120 s) the same request five more times: `steady_request_s` (median; the
prompt's blocks then hit the prefix cache, as a user's repeat would), and
`first_over_steady` (the goal: <= 3 on a cold cache).

`--save` writes startup_<device>.json (results_io.py) with `time_to_ready_cold_s`,
`time_to_ready_warm_s` (the fastest warm run) and each run's phases; `--baseline FILE` copies the
metrics of an earlier record (e.g. this script run at the parent commit) in as `baseline_*` keys.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from jaxinfer.bench import checkpoint_load, common, results_io
from jaxinfer.bench.suites import add_suite_args, run_suite

ENGINE_PHASES = ("config", "tokenizer", "weights", "kv_plan_and_alloc", "warmup")  # sequential
PREFIX = "startup phases (s): "  # jaxinfer.engine.startup.STARTUP_LOG_PREFIX (older commits lack it)
# README.md's first request (its demo-example block).
FIRST_REQUEST = {"prompt": 'class Point:\n    """A point in the plane."""\n\n    def __init__(self, x, y):',
                 "max_tokens": 48, "temperature": 0}
COMPILE_WAIT_S = 120.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
            return r.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return False


def _get(port: int, path: str) -> bytes:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=30) as r:
        return r.read()


def _completion_s(port: int, model: str) -> float:
    body = json.dumps({"model": model, **FIRST_REQUEST}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                 {"Content-Type": "application/json"})
    start = time.perf_counter()
    with urllib.request.urlopen(req, timeout=300) as r:
        r.read()
    return time.perf_counter() - start


def _buckets(port: int) -> tuple[float, float]:
    """(compiled, total) step buckets from /metrics (summed over the server's engines)."""
    got = {"jaxinfer:compiled_buckets": 0.0, "jaxinfer:total_buckets": 0.0}
    for line in _get(port, "/metrics").decode().splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in got:
            got[name] += float(line.rsplit(" ", 1)[1])
    return got["jaxinfer:compiled_buckets"], got["jaxinfer:total_buckets"]


def first_and_steady(port: int) -> dict:
    """The README's first request right at ready, then its steady time (module docstring)."""
    model = json.loads(_get(port, "/v1/models"))["data"][0]["id"]
    first = _completion_s(port, model)
    deadline = time.perf_counter() + COMPILE_WAIT_S
    while (buckets := _buckets(port))[0] < buckets[1] and time.perf_counter() < deadline:
        time.sleep(0.5)
    steady = sorted(_completion_s(port, model) for _ in range(5))[2]
    return {"first_request_s": round(first, 3), "steady_request_s": round(steady, 3),
            "first_over_steady": round(first / steady, 2),
            "buckets_compiled_at_steady": f"{buckets[0]:.0f}/{buckets[1]:.0f}"}


def serve_once(model: str | None, cache_dir: str, extra: list[str], timeout_s: float) -> dict:
    """One server start: seconds to /health 200 and the phases the server logged."""
    port = _free_port()
    argv = [sys.executable, "-m", common.cli_module(), "--log-level", "info", "serve",
            "--port", str(port), "--compilation-cache-dir", cache_dir, *extra]
    if model:
        argv += ["--model", model]
    log_path = Path(cache_dir).parent / f"serve_{port}.log"
    env = {**os.environ, "TQDM_DISABLE": "1"}
    with open(log_path, "w") as log:
        start = time.perf_counter()
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            while not _healthy(port):
                if proc.poll() is not None:
                    raise RuntimeError(f"server exited {proc.returncode}:\n{log_path.read_text()}")
                if time.perf_counter() - start > timeout_s:
                    raise TimeoutError(f"not ready after {timeout_s} s:\n{log_path.read_text()}")
                time.sleep(0.05)
            ready = time.perf_counter() - start
            requests = first_and_steady(port)
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    phases: dict = {}
    for line in log_path.read_text().splitlines():
        if PREFIX in line:
            phases = json.loads(line.split(PREFIX, 1)[1])
    timed = sum(phases.get(k, 0.0) for k in ENGINE_PHASES)
    out = {"time_to_ready_s": round(ready, 2), **requests, **phases}
    if phases:
        out["before_engine_s"] = round(ready - timed, 2)
    return out


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("startup", help="time `jaxinfer serve` to ready, cold and warm caches",
                       description=__doc__, formatter_class=common.HelpFormatter,
                       usage=common.USAGE)
    p.add_argument("--model", default=None, help="model directory (default: the demo model)")
    p.add_argument("--warm-runs", type=int, default=2, help="starts after the cold one")
    p.add_argument("--timeout-s", type=float, default=300.0, help="per start")
    p.add_argument("--baseline", default=None,
                   help="an earlier record's JSON whose metrics become baseline_* keys")
    common.add_output_json(p, "the metrics")
    common.add_record_args(p, "startup_<device>")
    p.add_argument("serve_args", nargs="*",
                   help="extra `jaxinfer serve` flags (after --; with --suite, the suite's flags)")
    add_suite_args(p, "startup", positional=False)
    checkpoint_load.add_args(p)
    p.set_defaults(func=run, _parser=p)
    return p


def run(args: argparse.Namespace) -> int:
    if args.suite:
        args.suite_args = args.serve_args
        return run_suite(args)
    if args.checkpoint_load:
        result = checkpoint_load.run(args)
        if args.output_json:
            common.write_json(args.output_json, result)
        return 0
    with tempfile.TemporaryDirectory(prefix="bench_startup_") as tmp:
        cache = str(Path(tmp) / "cache")
        cold = serve_once(args.model, cache, args.serve_args, args.timeout_s)
        print(f"cold: {json.dumps(cold)}", flush=True)
        warm = []
        for i in range(args.warm_runs):
            warm.append(serve_once(args.model, cache, args.serve_args, args.timeout_s))
            print(f"warm {i}: {json.dumps(warm[-1])}", flush=True)
    best = min(warm, key=lambda r: r["time_to_ready_s"]) if warm else None
    metrics = {"time_to_ready_cold_s": cold["time_to_ready_s"],
               "time_to_ready_warm_s": best and best["time_to_ready_s"],
               "first_over_steady_cold": cold["first_over_steady"],
               "first_over_steady_warm": best and best["first_over_steady"],
               "cold_phases_s": cold, "warm_phases_s": best,
               "warm_runs_s": [r["time_to_ready_s"] for r in warm]}
    if args.baseline:
        base = json.loads(Path(args.baseline).read_text())
        metrics.update({f"baseline_{k}": v for k, v in base["metrics"].items()
                        if not k.startswith("baseline_")})
        metrics["baseline_commit"] = base["commit"]
    print(json.dumps(metrics, indent=1))
    if args.output_json:
        common.write_json(args.output_json, metrics)
    if args.save:
        import jax  # noqa: F401  (results_io.machine() names the device jax sees)
        name = args.name or f"startup_{results_io.device_slug()}"
        results_io.save(args.save, name, config={"model": args.model or "demo",
                                                 "serve_args": args.serve_args,
                                                 "warm_runs": args.warm_runs},
                        metrics=metrics)
    return 0
