"""The model and feature suites of `jaxinfer bench throughput --suite NAME [-- ITS OWN FLAGS]`:
multi-section GPU harnesses (MoE, multi-GPU, model families, MLA, KV tiers, LoRA, speculative
decoding, the research loop, disaggregation, embeddings), each one module whose `main(argv)` runs
its sections (most in a process of their own, under a deadline) and saves its record under the
record name and metric keys the project's documents cite. Each has a CPU mode at tiny sizes
(`BENCH_TINY_SHAPES=1`, or its `--tiny`) that produces the same keys."""

from __future__ import annotations

import argparse
import importlib

# --suite NAME -> its module under jaxinfer.bench.suites and the record(s) it writes.
SUITES = {
    "moe": ("moe", "moe_<gpu>: grouped-matmul kernels and the engine on Qwen3-30B-A3B / Mixtral"),
    "multi-gpu": ("multi_gpu", "multi_gpu_<gpu>x<n>: all-reduce, tensor / data / expert parallel"),
    "families": ("families", "families_<gpu>: Gemma 3 and gpt-oss shapes, sliding windows"),
    "mla": ("mla", "mla_<gpu>: DeepSeek-V2-Lite's latent attention, kernel to engine"),
    "kv-tiers": ("kv_tiers", "kv_tiers_<gpu>: host-memory KV tier, multi-turn and long context"),
    "lora": ("lora", "lora_<gpu>: multi-adapter LoRA decode against the base model"),
    "spec-decode": ("spec_decode", "spec_decode_<gpu>: EAGLE-3 and draft-model speculation"),
    "research-loop": ("research_loop", "research_loop_<gpu>: rollouts, weight swaps, log-probs"),
    "disagg": ("disagg", "disagg_<gpu>x2: prefill / decode on separate GPUs against one"),
    "embeddings": ("embeddings", "embeddings_<gpu>: pooled embeddings per second"),
}


def add_suite_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("suites (--suite NAME [-- ITS OWN FLAGS])")
    g.add_argument("--suite", choices=sorted(SUITES), default=None,
                   help="run a model or feature suite instead (its own flags after --; "
                        "`--suite NAME -- --help` lists them): " + "; ".join(
                            f"{k}: {v[1]}" for k, v in sorted(SUITES.items())))
    g.add_argument("suite_args", nargs="*", help=argparse.SUPPRESS)


def module(name: str):
    return importlib.import_module(f"jaxinfer.bench.suites.{SUITES[name][0]}")


def run_suite(args: argparse.Namespace) -> int:
    """Runs args.suite with the flags after `--`, and the driver's --save/--name passed on."""
    argv = list(args.suite_args)
    if getattr(args, "save", None):
        argv += ["--save", args.save]
    if getattr(args, "name", None):
        argv += ["--name", args.name]
    return int(module(args.suite).main(argv) or 0)
