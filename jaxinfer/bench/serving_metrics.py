"""The figures of one serving benchmark run, under the keys `vllm bench serve --save-result` writes:
throughput, peak output rate and concurrency, request goodput under --goodput SLOs, mean/median/
std/percentiles of the --percentile-metrics (TTFT, TPOT, ITL, E2EL) in ms, and the per-request
arrays (input_lens, output_lens, ttfts, itls, latencies, start_times, generated_texts, errors) that
--save-detailed keeps. Only valid JSON: an unlimited request rate is the string "inf", as vLLM
writes it."""

from __future__ import annotations

import dataclasses
import datetime

import numpy as np

METRICS = (("ttft", "TTFT", "Time to First Token"),
           ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
           ("itl", "ITL", "Inter-token Latency"), ("e2el", "E2EL", "End-to-end Latency"))
GOODPUT_METRICS = ("ttft", "tpot", "e2el")  # the SLOs vLLM's --goodput takes
DEFAULT_PERCENTILE_METRICS = ("ttft", "tpot", "itl")  # vLLM's for a generative model
DETAILED = ("input_lens", "output_lens", "start_times", "ttfts", "itls", "generated_texts", "errors")


@dataclasses.dataclass
class RequestResult:
    success: bool = False
    error: str = ""
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = dataclasses.field(default_factory=list)
    start: float = 0.0
    generated_text: str = ""


def parse_goodput(pairs: list[str] | None) -> dict[str, float]:
    """vLLM's --goodput "ttft:500" "tpot:50" ...: milliseconds each request must stay within."""
    slos = {}
    for pair in pairs or []:
        name, sep, value = pair.partition(":")
        if not sep or name not in GOODPUT_METRICS:
            raise ValueError(f"--goodput {pair!r}: expected KEY:MS, KEY one of {', '.join(GOODPUT_METRICS)}")
        slos[name] = float(value)
        if slos[name] < 0:
            raise ValueError(f"--goodput {pair!r}: the SLO must be >= 0 ms")
    return slos


def _tpot(r: RequestResult) -> float:
    return (r.latency - r.ttft) / (r.output_tokens - 1) if r.output_tokens > 1 else 0.0


def _good(r: RequestResult, slos: dict[str, float]) -> bool:
    values = {"ttft": r.ttft, "tpot": _tpot(r), "e2el": r.latency}
    return all(values[k] * 1000 <= slo for k, slo in slos.items())


def parse_percentile_metrics(names: str | None) -> tuple[str, ...]:
    """vLLM's --percentile-metrics "ttft,tpot,itl": which latencies get mean/median/std/pN keys."""
    if not names:
        return DEFAULT_PERCENTILE_METRICS
    chosen = tuple(n.strip() for n in names.split(","))
    known = [key for key, _, _ in METRICS]
    for n in chosen:
        if n not in known:
            raise ValueError(f"--percentile-metrics {n!r}: expected some of {', '.join(known)}")
    return chosen


def _peaks(ok: list[RequestResult]) -> tuple[float, int]:
    """vLLM's max_output_tokens_per_s (the busiest one-second bucket of token arrivals) and
    max_concurrent_requests (the most requests in flight at one instant)."""
    if not ok:
        return 0.0, 0
    t0 = min(r.start for r in ok)
    buckets = np.zeros(int(np.ceil(max(r.start + r.latency for r in ok) - t0)) + 1)
    for r in ok:
        arrivals = r.start + r.ttft + np.cumsum([0.0, *r.itl])
        np.add.at(buckets, (arrivals - t0).astype(int).clip(0, len(buckets) - 1), 1)
    # Half-open [start, end): at a tie the departure goes first.
    events = sorted([(r.start, 1) for r in ok] + [(r.start + r.latency, -1) for r in ok])
    live = peak = 0
    for _, step in events:
        live += step
        peak = max(peak, live)
    return float(buckets.max()), peak


def summarize(results: list[RequestResult], duration: float, request_rate: float,
              max_concurrency: int | None, goodput: dict[str, float] | None = None,
              percentiles: tuple[float, ...] = (99,),
              selected: tuple[str, ...] = DEFAULT_PERCENTILE_METRICS) -> dict:
    """vLLM's result dict for one run (`errors` one per request, "" when none)."""
    ok = [r for r in results if r.success]
    series = {"ttft": [r.ttft for r in ok], "tpot": [_tpot(r) for r in ok if r.output_tokens > 1],
              "itl": [x for r in ok for x in r.itl], "e2el": [r.latency for r in ok]}
    in_tok = sum(r.prompt_len for r in ok)
    out_tok = sum(r.output_tokens for r in ok)
    out = {
        "request_rate": "inf" if request_rate == float("inf") else request_rate,
        "burstiness": 1.0, "max_concurrency": max_concurrency, "duration": duration,
        "completed": len(ok), "failed": len(results) - len(ok),
        "total_input_tokens": in_tok, "total_output_tokens": out_tok,
        "request_throughput": len(ok) / duration,
        "request_goodput": (sum(_good(r, goodput) for r in ok) / duration) if goodput else None,
        "output_throughput": out_tok / duration, "total_token_throughput": (in_tok + out_tok) / duration,
        "input_lens": [r.prompt_len for r in results],
        "output_lens": [r.output_tokens if r.success else 0 for r in results],
        "ttfts": [r.ttft for r in results], "itls": [r.itl for r in results],
        "latencies": [r.latency for r in results], "start_times": [r.start for r in results],
        "generated_texts": [r.generated_text for r in results], "errors": [r.error for r in results],
    }
    out["max_output_tokens_per_s"], out["max_concurrent_requests"] = _peaks(ok)
    for key in selected:
        xs = np.asarray(series[key], dtype=np.float64) * 1000
        stat = (lambda f: float(f(xs))) if xs.size else (lambda f: 0.0)
        out[f"mean_{key}_ms"] = stat(np.mean)
        out[f"median_{key}_ms"] = stat(np.median)
        out[f"std_{key}_ms"] = stat(np.std)
        for p in percentiles:
            out[f"p{p:g}_{key}_ms"] = stat(lambda v, p=p: np.percentile(v, p))
    return out


def vllm_result(metrics: dict, *, endpoint: str, model: str, tokenizer: str, num_prompts: int,
                label: str | None = None, detailed: bool = True, backend: str | None = None,
                metadata: dict | None = None) -> dict:
    """The whole file `vllm bench serve --save-result` writes: the run's description, then its
    figures; without `detailed` (--save-detailed), the per-request arrays left out, as vLLM."""
    backend = backend or ("openai-chat" if endpoint.endswith("chat/completions") else "openai")
    head = {"date": datetime.datetime.now().strftime("%Y%m%d-%H%M%S"), "endpoint_type": backend,
            "backend": backend, "label": label, "model_id": model, "tokenizer_id": tokenizer,
            "num_prompts": num_prompts, **(metadata or {})}
    return {**head, **{k: v for k, v in metrics.items() if detailed or k not in DETAILED}}


def distinct_errors(metrics: dict, limit: int = 5) -> list[str]:
    return sorted({e for e in metrics["errors"] if e})[:limit]


def print_result(m: dict) -> None:
    """vLLM's result block, line for line."""
    print("{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="))
    print("{:<40} {:<10}".format("Successful requests:", m["completed"]))
    print("{:<40} {:<10}".format("Failed requests:", m["failed"]))
    if m["max_concurrency"] is not None:
        print("{:<40} {:<10}".format("Maximum request concurrency:", m["max_concurrency"]))
    if m["request_rate"] != "inf":
        print("{:<40} {:<10.2f}".format("Request rate configured (RPS):", m["request_rate"]))
    print("{:<40} {:<10.2f}".format("Benchmark duration (s):", m["duration"]))
    print("{:<40} {:<10}".format("Total input tokens:", m["total_input_tokens"]))
    print("{:<40} {:<10}".format("Total generated tokens:", m["total_output_tokens"]))
    print("{:<40} {:<10.2f}".format("Request throughput (req/s):", m["request_throughput"]))
    if m["request_goodput"] is not None:
        print("{:<40} {:<10.2f}".format("Request goodput (req/s):", m["request_goodput"]))
    print("{:<40} {:<10.2f}".format("Output token throughput (tok/s):", m["output_throughput"]))
    print("{:<40} {:<10.2f}".format("Peak output token throughput (tok/s):",
                                    m["max_output_tokens_per_s"]))
    print("{:<40} {:<10.2f}".format("Peak concurrent requests:", m["max_concurrent_requests"]))
    print("{:<40} {:<10.2f}".format("Total token throughput (tok/s):", m["total_token_throughput"]))
    for key, name, title in METRICS:
        if f"mean_{key}_ms" not in m:
            continue
        print("{s:{c}^{n}}".format(s=title, n=50, c="-"))
        for stat, label in (("mean", "Mean"), ("median", "Median")):
            print("{:<40} {:<10.2f}".format(f"{label} {name} (ms):", m[f"{stat}_{key}_ms"]))
        for k in m:
            if k.startswith("p") and k.endswith(f"_{key}_ms"):
                print("{:<40} {:<10.2f}".format(f"P{k[1:-len(key) - 4]} {name} (ms):", m[k]))
    print("=" * 50)
    for err in distinct_errors(m):
        print(f"error: {err}")
