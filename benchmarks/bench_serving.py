"""Online serving benchmark for any OpenAI-compatible server (jaxinfer serve, vLLM, ...), after vLLM's
`vllm bench serve`: an aiohttp client streams requests from a random or ShareGPT-format dataset at a
Poisson `--request-rate` and/or under a `--max-concurrency` cap, and prints vLLM's result block
(throughput; mean/median/std/p99 TTFT, TPOT, ITL, E2EL; goodput under `--goodput` SLOs). Requests
stop at EOS unless `--ignore-eos`, as in vLLM. `--save-result` writes the JSON file `vllm bench serve
--save-result` writes (serving_metrics.py: same keys, per-request arrays included), `--save` the
repository's benchmark record. `--sweep-concurrency 1,4,16` runs one benchmark per concurrency and
plots throughput and latency against it (`--plot`, needs matplotlib).

    jaxinfer serve --port 8000 &
    python -m benchmarks.bench_serving --port 8000 --dataset-name random --num-prompts 200 \\
        --random-input-len 128 --random-output-len 64 --max-concurrency 16 --save --name serving_cpu

Definitions (as in vLLM's client): TTFT = request sent -> first chunk with choices; ITL = time between
successive chunks with choices; TPOT = (latency - TTFT) / (output tokens - 1). Output token counts
come from the server's `usage` (stream_options.include_usage), not from re-tokenizing the text.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import sys
import time
from pathlib import Path

import aiohttp
import numpy as np

from benchmarks import results_io
from benchmarks.serving_metrics import RequestResult, parse_goodput, print_result, summarize, vllm_result

REPO_ROOT = Path(__file__).resolve().parent.parent


@dataclasses.dataclass
class BenchRequest:
    prompt: str | list[int]  # text, or token ids (completions only: exact prompt lengths)
    prompt_len: int
    output_len: int


def load_tokenizer(path: str):
    from jaxinfer.model.tokenizer import Tokenizer
    return Tokenizer.from_dir(path)


def random_requests(tokenizer, n: int, input_len: int, output_len: int, range_ratio: float,
                    rng: np.random.Generator, as_text: bool) -> list[BenchRequest]:
    """Prompts of random token ids (lengths uniform in len*(1 +- range_ratio)), special tokens excluded."""
    special = set(tokenizer.eos_token_ids) | ({tokenizer.bos_token_id} - {None})
    vocab = np.array([t for t in range(tokenizer.vocab_size) if t not in special])
    out = []
    for _ in range(n):
        lo, hi = max(1, int(input_len * (1 - range_ratio))), int(input_len * (1 + range_ratio))
        plen = int(rng.integers(lo, hi + 1))
        olo, ohi = max(1, int(output_len * (1 - range_ratio))), int(output_len * (1 + range_ratio))
        olen = int(rng.integers(olo, ohi + 1))
        ids = rng.choice(vocab, size=plen).tolist()
        if as_text:
            text = tokenizer.decode(ids)
            out.append(BenchRequest(text, len(tokenizer.encode(text)), olen))
        else:
            out.append(BenchRequest(ids, plen, olen))
    return out


def sharegpt_requests(tokenizer, path: str, n: int, max_model_len: int, fixed_output_len: int | None,
                      rng: random.Random) -> list[BenchRequest]:
    """ShareGPT JSON: [{"conversations": [{"from": "human", "value": ...}, {"from": "gpt", ...}]}].
    The first turn is the prompt, the reply's length the output length; pairs that are too short or do
    not fit the context are skipped, as in vLLM."""
    data = json.loads(Path(path).read_text())
    convs = [d["conversations"] for d in data if len(d.get("conversations", [])) >= 2]
    rng.shuffle(convs)
    out = []
    for conv in convs:
        prompt, reply = conv[0]["value"], conv[1]["value"]
        plen = len(tokenizer.encode(prompt))
        olen = fixed_output_len or len(tokenizer.encode(reply))
        if plen < 4 or olen < 4 or plen + olen > max_model_len:
            continue
        out.append(BenchRequest(prompt, plen, olen))
        if len(out) == n:
            break
    if len(out) < n:
        print(f"warning: only {len(out)} usable conversations in {path} (asked for {n})", file=sys.stderr)
    return out


async def send_request(session: aiohttp.ClientSession, url: str, model: str, chat: bool,
                       req: BenchRequest, ignore_eos: bool) -> RequestResult:
    body = {"model": model, "max_tokens": req.output_len, "stream": True, "temperature": 0.0,
            "ignore_eos": ignore_eos, "stream_options": {"include_usage": True}}
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
        result.latency = last - start  # to the last token, not to [DONE] (as vLLM)
        result.success = result.ttft > 0.0
        if not result.success:
            result.error = "no tokens streamed"
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        result.error = f"{type(e).__name__}: {e}"
    return result


async def run_benchmark(url: str, model: str, chat: bool, requests: list[BenchRequest],
                        request_rate: float, max_concurrency: int | None, ignore_eos: bool,
                        seed: int) -> tuple[list[RequestResult], float]:
    rng = np.random.default_rng(seed)
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=6 * 3600)

    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        async def one(req: BenchRequest) -> RequestResult:
            if limit is None:
                return await send_request(session, url, model, chat, req, ignore_eos)
            async with limit:
                return await send_request(session, url, model, chat, req, ignore_eos)

        tasks = []
        t0 = time.perf_counter()
        for req in requests:
            tasks.append(asyncio.create_task(one(req)))
            if request_rate != float("inf"):  # Poisson arrivals: exponential gaps
                await asyncio.sleep(rng.exponential(1.0 / request_rate))
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - t0


def sweep_metrics(rows: list[dict]) -> dict:
    """The record's flat metrics: each concurrency's figures as `c<N>_<figure>` ("c_inf" for no
    limit), leaving out the per-request arrays."""
    out = {}
    for m in rows:
        conc = "inf" if m["max_concurrency"] is None else m["max_concurrency"]
        out.update({f"c{conc}_{k.rstrip(':')}": (round(v, 3) if isinstance(v, float) else v)
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


async def fetch_model_info(base_url: str, headers: dict) -> tuple[str, int | None]:
    async with aiohttp.ClientSession(headers=headers) as session:
        async with session.get(f"{base_url}/v1/models") as resp:
            resp.raise_for_status()
            card = (await resp.json())["data"][0]
    return card["id"], card.get("max_model_len")


async def fetch_server_counters(base_url: str, headers: dict) -> dict[str, float]:
    """From the server's /metrics: the prefix cache's counters (prompt tokens looked up, of those
    found: jaxinfer's and vLLM's `<prefix>:prefix_cache_{queries,hits}_total`) and jaxinfer's step
    buckets (`compiled_buckets`, `total_buckets`); the keys the server exposes."""
    names = ("prefix_cache_queries_total", "prefix_cache_hits_total", "compiled_buckets",
             "total_buckets")
    totals: dict[str, float] = {}
    async with aiohttp.ClientSession(headers=headers) as session:
        async with session.get(f"{base_url}/metrics") as resp:
            if resp.status != 200:
                return totals
            text = await resp.text()
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        short = name.split("{")[0].rpartition(":")[2]
        if short in names and not line.startswith("#"):
            totals[short] = totals.get(short, 0.0) + float(value.split()[0])
    return totals


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


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default=None, help="server root, e.g. http://127.0.0.1:8000")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--endpoint", default="/v1/completions",
                   choices=["/v1/completions", "/v1/chat/completions"])
    p.add_argument("--model", default=None, help="model name to send (default: the server's first model)")
    p.add_argument("--tokenizer", default=str(REPO_ROOT / "checkpoints" / "demo-target"),
                   help="directory with tokenizer.json, to build prompts and count their tokens")
    p.add_argument("--api-key", default=None)
    p.add_argument("--dataset-name", default="random", choices=["random", "sharegpt"])
    p.add_argument("--dataset-path", default=None, help="ShareGPT-format JSON file")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--random-input-len", type=int, default=128)
    p.add_argument("--random-output-len", type=int, default=64)
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    p.add_argument("--sharegpt-output-len", type=int, default=None, help="override the replies' lengths")
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests per second, Poisson arrivals (default: inf = all at once)")
    p.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight at once")
    p.add_argument("--sweep-concurrency", default=None,
                   help="comma-separated concurrencies: one benchmark each, plus a plot")
    p.add_argument("--plot", default="serving_sweep.png", help="PNG path for --sweep-concurrency")
    p.add_argument("--ignore-eos", action="store_true",
                   help="generate exactly the requested lengths, past EOS (default: stop at EOS, as vLLM)")
    p.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                   help="SLOs for request goodput, e.g. ttft:500 tpot:50 e2el:2000 (as vLLM)")
    p.add_argument("--metric-percentiles", default="99",
                   help="comma-separated percentiles reported for each latency (as vLLM)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-result", action="store_true",
                   help="write vLLM's result file (every key `vllm bench serve` writes, per-request arrays "
                        "included) to --result-dir/--result-filename")
    p.add_argument("--result-dir", default=".")
    p.add_argument("--result-filename", default=None,
                   help="default: jaxinfer-<concurrency>concurrency-<model>-<date>.json")
    p.add_argument("--label", default=None, help="the result file's label")
    results_io.add_save_arg(p, "serving")
    args = p.parse_args(argv)
    try:
        args.goodput = parse_goodput(args.goodput)
        args.metric_percentiles = tuple(float(x) for x in args.metric_percentiles.split(","))
    except ValueError as e:
        p.error(str(e))
    if args.dataset_name == "sharegpt" and not args.dataset_path:
        p.error("--dataset-name sharegpt needs --dataset-path")
    if args.request_rate <= 0:
        p.error(f"--request-rate must be > 0, got {args.request_rate}")
    return args


def save_result(args, metrics: dict, model: str, num_prompts: int) -> Path:
    result = vllm_result(metrics, endpoint=args.endpoint, model=model, tokenizer=args.tokenizer,
                         num_prompts=num_prompts, label=args.label)
    conc = "" if metrics["max_concurrency"] is None else f"-{metrics['max_concurrency']}concurrency"
    name = args.result_filename or f"jaxinfer{conc}-{Path(model).name}-{result['date']}.json"
    if args.result_filename and args.sweep_concurrency:  # one file per concurrency
        name = f"{Path(name).stem}{conc}{Path(name).suffix}"
    path = Path(args.result_dir) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, allow_nan=False))
    print(f"wrote {path}")
    return path


def main(argv=None) -> int:
    args = parse_args(argv)
    base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    served, max_model_len = asyncio.run(fetch_model_info(base_url, headers))
    model = args.model or served
    chat = args.endpoint == "/v1/chat/completions"
    tokenizer = load_tokenizer(args.tokenizer)

    def make_requests(seed: int) -> list[BenchRequest]:
        if args.dataset_name == "random":
            return random_requests(tokenizer, args.num_prompts, args.random_input_len,
                                   args.random_output_len, args.random_range_ratio,
                                   np.random.default_rng(seed), as_text=chat)
        return sharegpt_requests(tokenizer, args.dataset_path, args.num_prompts,
                                 max_model_len or 1 << 30, args.sharegpt_output_len,
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
              f"request_rate={args.request_rate} max_concurrency={conc}")
        before = asyncio.run(fetch_server_counters(base_url, headers))
        results, duration = asyncio.run(run_benchmark(url, model, chat, requests, args.request_rate, conc,
                                                      args.ignore_eos, args.seed))
        metrics = summarize(results, duration, args.request_rate, conc, args.goodput, args.metric_percentiles)
        metrics["prefix_hit_rate"] = prefix_hit_rate(
            before, asyncio.run(fetch_server_counters(base_url, headers)))
        metrics["buckets_compiling"] = buckets_compiling(before)  # at the run's start
        print_result(metrics)
        rows.append(metrics)
        if args.save_result:
            save_result(args, metrics, model, len(requests))
    if args.save:
        config = {"model": model, "endpoint": args.endpoint, "dataset": args.dataset_name,
                  "num_prompts": len(requests), "random_input_len": args.random_input_len,
                  "random_output_len": args.random_output_len,
                  "request_rate": "inf" if args.request_rate == float("inf") else args.request_rate,
                  "ignore_eos": args.ignore_eos, "goodput": args.goodput, "base_url": base_url}
        results_io.save(args.save, args.name or "serving", config=config, metrics=sweep_metrics(rows))
    if args.sweep_concurrency:
        plot_sweep(rows, args.plot, f"{model} {args.endpoint}: random {args.random_input_len} in / "
                                    f"{args.random_output_len} out" if args.dataset_name == "random"
                   else f"{model} {args.endpoint}: ShareGPT")
    return 0 if all(r["failed"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
