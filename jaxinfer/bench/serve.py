"""`jaxinfer bench serve`: online serving benchmark of any OpenAI-compatible server (jaxinfer serve,
vLLM, SGLang, ...), after `vllm bench serve`, with its flags and its result file.

An aiohttp client streams requests from a random or ShareGPT-format dataset at --request-rate
(gamma-distributed arrivals, Poisson at --burstiness 1) under a --max-concurrency cap, and prints
vLLM's result block. --save-result writes the JSON file `vllm bench serve --save-result` writes
(the same keys; --save-detailed adds the per-request arrays), so vLLM's plotting scripts read it;
--save/--record NAME writes the project's record instead. --sweep-concurrency 1,4,16 runs one
benchmark per concurrency (one result file each) and plots throughput and latency against it.
--suite soak runs the soak instead (minutes of mixed load and disconnects against a server it
starts; jaxinfer/bench/suites/soak.py), its own flags after `--`.

    jaxinfer serve --port 8000 &
    jaxinfer bench serve --port 8000 --dataset-name random --num-prompts 200 \\
        --random-input-len 128 --random-output-len 64 --max-concurrency 16 --save-result
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
from pathlib import Path

import aiohttp
import numpy as np

from jaxinfer.bench import common, http_client, results_io, serving_metrics
from jaxinfer.bench.datasets import DATASETS, BenchRequest, load_tokenizer, random_requests, sharegpt_requests
from jaxinfer.bench.suites import add_suite_args, run_suite

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
# vLLM's --backend names of the OpenAI-compatible APIs -> the endpoint each calls.
BACKENDS = {"openai": ENDPOINTS[0], "vllm": ENDPOINTS[0], "openai-chat": ENDPOINTS[1]}


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("serve", help="online: stream requests to a running server (TTFT, TPOT, ITL, goodput)",
                       description=__doc__, formatter_class=common.HelpFormatter,
                       usage=common.USAGE)
    g = p.add_argument_group("server")
    g.add_argument("--base-url", default=None, help="server root, e.g. http://127.0.0.1:8000 "
                                                    "(default: http://HOST:PORT)")
    g.add_argument("--host", default="127.0.0.1", help="server host, without --base-url")
    g.add_argument("--port", type=int, default=8000, help="server port, without --base-url")
    g.add_argument("--backend", default="openai", choices=sorted(BACKENDS),
                   help="vLLM's name of the API: openai and vllm call /v1/completions, "
                        "openai-chat /v1/chat/completions")
    g.add_argument("--endpoint", default=None, choices=ENDPOINTS,
                   help="the API to call (default: --backend's)")
    g.add_argument("--model", default=None, help="model name to send (default: the server's first)")
    g.add_argument("--tokenizer", default=None,
                   help="directory with tokenizer.json, to build prompts and count their tokens "
                        "(default: the served model's directory, else the demo model's)")
    g.add_argument("--api-key", default=None, help="sent as `Authorization: Bearer KEY`")
    g.add_argument("--header", nargs="+", default=None, metavar="KEY=VALUE",
                   help="more headers sent with every request")
    g.add_argument("--ready-check-timeout-sec", type=float, default=0,
                   help="wait up to this long for the server's /v1/models to answer first")
    g = p.add_argument_group("dataset")
    g.add_argument("--dataset-name", default="random", choices=DATASETS, help="where prompts come from")
    g.add_argument("--dataset-path", default=None, help="ShareGPT-format JSON file")
    g.add_argument("--num-prompts", type=int, default=1000, help="requests to send")
    g.add_argument("--random-input-len", type=int, default=1024, help="prompt tokens")
    g.add_argument("--random-output-len", type=int, default=128, help="tokens to generate")
    g.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths uniform in len * [1 - r, 1 + r]")
    g.add_argument("--sharegpt-output-len", type=int, default=None, help="override the replies' lengths")
    g.add_argument("--seed", type=int, default=0, help="of the prompts and the arrival times")
    g = p.add_argument_group("traffic")
    g.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests per second (inf: all at once)")
    g.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the arrival gaps: 1 is Poisson, lower is burstier")
    g.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight at once")
    g.add_argument("--big-body", type=float, default=None, metavar="MB",
                   help="instead: the ITL p99 of --max-concurrency (default 8) streams of "
                        "--random-output-len tokens with and without one MB-sized body posted "
                        "meanwhile (big_body.py)")
    g.add_argument("--sweep-concurrency", default=None, metavar="N,N,...",
                   help="one benchmark per concurrency, plus a plot (--plot)")
    g.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=None,
                   help="generate exactly the requested lengths, past EOS (default: on for "
                        "--dataset-name random, as vLLM)")
    g.add_argument("--num-warmups", type=int, default=0,
                   help="requests sent (and not counted) before the timed run")
    g = p.add_argument_group("sampling (sent with every request)")
    g.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--top-k", type=int, default=None)
    g = p.add_argument_group("results (vLLM's result file)")
    g.add_argument("--percentile-metrics", default=",".join(serving_metrics.DEFAULT_PERCENTILE_METRICS),
                   help="comma-separated metrics to report percentiles of: ttft, tpot, itl, e2el")
    g.add_argument("--metric-percentiles", default="99", help="comma-separated percentiles")
    g.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                   help="SLOs for request goodput, e.g. ttft:500 tpot:50 e2el:2000")
    g.add_argument("--save-result", action="store_true", help="write the result file")
    g.add_argument("--save-detailed", action="store_true",
                   help="keep the per-request arrays (ttfts, itls, input_lens, ...) in it")
    g.add_argument("--result-dir", default=".", help="where --save-result writes")
    g.add_argument("--result-filename", default=None,
                   help="default: {label}-{request_rate}qps[-concurrency{N}]-{model}-{date}.json")
    g.add_argument("--append-result", action="store_true",
                   help="append the result to the file as one JSON line (as vLLM)")
    g.add_argument("--metadata", nargs="+", default=None, metavar="KEY=VALUE",
                   help="extra keys written into the result file")
    g.add_argument("--label", default=None, help="the file's label (default: --backend)")
    g.add_argument("--plot", default="serving_sweep.png", help="PNG path for --sweep-concurrency")
    add_suite_args(p, "serve")
    common.add_record_args(p, "serving")
    p.set_defaults(func=run, _parser=p)
    return p


def check_args(args: argparse.Namespace) -> None:
    """Values argparse cannot check alone, as a usage error naming the flag."""
    p = args._parser
    try:
        args.goodput = serving_metrics.parse_goodput(args.goodput)
        args.metric_percentiles = tuple(float(x) for x in str(args.metric_percentiles).split(","))
        args.percentile_metrics = serving_metrics.parse_percentile_metrics(args.percentile_metrics)
    except ValueError as e:
        p.error(str(e))
    if args.dataset_name == "sharegpt" and not args.dataset_path:
        p.error("--dataset-name sharegpt needs --dataset-path")
    if args.request_rate <= 0:
        p.error(f"--request-rate must be > 0, got {args.request_rate}")
    if args.max_concurrency is not None and args.max_concurrency <= 0:
        p.error(f"--max-concurrency must be > 0, got {args.max_concurrency}")
    if args.burstiness <= 0:
        p.error(f"--burstiness must be > 0, got {args.burstiness}")
    if args.ignore_eos is None:
        args.ignore_eos = args.dataset_name == "random"
    if args.num_warmups < 0:
        p.error(f"--num-warmups must be >= 0, got {args.num_warmups}")
    if args.endpoint is None:
        args.endpoint = BACKENDS[args.backend]
    elif BACKENDS[args.backend] != args.endpoint:  # --endpoint names the API; the file says it
        args.backend = "openai-chat" if args.endpoint == ENDPOINTS[1] else "openai"
    args.header = _pairs(p, "--header", args.header)
    args.metadata = _pairs(p, "--metadata", args.metadata)


def _pairs(parser, flag: str, items: list[str] | None) -> dict[str, str]:
    out = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            parser.error(f"{flag} {item!r}: expected KEY=VALUE")
        out[key.strip()] = value.strip()
    return out


def default_tokenizer(card: dict) -> str:
    """The served model's directory where the server names one (jaxinfer's `root`), else the
    demo model's."""
    from jaxinfer.paths import DEFAULT_MODEL
    root = card.get("root")
    return root if root and (Path(root) / "tokenizer.json").is_file() else str(DEFAULT_MODEL)


def sweep_metrics(rows: list[dict]) -> dict:
    """The record's flat metrics: each concurrency's figures as `c<N>_<figure>` ("c_inf" for no
    limit), leaving out the per-request arrays."""
    out = {}
    for m in rows:
        conc = "inf" if m["max_concurrency"] is None else m["max_concurrency"]
        out.update({f"c{conc}_{k}": (round(v, 3) if isinstance(v, float) else v)
                    for k, v in m.items() if not isinstance(v, list)
                    and k not in ("max_concurrency", "request_rate", "burstiness")})
    return out


def plot_sweep(rows: list[dict], path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    conc = [r["max_concurrency"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax1.plot(conc, [r["output_throughput"] for r in rows], "o-", label="output tok/s")
    ax1.plot(conc, [r["total_token_throughput"] for r in rows], "s--", label="total tok/s")
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xticks(conc, [str(c) for c in conc])
    ax1.set_xlabel("max concurrency")
    ax1.set_ylabel("tokens / s")
    ax1.legend()
    ax1.grid(alpha=0.3)
    for key, label in (("median_ttft_ms", "median TTFT"), ("median_tpot_ms", "median TPOT"),
                       ("p99_itl_ms", "p99 ITL")):
        if key in rows[0]:
            ax2.plot(conc, [r[key] for r in rows], "o-", label=label)
    ax2.set_yscale("log")
    ax2.set_xlabel("max concurrency")
    ax2.set_ylabel("ms")
    ax2.legend()
    ax2.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def save_result(args, metrics: dict, model: str, tokenizer: str, num_prompts: int) -> Path:
    result = serving_metrics.vllm_result(metrics, endpoint=args.endpoint, model=model,
                                         tokenizer=tokenizer, num_prompts=num_prompts,
                                         label=args.label, detailed=args.save_detailed,
                                         backend=args.backend, metadata=args.metadata)
    conc = "" if metrics["max_concurrency"] is None else f"-concurrency{metrics['max_concurrency']}"
    name = args.result_filename or (f"{args.label or args.backend}-{args.request_rate}qps{conc}-"
                                    f"{Path(model).name}-{result['date']}.json")
    if args.result_filename and args.sweep_concurrency:  # one file per concurrency
        name = f"{Path(name).stem}{conc}{Path(name).suffix}"
    path = Path(args.result_dir) / name
    if not args.append_result:
        return common.write_json(path, result)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:  # vLLM's: one JSON document per line
        f.write(("\n" if f.tell() else "") + json.dumps(result, allow_nan=False))
    print(f"appended to {path}")
    return path


def run(args: argparse.Namespace) -> int:
    if args.suite_args and not args.suite:
        args._parser.error("flags after -- need --suite NAME")
    if args.suite:
        return run_suite(args)
    check_args(args)
    base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    headers = {**args.header, **({"Authorization": f"Bearer {args.api_key}"} if args.api_key else {})}
    try:
        card = asyncio.run(http_client.fetch_model_info(base_url, headers, args.ready_check_timeout_sec))
    except aiohttp.ClientError as e:
        args._parser.exit(2, f"jaxinfer bench serve: error: no server answers at {base_url}/v1/models "
                             f"({type(e).__name__}: {e})\n")
    model = args.model or card["id"]
    if args.big_body:
        from jaxinfer.bench.big_body import big_body
        result = big_body(base_url, model, args.max_concurrency or 8, args.random_output_len,
                          args.big_body)
        if args.save:
            results_io.save(args.save, args.name or f"big_body_{results_io.device_slug()}",
                            config=common.record_config(args), metrics=common.numeric(result))
        return 0
    tokenizer_path = args.tokenizer or default_tokenizer(card)
    chat = args.endpoint == "/v1/chat/completions"
    tokenizer = load_tokenizer(tokenizer_path)

    def make_requests(seed: int) -> list[BenchRequest]:
        if args.dataset_name == "random":
            return random_requests(tokenizer, args.num_prompts, args.random_input_len,
                                   args.random_output_len, args.random_range_ratio,
                                   np.random.default_rng(seed), as_text=chat)
        return sharegpt_requests(tokenizer, args.dataset_path, args.num_prompts,
                                 card.get("max_model_len") or 1 << 30, args.sharegpt_output_len,
                                 random.Random(seed))
    url = base_url + args.endpoint
    concurrencies = ([int(c) for c in args.sweep_concurrency.split(",")] if args.sweep_concurrency
                     else [args.max_concurrency])
    rows = []
    for i, conc in enumerate(concurrencies):
        # Each sweep point its own random prompts: the server's prefix cache holds the last
        # point's, which would skip their prefill (`prefix_hit_rate` says what it skipped).
        requests = make_requests(args.seed + i)
        print(f"model={model} endpoint={args.endpoint} prompts={len(requests)} "
              f"request_rate={args.request_rate} burstiness={args.burstiness} max_concurrency={conc}")
        sampling = {k: v for k, v in (("temperature", args.temperature), ("top_p", args.top_p),
                                      ("top_k", args.top_k)) if v is not None}
        if args.num_warmups:  # compiles and caches warmed, outside the timed run
            asyncio.run(http_client.run_benchmark(
                url, model, chat, make_requests(args.seed + 1000 + i)[:args.num_warmups],
                float("inf"), conc, args.ignore_eos, args.seed, headers=headers, sampling=sampling))
        before = asyncio.run(http_client.fetch_server_counters(base_url, headers))
        results, duration = asyncio.run(http_client.run_benchmark(
            url, model, chat, requests, args.request_rate, conc, args.ignore_eos, args.seed,
            burstiness=args.burstiness, headers=headers, sampling=sampling))
        metrics = serving_metrics.summarize(results, duration, args.request_rate, conc, args.goodput,
                                            args.metric_percentiles, args.percentile_metrics)
        metrics["burstiness"] = args.burstiness
        after = asyncio.run(http_client.fetch_server_counters(base_url, headers))
        metrics["prefix_hit_rate"] = http_client.prefix_hit_rate(before, after)
        metrics["buckets_compiling"] = http_client.buckets_compiling(before)  # at the run's start
        metrics.update({f"server_{k}": v for k, v in
                        http_client.engine_steps(before, after, duration).items()})
        serving_metrics.print_result(metrics)
        rows.append(metrics)
        if args.save_result:
            save_result(args, metrics, model, tokenizer_path, len(requests))
    if args.save:
        config = {"model": model, "endpoint": args.endpoint, "dataset": args.dataset_name,
                  "num_prompts": len(requests), "random_input_len": args.random_input_len,
                  "random_output_len": args.random_output_len,
                  "request_rate": "inf" if args.request_rate == float("inf") else args.request_rate,
                  "burstiness": args.burstiness, "ignore_eos": args.ignore_eos,
                  "goodput": args.goodput, "base_url": base_url}
        results_io.save(args.save, args.name or "serving", config=config, metrics=sweep_metrics(rows))
    if args.sweep_concurrency:
        workload = (f"random {args.random_input_len} in / {args.random_output_len} out"
                    if args.dataset_name == "random" else "ShareGPT")
        plot_sweep(rows, args.plot, f"{model} {args.endpoint}: {workload}")
    return 0 if all(r["failed"] == 0 for r in rows) else 1
