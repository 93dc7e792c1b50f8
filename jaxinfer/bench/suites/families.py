"""The windowed families end to end on one GPU, dummy bf16 weights: Gemma-3-27B and gpt-oss-20b
shapes through the engine, against the HBM rate measured in the same run.

    PYTHONUNBUFFERED=1 jaxinfer bench throughput --suite families -- --models gemma3_27b --save --merge
    PYTHONUNBUFFERED=1 jaxinfer bench throughput --suite families -- --models gptoss_20b --save --merge
    PYTHONUNBUFFERED=1 jaxinfer bench throughput --suite families -- --models gemma3_27b --parts kv32k \
        --save --merge                                           # only the 32k KV section
    JAX_PLATFORMS=cpu BENCH_TINY_SHAPES=1 jaxinfer bench throughput --suite families --   # CPU check

(`--merge` keeps the record's other keys: the other model's, the decode-kernel section's from
jaxinfer/bench/kernel_window_decode.py.)

Each model runs in its own process (the driver never imports jax, so each child has the whole
GPU); a child prints `RESULT {json}` lines and the driver writes families_<gpu>.json after each.
Per model (`<m>` = gemma3_27b or gptoss_20b):
  warm-up  untimed runs of the timed workloads' shapes with other prompts (random token ids: the
           timed prompts never hit the prefix cache), so the timed runs find their step buckets
           compiled (the engine starts with --no-warmup: compiling every bucket of a 62-layer
           model would take minutes);
  bs1      one request, 512 prompt / 256 output tokens, greedy: `<m>_bs1_tpot_ms` (first to
           last token over 255 gaps), best of two;
  roofline `<m>_bs1_roofline_ms` = (weights one decode token reads + its KV read) / the HBM
           read rate measured here (jaxinfer.bench.anchors, before the engine starts): weights =
           every param but the input embedding
           table and the experts a token is not routed to; KV = each layer's keys and values over
           the mean context (prompt + half the output), a windowed layer's over at most its
           window (the decode kernel never loads pages outside it);
  c64      64 requests at once, 512 / 256: `<m>_c64_out_tok_s`, with `prefix_hit_rate`;
  32k      (Gemma only; `--parts kv32k` runs only this) one 32,768-token prompt, 3 output
           tokens: `gemma3_27b_32k_kv_gib`, the KV pool bytes the sequence holds (blocks held x
           block bytes) once it decodes (the hybrid allocator has freed the windowed layers'
           blocks before their window), beside `gemma3_27b_32k_kv_all_global_gib` (the same model
           with every layer global: --no-hybrid-kv-cache) and their ratio (goal <= 0.25);
           `gemma3_27b_32k_kv_peak_gib`: the most it held during the prefill, whose 2,048-token
           chunks each hold their own blocks until the next chunk starts.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from jaxinfer.bench import presets, results_io
from jaxinfer.paths import REPO_ROOT

RESULT = "RESULT "
TINY = os.environ.get("BENCH_TINY_SHAPES") == "1"

GEMMA3_27B = {
    "architectures": ["Gemma3ForCausalLM"], "hidden_size": 5376, "intermediate_size": 21504,
    "num_hidden_layers": 62, "num_attention_heads": 32, "num_key_value_heads": 16,
    "head_dim": 128, "query_pre_attn_scalar": 168, "sliding_window": 1024,
    "sliding_window_pattern": 6, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
    "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "vocab_size": 262208,
    "max_position_embeddings": 131072, "torch_dtype": "bfloat16", "bos_token_id": 2,
    "eos_token_id": 1,
}
# CPU check: the same families at toy sizes (windows still shorter than the prompts).
TINY_OVERRIDES = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      query_pre_attn_scalar=16, sliding_window=8, vocab_size=512)
MODELS = {"gemma3_27b": GEMMA3_27B, "gptoss_20b": presets.GPT_OSS_20B}


def workload() -> dict:
    if TINY:
        return dict(prompt=24, out=8, seqs=4, long=96)
    return dict(prompt=512, out=256, seqs=64, long=32768)


def emit(**metrics) -> None:
    print(RESULT + json.dumps(metrics), flush=True)


def hbm_bytes_s() -> float:
    """The best plain HBM read rate of jaxinfer.bench.anchors' read kernels (64 MiB on a CPU)."""
    from jaxinfer.bench import anchors
    return max(anchors.read_rates((64 << 20) if TINY else (8 << 30)).values())


def decode_read_bytes(cfg, context: float) -> float:
    """Bytes one batch-1 decode step reads: the weights a token multiplies with (not the input
    embedding table unless tied to the head; only the routed experts) and its KV over `context`
    tokens, a windowed layer's over at most its window."""
    h = cfg.hidden_size
    params = cfg.num_params()
    params -= 0 if cfg.tie_word_embeddings else cfg.vocab_size * h
    moe_layers = sum(cfg.layer_is_moe(i) for i in range(cfg.num_layers))
    params -= moe_layers * (cfg.num_experts - cfg.num_experts_per_tok) * 3 * h * \
        cfg.moe_intermediate_size
    kv_token_layer = 2 * cfg.num_kv_heads * cfg.head_dim * 2  # bf16 K and V
    kv = sum(min(context, cfg.layer_window(i) or context) for i in range(cfg.num_layers))
    return 2 * params + kv * kv_token_layer


def run_requests(engine, prompts: list[list[int]], out: int) -> dict:
    """All at once, greedy; per request its tokens' arrival times."""
    from jaxinfer.sampling_params import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=out, ignore_eos=True)
    arrivals = {f"q{i}": [] for i in range(len(prompts))}
    for i, p in enumerate(prompts):
        engine.add_request(f"q{i}", p, params)
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter()
        for o in outs:
            arrivals[o.request_id] += [now] * len(o.outputs[0].new_token_ids)
    return {"start": start, "end": time.perf_counter(), "arrivals": arrivals}


def child(model: str, parts: str) -> None:
    import numpy as np

    from jaxinfer.engine.args import EngineArgs
    from jaxinfer.engine.llm_engine import LLMEngine

    w = workload()
    # before the engine takes the memory its 8 GiB buffer needs (the timed runs' roofline only)
    rate = hbm_bytes_s() if parts == "all" else None
    config = {**MODELS[model], **(TINY_OVERRIDES if TINY else {})}
    work = Path(tempfile.mkdtemp(prefix="families-"))
    (work / "config.json").write_text(json.dumps(config))
    long = w["long"] if model == "gemma3_27b" else 0
    t0 = time.perf_counter()
    engine = LLMEngine.from_engine_args(EngineArgs(
        model=str(work), load_format="dummy", dtype="bfloat16", max_num_seqs=w["seqs"],
        max_num_batched_tokens=2048, max_model_len=max(long, w["prompt"] + w["out"]) + 16,
        gpu_memory_utilization=0.9, warmup=False, compilation_cache_dir=None))
    cfg = engine.cfg
    emit(**{f"{model}_ready_s": round(time.perf_counter() - t0, 1)})
    rng = np.random.default_rng(0)

    def prompts(n: int, length: int) -> list[list[int]]:
        return [rng.integers(3, cfg.vocab_size, length).tolist() for _ in range(n)]

    if parts == "all":
        timed_runs(engine, model, w, prompts, rate)
    if long:
        long_sequence_kv(engine, long, prompts(1, long)[0])
    emit(machine=results_io.machine(), device_slug=results_io.device_slug())


def timed_runs(engine, model: str, w: dict, prompts, rate: float) -> None:
    """bs1 TPOT against its roofline, and c64 throughput (after their warm-up)."""
    cfg = engine.cfg
    # Warm-up: the bs1 and c64 step shapes, with prompts the timed runs never see.
    t0 = time.perf_counter()
    run_requests(engine, prompts(1, w["prompt"]), 16)
    run_requests(engine, prompts(w["seqs"], w["prompt"]), 16)
    emit(**{f"{model}_warmup_s": round(time.perf_counter() - t0, 1)})

    tpots = []
    for _ in range(2):
        times = run_requests(engine, prompts(1, w["prompt"]), w["out"])["arrivals"]["q0"]
        tpots.append(1e3 * (times[-1] - times[0]) / (len(times) - 1))
    read = decode_read_bytes(cfg, w["prompt"] + w["out"] / 2)
    emit(**{f"{model}_bs1_tpot_ms": round(min(tpots), 3),
            f"{model}_bs1_tpot_runs_ms": [round(t, 3) for t in tpots],
            f"{model}_bs1_roofline_ms": round(1e3 * read / rate, 3),
            f"{model}_bs1_read_gb": round(read / 1e9, 3), "hbm_tb_s": round(rate / 1e12, 3)})

    hits = engine.scheduler.kv_cache_stats()[-1]
    q0, h0 = hits.queries, hits.hits
    run = run_requests(engine, prompts(w["seqs"], w["prompt"]), w["out"])
    n_out = sum(len(t) for t in run["arrivals"].values())
    stats = engine.scheduler.kv_cache_stats()[-1]
    emit(**{f"{model}_c64_out_tok_s": round(n_out / (run["end"] - run["start"]), 1),
            f"{model}_c64_prefix_hit_rate": round((stats.hits - h0) / max(stats.queries - q0, 1),
                                                  4)})


def long_sequence_kv(engine, long: int, prompt: list[int]) -> None:
    """Pool use of one long sequence: the blocks it holds once it decodes, and at most."""
    import jax.numpy as jnp

    from jaxinfer.sampling_params import SamplingParams
    from jaxinfer.worker.kv.planner import kv_bytes_per_block
    cfg, kv, block = engine.cfg, engine.scheduler.kv, engine.config.cache.block_size
    block_bytes = kv_bytes_per_block(cfg, block, jnp.bfloat16, kv.groups.num_slots)
    used0 = kv.pool.num_used_blocks
    engine.add_request("long", prompt, SamplingParams(max_tokens=3, ignore_eos=True))
    held = []  # after each step; the last step finishes the request and frees its blocks
    while engine.has_unfinished_requests():
        engine.step()
        held.append(kv.pool.num_used_blocks - used0)
    decoding = held[-2]  # after the step of its second token, whose allocation freed blocks
    all_global = -(-long // block) * block * 2 * cfg.num_kv_heads * cfg.head_dim * 2 \
        * cfg.num_layers
    emit(gemma3_27b_32k_kv_gib=round(decoding * block_bytes / 2 ** 30, 3),
         gemma3_27b_32k_kv_all_global_gib=round(all_global / 2 ** 30, 3),
         gemma3_27b_32k_kv_over_all_global=round(decoding * block_bytes / all_global, 4),
         gemma3_27b_32k_kv_peak_gib=round(max(held) * block_bytes / 2 ** 30, 3),
         gemma3_27b_kv_groups=kv.groups.num_groups)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--child", choices=list(MODELS), help=argparse.SUPPRESS)
    parser.add_argument("--timeout-s", type=float, default=460, help="per model process")
    parser.add_argument("--parts", choices=["all", "kv32k"], default="all",
                        help="kv32k: only Gemma's 32k-token KV pool section (no timed runs)")
    parser.add_argument("--merge", action="store_true",
                        help="keep the saved record's other metrics (another model's, the decode "
                             "kernel section's) and config")
    results_io.add_save_arg(parser, "families_<gpu>")
    args = parser.parse_args(argv)
    if args.child:
        return child(args.child, args.parts)
    metrics: dict = {}
    for model in args.models.split(","):
        try:
            proc = subprocess.run([sys.executable, "-m", "jaxinfer.bench.suites.families", "--child",
                                   model, "--parts", args.parts], capture_output=True, text=True,
                                  timeout=args.timeout_s, cwd=REPO_ROOT)
            out, err, failed = proc.stdout, proc.stderr, proc.returncode != 0
        except subprocess.TimeoutExpired as e:  # keep what it measured before the limit
            out, err, failed = e.stdout or "", f"timed out after {args.timeout_s} s", True
            out, err = (x.decode() if isinstance(x, bytes) else x for x in (out, err))
        for line in out.splitlines():
            if line.startswith(RESULT):
                metrics.update(json.loads(line[len(RESULT):]))
        if failed:
            metrics[f"{model}_error"] = err[-2000:]
            print(err[-4000:], file=sys.stderr)
        print(json.dumps(metrics, indent=1), flush=True)
        if args.save:  # after each model, so a run cut short keeps what it measured
            name = args.name or f"families_{metrics.get('device_slug', 'cpu')}"
            record = {k: v for k, v in metrics.items() if k not in ("machine", "device_slug")}
            config = {"families": dict(workload(), models=args.models.split(","), tiny=TINY,
                                       weights="dummy bf16")}
            saved = Path(args.save) / f"{name}.json"
            if args.merge and saved.is_file():  # e.g. the decode-kernel section's keys
                old = json.loads(saved.read_text())
                record = {**old["metrics"], **record}
                config = {**old["config"], **config}
            results_io.save(args.save, name, config=config, metrics=record,
                            machine_info=metrics.get("machine"))


if __name__ == "__main__":
    main()
