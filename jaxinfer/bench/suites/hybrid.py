"""The hybrid models on one GPU, dummy weights, in one device call: Qwen3-Next-80B-A3B (Gated
DeltaNet beside gated attention, FP8 weights) and Granite 4.0-H-Tiny (Mamba-2 beside attention,
bf16) through the engine against rooflines from the HBM rate measured in the same run, how many
128k-token sequences each fits beside Llama-3-8B, and the recurrent kernels against their ceilings.

    PYTHONUNBUFFERED=1 jaxinfer bench throughput --suite hybrid -- --save     # H200, < 10 min
    PYTHONUNBUFFERED=1 jaxinfer bench throughput --suite hybrid -- --sections qwen3_next_80b_fp8 \
        --save --merge benchmarks/results/hybrid_h200.json                  # one section again
    JAX_PLATFORMS=cpu BENCH_TINY_SHAPES=1 jaxinfer bench throughput --suite hybrid -- \
        --device-memory 141GB                                                # CPU check

Sections (each in its own process under a deadline, in this order; the record is written after
each, so a run cut short keeps what it measured; `--deadline-s` bounds the whole call):
  plan     (config only, no weights) `<m>_max_concurrent_128k` for qwen3_next_80b_fp8,
           granite4h_tiny and llama8b (Llama-3-8B, bf16): the pool the engine's planner sizes
           at the default --gpu-memory-utilization (activations at their pre-load floor) over one
           131,072-token sequence's blocks, its attention pages plus each state-space layer's
           fixed state (hybrid_plan.py; `<m>_plan_*`: the figures behind it). The device's
           size is the engine's (JAX's allocator limit), or `--device-memory SIZE` (how a CPU
           gives it).
  ssm      the recurrent kernels (jaxinfer/bench/kernel_ssm.py, its own anchors):
           `gdn_prefill_frac_of_matmul` and `ssd_prefill_frac_of_matmul` (8 x 1024-token prefill
           TF/s over the same-run bf16 matmul ceiling), `gdn_decode_frac_of_hbm`,
           `ssd_decode_frac_of_hbm`.
  granite4h_tiny, qwen3_next_80b_fp8   per model `<m>`:
           the best plain HBM read rate (jaxinfer/bench/anchors.py) before the engine starts
           (`<m>_hbm_read_tbps`); the engine (--max-num-seqs 64, --max-num-batched-tokens 2048,
           --max-model-len prompt + output + 16, no start-up compile: an untimed warm-up runs the
           timed runs' shapes on other prompts); then
           bs1       one request, 512 prompt / `--output-len` tokens, greedy: `<m>_bs1_tpot_ms`
                     (first to last token over the gaps), best of two;
           roofline  `<m>_bs1_roofline_ms` = bytes one decode step reads / that read rate:
                     every weight as stored (FP8 values and their scales under --quantization
                     fp8) but the input embedding table (unless it is the tied head) and the
                     routed experts a token is not sent to (top-k of each layer's stacks), plus
                     each attention layer's K and V over the mean context (prompt + half the
                     output) and each state-space layer's state (read; the same bytes written
                     back are `<m>_bs1_state_write_gb`, not in the roofline);
           c64       64 fresh random prompts at once, 512 / `--output-len`: `<m>_c64_out_tok_s`
                     and `<m>_c64_prefix_hit_rate` (~0: no timed prompt was seen before);
           `<m>_engine_max_concurrent_128k`: the running engine's pool (measured activations)
           over one 128k sequence's blocks, beside the plan section's pre-load figure.
           Qwen3-Next-80B's 81 GB of FP8 weights need an H200: where the engine's pre-load check
           refuses the model, `<m>_skipped` says why and the run goes on.
Record: hybrid_<gpu>.json. BENCH_TINY_SHAPES=1: both families at toy sizes (the plan section's
figures stay the real models'), kernel_ssm.py's tiny shapes, interpreted.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from jaxinfer.bench import common, presets, results_io

RESULT = "RESULT "
TINY = os.environ.get("BENCH_TINY_SHAPES") == "1"

# name -> (config.json, --quantization)
ENGINE_MODELS = {
    "granite4h_tiny": (presets.GRANITE_4_H_TINY, None),
    "qwen3_next_80b_fp8": (presets.QWEN3_NEXT_80B_A3B, "fp8"),
}
PLAN_MODELS = {**ENGINE_MODELS, "llama8b": (presets.LLAMA3_8B, None)}
# BENCH_TINY_SHAPES=1: the same layer patterns at a CPU's size.
TINY_OVERRIDES = {
    "granite4h_tiny": dict(hidden_size=64, intermediate_size=32, shared_intermediate_size=64,
                           num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                           layer_types=["mamba", "attention", "mamba", "mamba"], mamba_n_heads=4,
                           mamba_d_head=32, mamba_d_state=16, num_local_experts=4,
                           num_experts_per_tok=2, vocab_size=512),
    "qwen3_next_80b_fp8": dict(hidden_size=128, intermediate_size=128, num_hidden_layers=4,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                               linear_num_key_heads=2, linear_num_value_heads=4,
                               linear_key_head_dim=16, linear_value_head_dim=16, num_experts=8,
                               num_experts_per_tok=2, moe_intermediate_size=128,
                               shared_expert_intermediate_size=128, vocab_size=512),
}
SECTIONS = ("plan", "ssm", "granite4h_tiny", "qwen3_next_80b_fp8")
# Seconds per section. Granite's 40 layers compile lazily in the first requests: an H100 run at
# 31ba4d7 was still compiling 139 s after ready (61 s) when its 200 s ran out.
LIMITS = {"plan": 90, "ssm": 150, "granite4h_tiny": 360, "qwen3_next_80b_fp8": 330}
ROUTED_EXPERT_LEAVES = {"w_gate", "w_up", "w_down", "w_gate_scale", "w_up_scale", "w_down_scale"}


def workload(output_len: int) -> dict:
    """Per run: prompt and output tokens, sequences at once; `step`: --max-num-batched-tokens."""
    if TINY:  # (32-token steps: every prefill chunk runs in one compiled shape)
        return dict(prompt=24, out=8, seqs=4, step=32)
    return dict(prompt=512, out=output_len, seqs=64, step=2048)


def emit(**metrics) -> None:
    print(RESULT + json.dumps(metrics), flush=True)


def decode_read_bytes(cfg, params, context: float) -> dict:
    """Bytes one batch-1 decode step reads at `context` tokens: {"weights", "kv", "state"}.
    Weights as the param tree `params` (arrays or their shapes, as loaded) stores them (quantized
    values and their scales), less the input embedding table (one row is read; all of it where
    it is the tied head) and the routed experts a token is not sent to; K and V of each attention
    layer over `context`; each state-space layer's state once."""
    import jax
    import numpy as np
    weights = 0.0
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        keys = tuple(k.key for k in path)
        nbytes = float(np.prod(leaf.shape)) * np.dtype(leaf.dtype).itemsize
        if keys == ("embed", "embedding") and not cfg.tie_word_embeddings:
            continue
        if keys[-1] in ROUTED_EXPERT_LEAVES:
            nbytes *= cfg.num_experts_per_tok / cfg.num_experts
        weights += nbytes
    attention = sum(s is None for s in cfg.layer_states)
    kv = attention * 2 * cfg.num_kv_heads * cfg.head_dim * 2 * context  # bf16 K and V
    return {"weights": weights, "kv": kv, "state": float(sum(s or 0 for s in cfg.layer_states))}


def engine_section(name: str, output_len: int) -> None:
    """One hybrid through the engine (RESULT lines): bs1 against its roofline, c64, the pool."""
    import jax

    from jaxinfer.bench.suites.families import hbm_bytes_s, run_requests
    from jaxinfer.bench.suites.hybrid_plan import SEQ_128K
    from jaxinfer.bench.timed_window import TimedWindow, fresh_prompts
    from jaxinfer.engine.args import EngineArgs
    from jaxinfer.engine.llm_engine import LLMEngine
    from jaxinfer.model.transformer import param_shapes
    from jaxinfer.worker.kv import MemoryPlanError

    w = workload(output_len)
    rate = hbm_bytes_s()  # before the engine takes the memory the 8 GiB read needs
    emit(**{f"{name}_hbm_read_tbps": round(rate / 1e12, 4)})
    config, quantization = ENGINE_MODELS[name]
    config = {**config, **(TINY_OVERRIDES[name] if TINY else {})}
    work = Path(tempfile.mkdtemp(prefix="hybrid-"))
    (work / "config.json").write_text(json.dumps(config))
    t0 = time.perf_counter()
    try:
        engine = LLMEngine.from_engine_args(EngineArgs(
            model=str(work), load_format="dummy", dtype="bfloat16", quantization=quantization,
            max_num_seqs=w["seqs"], max_num_batched_tokens=w["step"],
            max_model_len=w["prompt"] + w["out"] + 16, gpu_memory_utilization=0.9, warmup=False,
            compilation_cache_dir=None))
    except MemoryPlanError as e:  # e.g. Qwen3-Next-80B's FP8 weights on an 80 GB card
        emit(**{f"{name}_skipped": f"the engine refused the model on this device: {e}"[:1000]})
        return
    cfg = engine.cfg
    emit(**{f"{name}_ready_s": round(time.perf_counter() - t0, 1)})
    seeds = iter(range(100))

    def prompts(n: int) -> list[list[int]]:  # a seed of its own each: never a prompt seen before
        return fresh_prompts(cfg.vocab_size, n, w["prompt"], seed=next(seeds))

    t0 = time.perf_counter()  # the timed runs' steps, on prompts the timed runs never see
    run_requests(engine, prompts(1), w["out"])
    run_requests(engine, prompts(w["seqs"]), w["out"])
    emit(**{f"{name}_warmup_s": round(time.perf_counter() - t0, 1)})

    tpots = []
    for _ in range(2):
        times = run_requests(engine, prompts(1), w["out"])["arrivals"]["q0"]
        tpots.append(1e3 * (times[-1] - times[0]) / (len(times) - 1))
    # (the tree as loaded: on a GPU the engine serves fused projections, the same bytes renamed)
    read = decode_read_bytes(cfg, param_shapes(cfg), w["prompt"] + w["out"] / 2)
    total = sum(read.values())
    emit(**{f"{name}_bs1_tpot_ms": round(min(tpots), 3),
            f"{name}_bs1_tpot_runs_ms": [round(t, 3) for t in tpots],
            f"{name}_bs1_roofline_ms": round(1e3 * total / rate, 3),
            f"{name}_bs1_read_gb": round(total / 1e9, 4),
            f"{name}_bs1_weight_read_gb": round(read["weights"] / 1e9, 4),
            f"{name}_bs1_kv_read_gb": round(read["kv"] / 1e9, 4),
            f"{name}_bs1_state_read_gb": round(read["state"] / 1e9, 4),
            f"{name}_bs1_state_write_gb": round(read["state"] / 1e9, 4)})

    window = TimedWindow(engine)
    run = run_requests(engine, prompts(w["seqs"]), w["out"])
    n_out = sum(len(t) for t in run["arrivals"].values())
    kv_dtype = jax.tree_util.tree_leaves(engine.runner.kv_cache)[0].dtype
    per_seq = engine.scheduler.kv.groups.blocks_for_sequence(
        SEQ_128K, engine.config.scheduler.max_num_batched_tokens, engine.config.cache.block_size,
        kv_dtype)
    emit(**{f"{name}_c64_out_tok_s": round(n_out / (run["end"] - run["start"]), 1),
            f"{name}_c64_prefix_hit_rate": window.prefix_hit_rate,
            f"{name}_c64_buckets_compiling": window.compiling,
            f"{name}_engine_pool_blocks": engine.num_total_blocks,
            f"{name}_engine_max_concurrent_128k": engine.num_total_blocks // per_seq})


def ssm_section() -> None:
    """kernel_ssm.py's figures; at tiny shapes the fractions of its one prefill case."""
    from jaxinfer.bench import kernel_ssm
    m = kernel_ssm.run(TINY, sweep=False)
    case = next(iter(kernel_ssm.TINY["prefill"])) if TINY else "b8x1024"
    out = {"ssm_matmul_tflops": m["matmul_tflops"], "ssm_read_tbps": m["read_tbps"]}
    for kind in ("gdn", "ssd"):
        out[f"{kind}_prefill_frac_of_matmul"] = m.get(f"{kind}_prefill_frac_of_matmul", round(
            m[f"{kind}_prefill_{case}_tflops"] / m["matmul_tflops"], 3))
        decode = max(kernel_ssm.TINY["decode"] if TINY else kernel_ssm.DECODE)
        out[f"{kind}_decode_frac_of_hbm"] = m[f"{kind}_decode_b{decode}_frac_of_hbm"]
        out[f"{kind}_prefill_rel_err"] = m[f"{kind}_prefill_rel_err"]
    emit(**out)


def run_section(name: str, output_len: int) -> None:
    # (first: a section that dies midway still names the machine its record belongs to)
    emit(machine=results_io.machine(), device_slug=results_io.device_slug())
    if name == "plan":
        from jaxinfer.bench.suites.hybrid_plan import plan_section
        from jaxinfer.worker.kv import MemoryPlanError
        from jaxinfer.worker.kv.planner import device_memory_bytes
        try:
            device_memory_bytes()
        except MemoryPlanError as e:  # a CPU without --device-memory
            emit(plan_skipped=f"{e} (--device-memory SIZE gives it)")
        else:
            emit(**plan_section(PLAN_MODELS))
    elif name == "ssm":
        ssm_section()
    else:
        engine_section(name, output_len)


def run_child(name: str, args: argparse.Namespace, limit: float) -> tuple[dict, str | None]:
    """One section in its own process -> (its RESULT figures, an error or None)."""
    argv = [sys.executable, "-m", __spec__.name, "--run-section", name,
            "--output-len", str(args.output_len)]
    env_before = os.environ.get("JAXINFER_DEVICE_MEMORY")
    if args.device_memory and name == "plan":  # (the engines plan on their own device)
        os.environ["JAXINFER_DEVICE_MEMORY"] = args.device_memory
    try:
        stdout, stderr, code = common.child(argv, limit)
    finally:
        if env_before is None:
            os.environ.pop("JAXINFER_DEVICE_MEMORY", None)
        else:
            os.environ["JAXINFER_DEVICE_MEMORY"] = env_before
    figures: dict = {}
    for line in stdout.splitlines():
        if line.startswith(RESULT):
            figures.update(json.loads(line[len(RESULT):]))
    if code == 0:
        return figures, None
    print(stderr[-4000:], file=sys.stderr, flush=True)
    return figures, stderr[-2000:] or f"exit code {code}"


def save_record(args: argparse.Namespace, metrics: dict, merge: Path | None) -> None:
    name = args.name or f"hybrid_{metrics.get('device_slug', 'cpu')}"
    config = {"models": {k: {"architecture": c["architectures"][0], "quantization": q,
                             "layers": c["num_hidden_layers"], "tiny": TINY}
                         for k, (c, q) in PLAN_MODELS.items()},
              "workload": workload(args.output_len), "sections": args.sections.split(","),
              "weights": "dummy (random), Qwen3-Next quantized to FP8 on load",
              "device_memory": args.device_memory}
    results_io.save(args.save, name, config=config,
                    metrics={k: v for k, v in metrics.items()
                             if k not in ("machine", "device_slug")},
                    merge=merge, machine_info=metrics.get("machine"))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=common.HelpFormatter)
    parser.add_argument("--sections", default=",".join(SECTIONS),
                        help=f"comma-separated, run in this order: {', '.join(SECTIONS)}")
    parser.add_argument("--deadline-s", type=float, default=570.0,
                        help="the whole run; a section gets at most what is left")
    parser.add_argument("--output-len", type=int, default=128,
                        help="output tokens of each timed request (512-token prompts)")
    parser.add_argument("--device-memory", default=None, metavar="SIZE",
                        help="plan: the device's memory (141GB, 80GiB) instead of this device's "
                             "allocator limit (a CPU reports none)")
    parser.add_argument("--run-section", choices=SECTIONS, help=argparse.SUPPRESS)
    results_io.add_save_arg(parser, "hybrid_<gpu>")
    results_io.add_merge_arg(parser)
    args = parser.parse_args(argv)
    if args.run_section:
        return run_section(args.run_section, args.output_len)
    names = args.sections.split(",")
    unknown = [n for n in names if n not in SECTIONS]
    if unknown:
        parser.error(f"--sections: unknown {unknown[0]!r} (choose from {', '.join(SECTIONS)})")
    merge = None  # the stored record as it was before this run, each save folded into it once
    if args.merge and Path(args.merge).is_file():
        merge = Path(tempfile.mkdtemp(prefix="hybrid-")) / "stored.json"
        shutil.copyfile(args.merge, merge)
    start = time.perf_counter()
    metrics: dict = {}
    for name in names:
        left = args.deadline_s - (time.perf_counter() - start)
        if left < 30:
            metrics[f"{name}_error"] = "skipped: the run's deadline"
            continue
        t0 = time.perf_counter()
        # (a CPU interprets the kernels and compiles slowly: the tiny run's limits are longer)
        figures, error = run_child(name, args, min(LIMITS[name] * (3 if TINY else 1), left))
        metrics.update(figures)
        metrics[f"{name}_section_s"] = round(time.perf_counter() - t0, 1)
        if error:
            metrics[f"{name}_error"] = error
        print(json.dumps({k: v for k, v in figures.items() if k != "machine"}), flush=True)
        if args.save:  # after each section: a run cut short keeps what it measured
            save_record(args, metrics, merge)


if __name__ == "__main__":
    main()
