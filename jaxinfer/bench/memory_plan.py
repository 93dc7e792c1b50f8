"""`jaxinfer bench memory-plan`: does the default --gpu-memory-utilization run out of memory?

    jaxinfer bench memory-plan [--models llama8b,llama8b_fp8,qwen3_30b_a3b,gpt_oss_20b]
                               [--concurrency 256] [--save [DIR]] [--merge RECORD.json]

For each model shape (random weights, `--load-format dummy`), in its own process: build the engine
at the default utilization with every bucket compiled before ready (no background compile, an
empty executable cache, so XLA's autotuner runs beside the KV cache as on a first start), run
`--concurrency` requests of `--input-len` tokens in / `--output-len` out at once, then record the
engine's memory plan (the pre-load check, the KV plan, the compiled steps' measured activations),
the device's `peak_bytes_in_use` and `bytes_limit`, and whether it ran out of memory (a
RESOURCE_EXHAUSTED or "Out of memory" in the child's error, or its death), or whether the engine
refused it as too large (`refused`: a MemoryPlanError, e.g. Qwen3-30B-A3B's 57 GiB of bf16 weights
on an H100, where JAX's default allocator limit is 75% of the card). `--save` writes
memory_plan_<gpu>.json (results_io.py), one `<model>_*` group of metrics per model.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time

from jaxinfer.bench import common, presets, results_io

# name -> (config.json, engine flags beside the defaults)
MODELS = {
    "llama8b": (presets.LLAMA3_8B, {}),
    "llama8b_fp8": (presets.LLAMA3_8B, {"quantization": "fp8"}),
    "qwen3_30b_a3b": (presets.QWEN3_30B_A3B, {}),
    "gpt_oss_20b": (presets.GPT_OSS_20B, {}),
}
RESULT_PREFIX = "memory-plan result: "
OOM_MARKS = ("RESOURCE_EXHAUSTED", "Out of memory", "out of memory")


def _device_memory() -> dict:
    import jax

    from jaxinfer.worker.kv.planner import allocator_fraction
    device = jax.devices()[0]
    stats = device.memory_stats() or {}
    return {"device_kind": getattr(device, "device_kind", device.platform),
            "allocator_fraction": allocator_fraction(),
            **{k: int(stats[k]) for k in ("peak_bytes_in_use", "bytes_in_use", "bytes_limit",
                                          "largest_free_block_bytes") if k in stats}}


def run_model(name: str, args: argparse.Namespace) -> dict:
    """One model, in this process: start, compile every bucket, run the batch; its figures."""
    from jaxinfer.engine.args import EngineArgs
    from jaxinfer.engine.llm_engine import LLMEngine
    from jaxinfer.frontends.llm import LLM
    from jaxinfer.sampling_params import SamplingParams
    config, flags = MODELS[name]
    model_dir = presets.Preset(name, config, {}).model_dir(f"memory_plan_{name}")
    with tempfile.TemporaryDirectory() as cache_dir:
        engine_args = EngineArgs(
            model=str(model_dir), load_format="dummy", max_num_seqs=args.concurrency,
            max_model_len=args.max_model_len, background_compile=False,
            compilation_cache_dir=cache_dir, **flags)
        t0 = time.perf_counter()
        engine = LLMEngine.from_engine_args(engine_args)
        ready_s = time.perf_counter() - t0
        prompts = [[(7 * i + j) % 1000 + 10 for j in range(args.input_len)]
                   for i in range(args.concurrency)]
        t0 = time.perf_counter()
        LLM(engine=engine).generate(
            prompts, SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0),
            use_tqdm=False)
        run_s = time.perf_counter() - t0
    memory = _device_memory()
    # What the allocator never had to hand out: the margin the plan left in practice.
    headroom = ({"headroom_bytes": memory["bytes_limit"] - memory["peak_bytes_in_use"]}
                if "peak_bytes_in_use" in memory else {})
    return {"oom": False, "ready_s": round(ready_s, 2), "run_s": round(run_s, 2),
            "num_blocks": engine.num_total_blocks,
            "gpu_memory_utilization": engine_args.gpu_memory_utilization,
            "memory_plan": engine.memory_plan, **memory, **headroom}


def _child(name: str, args: argparse.Namespace) -> int:
    try:
        result = run_model(name, args)
    except Exception as e:  # an OOM (or a refusal) is a result here, not a crash
        from jaxinfer.worker.kv import MemoryPlanError
        text = f"{type(e).__name__}: {e}"
        result = {"oom": any(m in text for m in OOM_MARKS), "error": text[-2000:],
                  "refused": isinstance(e, MemoryPlanError), **_device_memory()}
    print(RESULT_PREFIX + json.dumps(result, default=str), flush=True)
    return 0


def _flat(name: str, result: dict) -> dict:
    """The record's metrics of one model: its scalars and the plan's, `<name>_`-prefixed."""
    plan = result.get("memory_plan") or {}
    kv, pre = plan.get("kv") or {}, plan.get("preflight") or {}
    figures = {**{k: v for k, v in result.items() if k != "memory_plan"},
               **{f"plan_{k}": v for k, v in kv.items()},
               **{f"preflight_{k}": v for k, v in pre.items()},
               "compiled_peak_bytes": plan.get("compiled_peak_bytes"),
               "compiled_executables": plan.get("compiled_executables")}
    return {f"{name}_{k}": v for k, v in figures.items()
            if isinstance(v, (int, float, bool, str)) and v is not None}


def run(args: argparse.Namespace) -> int:
    if args.child:
        return _child(args.child, args)
    names = args.models.split(",")
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        raise SystemExit(f"--models: unknown {unknown[0]!r} (choose from {', '.join(MODELS)})")
    metrics: dict = {}
    for name in names:
        argv = [sys.executable, "-m", "jaxinfer.bench.memory_plan", "--child", name,
                "--concurrency", str(args.concurrency), "--input-len", str(args.input_len),
                "--output-len", str(args.output_len), "--max-model-len", str(args.max_model_len)]
        start = time.perf_counter()
        stdout, stderr, code = common.child(argv, args.timeout)
        line = next((x for x in stdout.splitlines() if x.startswith(RESULT_PREFIX)), None)
        if line is not None:
            result = json.loads(line[len(RESULT_PREFIX):])
        else:  # died (an XLA abort on OOM never reaches Python) or timed out
            result = {"oom": any(m in stderr for m in OOM_MARKS), "error": stderr[-2000:],
                      "returncode": code}
        result["child_s"] = round(time.perf_counter() - start, 1)
        print(f"{name}: {json.dumps(result, default=str)}", flush=True)
        metrics.update(_flat(name, result))
    metrics["any_oom"] = any(v for k, v in metrics.items() if k.endswith("_oom"))
    if args.save is not None:  # (this process never starts jax: it would take the GPU's memory)
        kind = next((v for k, v in metrics.items() if k.endswith("_device_kind")), "unknown")
        results_io.save(args.save, args.name or f"memory_plan_{results_io.kind_slug(kind)}",
                        config=common.record_config(args), metrics=metrics, merge=args.merge)
    return 1 if metrics["any_oom"] else 0


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--models", default=",".join(MODELS),
                   help=f"comma-separated shapes, each in its own process: {', '.join(MODELS)}")
    p.add_argument("--concurrency", type=int, default=256,
                   help="requests at once (also --max-num-seqs)")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--timeout", type=float, default=240, help="seconds per model's process")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    common.add_record_args(p, "memory_plan_<gpu>")
    results_io.add_merge_arg(p)  # (a run of some --models into the record of all)
    p.set_defaults(func=run)


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("memory-plan", help="the memory plan at the default utilization: OOM or not",
                       description=__doc__.split("\n", 1)[1].strip(),
                       formatter_class=common.HelpFormatter)
    _add_arguments(p)
    return p


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m jaxinfer.bench.memory_plan")
    _add_arguments(p)
    args = p.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
