"""`jaxinfer bench host-path`: the serving host path's figures in one record (the
`host_path_<device>` keys of docs/engine_core.md), each section in a process of its own:

- bs1_host_ms_per_step, c256_host_ms_per_step, offline_c256_out_tok_s: `jaxinfer bench
  throughput` with 1 and --concurrency prompts (the engine's host ms per step);
- served_c1_itl_p50_ms, served_c1_tpot_ms, served_c256_out_tok_s: `jaxinfer serve` (its engine
  core in a process of its own; --engine-core in-process to compare) under `jaxinfer bench serve`
  at concurrency 1 and --concurrency;
- served_<run>_core_*: the engine core's own step loop over each served run (`jaxinfer bench
  serve`'s server_* keys, from the server's /metrics: steps, tokens per step, step period, host
  ms per step by phase), to set beside the offline figures;
- big_body_itl_p99_delta_ms: bench/big_body.py against the same server.

The server runs with `serve`'s own ITL target ("auto", SERVED_ITL_TARGET says why). Every section
runs with --decode-steps-per-call 1 unless told (the host's cost per step, and a
stream that gets every token as its step ends, not in the on-device loop's bursts), and compiles
every step bucket before it is ready (--no-background-compile): a bucket compiling beside a timed
run took the host's CPU and GIL (an H100 run at f96f5c2 timed 24 ms of host per batch-1 step so). --preset
llama8b: the Llama-3-8B shape with dummy bf16 weights and a generated tokenizer (bench/presets.py).

    jaxinfer bench host-path --preset llama8b [--engine-core in-process] --save [--name host_path_h200]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from jaxinfer.bench import common, presets, results_io
from jaxinfer.bench.big_body import big_body

BENCH = [sys.executable, "-m", "jaxinfer.bench.cli"]
# The served runs measure `serve` as users start it: its default ITL target. (Until "auto" counted
# the waiting requests (itl_target.py), it admitted c = 256's prompts a few at a time: an H100 run
# at 31ba4d7 had 107 tokens a step against ~220 offline; 468bd1b ran the server with it off.)
# --serve-args "--itl-target-ms off" schedules as offline does.
SERVED_ITL_TARGET = "auto"


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("host-path", help="the serving host path's figures (engine core process)",
                       description=__doc__, formatter_class=common.HelpFormatter)
    p.add_argument("--model", default=None, help="model directory (default: the demo model)")
    p.add_argument("--preset", choices=sorted(presets.PRESETS), default=None,
                   help="a preset's model shape with dummy weights (its workload flags unused)")
    p.add_argument("--decode-steps-per-call", type=int, default=1,
                   help="the engine's on-device decode loop (1: off)")
    p.add_argument("--engine-core", choices=("process", "in-process"), default="process")
    p.add_argument("--concurrency", type=int, default=256, help="the batched runs' requests")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--body-mb", type=float, default=30.0, help="the big body's size")
    p.add_argument("--port", type=int, default=8123, help="the server's port")
    p.add_argument("--serve-args", default="", help="more `jaxinfer serve` flags, one string")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per section")
    common.add_output_json(p, "the figures")
    common.add_record_args(p, "host_path_<device>")
    p.set_defaults(func=run)
    return p


def _json_out(argv: list[str], timeout: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        stdout, stderr, code = common.child([*argv, "--output-json", str(out)], timeout)
        if code != 0 or not out.is_file():
            raise RuntimeError(f"{' '.join(argv)} failed ({code}):\n{stderr[-3000:]}")
        return json.loads(out.read_text())


def offline(args, model: list[str]) -> dict:
    def run(n: int) -> dict:
        return _json_out([*BENCH, "throughput", *model, "--num-prompts", str(n), "--input-len",
                          str(args.input_len), "--output-len", str(args.output_len)], args.timeout)
    bs1, batched = run(1), run(args.concurrency)
    phases = {f"{run}_host_{phase}_ms": ms for run, out in (("bs1", bs1), ("c256", batched))
              for phase, ms in (out.get("host_breakdown_ms") or {}).items()}
    return {"bs1_host_ms_per_step": bs1["host_ms_per_step"], **phases,
            "offline_bs1_ms_per_token": 1e3 * bs1["elapsed_time"] / args.output_len,  # prefill in
            "c256_host_ms_per_step": batched["host_ms_per_step"],
            "offline_c256_out_tok_s": batched["output_tokens_per_second"],
            "offline_c256_prefix_hit_rate": batched.get("prefix_hit_rate"),
            "offline_buckets_compiling": max(bs1.get("buckets_compiling") or 0,
                                             batched.get("buckets_compiling") or 0)}


def served(args, model: list[str]) -> dict:
    serve = subprocess.Popen([sys.executable, "-m", "jaxinfer.cli.main", "serve", *model, "--port",
                              str(args.port), "--engine-core", args.engine_core,
                              "--itl-target-ms", SERVED_ITL_TARGET, *args.serve_args.split()])
    url = f"http://127.0.0.1:{args.port}"
    try:
        _wait_healthy(url, serve, args.timeout)
        out = {}
        # A seed per run: the c = 1 run's prompts would otherwise open the next run's list, and
        # the server's prefix cache would skip their prefill (`served_c256_prefix_hit_rate`).
        for seed, (conc, prompts) in enumerate(((1, 16), (args.concurrency, 2 * args.concurrency))):
            out[conc] = _bench_serve(args, url, seed, conc, prompts)
        figures = {"served_c1_itl_p50_ms": out[1]["median_itl_ms"],
                   "served_c1_tpot_ms": out[1]["median_tpot_ms"],
                   "served_c256_out_tok_s": out[args.concurrency]["output_throughput"],
                   "served_c256_prefix_hit_rate": out[args.concurrency].get("prefix_hit_rate")}
        for run, conc in (("c1", 1), ("c256", args.concurrency)):  # (bench serve's server_*)
            figures.update({f"served_{run}_core_{key[len('server_'):]}": v
                            for key, v in out[conc].items() if key.startswith("server_")})
        model_name = json.loads(urllib.request.urlopen(url + "/v1/models").read())["data"][0]["id"]
        bb = big_body(url, model_name, 8, args.output_len, args.body_mb)
        figures["big_body_itl_p99_delta_ms"] = bb["big_body_itl_p99_delta_ms"]
        return figures
    finally:
        serve.terminate()
        serve.wait(60)


def _bench_serve(args, url: str, seed: int, conc: int, prompts: int) -> dict:
    """One `jaxinfer bench serve` run -> its result file's figures."""
    with tempfile.TemporaryDirectory() as tmp:
        stdout, stderr, code = common.child([
            *BENCH, "serve", "--base-url", url, "--dataset-name", "random", "--seed", str(seed),
            "--num-prompts", str(prompts), "--max-concurrency", str(conc),
            "--random-input-len", str(args.input_len), "--random-output-len",
            str(args.output_len), "--ignore-eos", "--num-warmups", str(min(conc, 16)),
            "--save-result", "--result-dir", tmp, "--result-filename", "r.json"], args.timeout)
        if code != 0:
            raise RuntimeError(f"bench serve at concurrency {conc} failed ({code}):\n"
                               f"{stdout[-2000:]}\n{stderr[-3000:]}")
        return json.loads((Path(tmp) / "r.json").read_text())


def _wait_healthy(url: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"jaxinfer serve exited with status {proc.returncode}")
        try:
            urllib.request.urlopen(url + "/health", timeout=5)
            return
        except OSError:
            time.sleep(1)
    raise RuntimeError("jaxinfer serve did not become healthy")


def engine_flags(args) -> list[str]:
    """The model and engine flags every section's engine gets (`args.model` already resolved)."""
    flags = ["--decode-steps-per-call", str(args.decode_steps_per_call), "--no-background-compile"]
    if args.preset:
        preset = presets.PRESETS[args.preset]
        flags += ["--load-format", preset.flags["load_format"], "--dtype", preset.flags["dtype"]]
    return ["--model", args.model, *flags] if args.model else flags


def run(args: argparse.Namespace) -> int:
    if args.preset and not args.model:
        args.model = str(presets.PRESETS[args.preset].model_dir(args.preset))
    model = engine_flags(args)
    metrics: dict = {}
    for section in (offline, served):  # written after each: a run cut short keeps what it has
        metrics.update(section(args, model))
        print(json.dumps(metrics, indent=1), flush=True)
        if args.output_json:
            common.write_json(args.output_json, metrics)
        if args.save:
            results_io.save(args.save, args.name or f"host_path_{results_io.device_slug()}",
                            config={**common.record_config(args),
                                    "served_itl_target_ms": SERVED_ITL_TARGET},
                            metrics=common.numeric(metrics))
    return 0

