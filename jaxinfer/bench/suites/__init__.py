"""The model and feature suites of the `jaxinfer bench` drivers, `jaxinfer bench DRIVER --suite
NAME [-- ITS OWN FLAGS]`: multi-section GPU harnesses (Llama-3-8B at batch 1 and under load, MoE,
multi-GPU, model families, MLA, hybrid state-space models, quantization, KV tiers, LoRA,
speculative decoding, the research loop, disaggregation, embeddings, the first minute, the soak),
each one module whose `main(argv)` runs its sections (most in a process of their own, under a
deadline) and saves its record under the record name and metric keys the project's documents
cite. Each has a CPU mode at tiny sizes (`BENCH_TINY_SHAPES=1`, or its `--tiny`) that produces
the same keys."""

from __future__ import annotations

import argparse
import dataclasses
import importlib


@dataclasses.dataclass(frozen=True)
class Suite:
    module: str  # under jaxinfer.bench.suites
    driver: str  # the `jaxinfer bench` driver whose --suite runs it
    records: str  # what it measures, into which record


SUITES = {
    "moe": Suite("moe", "throughput", "moe_<gpu>: grouped-matmul kernels, the engine on "
                                      "Qwen3-30B-A3B / Mixtral"),
    "multi-gpu": Suite("multi_gpu", "throughput", "multi_gpu_<gpu>x<n>: all-reduce, tensor, data "
                                                  "and expert parallel"),
    "families": Suite("families", "throughput", "families_<gpu>: Gemma 3 and gpt-oss shapes"),
    "mla": Suite("mla", "throughput", "mla_<gpu>: DeepSeek-V2-Lite's latent attention"),
    "hybrid": Suite("hybrid", "throughput", "hybrid_<gpu>: Qwen3-Next-80B (FP8) and Granite "
                                            "4.0-H-Tiny, 128k sequences held, SSM kernels"),
    "kv-tiers": Suite("kv_tiers", "throughput", "kv_tiers_<gpu>: the host-memory KV tier"),
    "lora": Suite("lora", "throughput", "lora_<gpu>: multi-adapter LoRA against the base model"),
    "spec-decode": Suite("spec_decode", "throughput", "spec_decode_<gpu>: EAGLE-3 and draft models"),
    "research-loop": Suite("research_loop", "throughput", "research_loop_<gpu>: rollouts, weight "
                                                          "swaps"),
    "disagg": Suite("disagg", "throughput", "disagg_<gpu>x2: prefill and decode on separate GPUs"),
    "embeddings": Suite("embeddings", "throughput", "embeddings_<gpu>: pooled embeddings"),
    "quant": Suite("quant", "throughput", "quant_<gpu>: FP8 / int8 weights in the engine, the "
                                          "matmuls, the demo model's perplexity"),
    "quant-kv": Suite("quant_kv", "throughput", "quant_kv_<gpu>: the FP8 KV cache's decode "
                                                "kernels and perplexity"),
    "llama8b": Suite("llama8b", "latency", "engine_llama8b_<gpu>: Llama-3-8B at batch 1 against "
                                           "its rooflines, and at c = 256"),
    "bs1-step": Suite("bs1_step", "latency", "bs1_step_<gpu>: the batch-1 decode step's "
                                             "variants, kernel by kernel"),
    "bs1-paths": Suite("bs1_paths", "latency", "engine_bs1_paths_<gpu>: the batch-1 engine's "
                                               "host and device paths"),
    "dispatch-sync": Suite("dispatch_sync", "latency", "dispatch_sync_<gpu>: where a step's "
                                                       "dispatch waits on the device"),
    "first-minute": Suite("first_minute", "startup", "first_minute_<gpu>: a fresh machine's "
                                                     "first minute, compile to first tokens"),
    "soak": Suite("soak", "serve", "soak_cpu: minutes of mixed load and disconnects against "
                                   "`jaxinfer serve` (RSS, leaks, 5xx)"),
}


def add_suite_args(parser: argparse.ArgumentParser, driver: str, positional: bool = True) -> None:
    """--suite NAME among `driver`'s suites, and (`positional`) the flags after `--` as
    `suite_args` (a driver that already takes its own positional flags passes them on itself)."""
    names = sorted(k for k, s in SUITES.items() if s.driver == driver)
    g = parser.add_argument_group("suites (--suite NAME [-- ITS OWN FLAGS])")
    g.add_argument("--suite", choices=names, default=None,
                   help="run a model or feature suite instead (its own flags after --; "
                        "`--suite NAME -- --help` lists them): " + "; ".join(
                            f"{k}: {SUITES[k].records}" for k in names))
    if positional:
        g.add_argument("suite_args", nargs="*", help=argparse.SUPPRESS)


def module(name: str):
    return importlib.import_module(f"jaxinfer.bench.suites.{SUITES[name].module}")


def suite_argv(args: argparse.Namespace) -> list[str]:
    """The suite's own flags: those after `--`, then the driver's --save/--name passed on."""
    argv = list(args.suite_args)
    if getattr(args, "save", None):
        argv += ["--save", args.save]
    if getattr(args, "name", None):
        argv += ["--name", args.name]
    return argv


def run_suite(args: argparse.Namespace) -> int:
    return int(module(args.suite).main(suite_argv(args)) or 0)
