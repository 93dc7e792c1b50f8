"""`jaxinfer bench startup --checkpoint-load`: checkpoint load time, HF safetensors vs orbax
restore of the same weights.

Makes a model of a real shape with random weights (default: Qwen2.5-0.5B's config), saves it both
ways, then times `load_params` for each (median of --repeats, after one untimed load so both read
from the page cache).

    jaxinfer bench startup --checkpoint-load [--shape qwen2.5-0.5b|llama-3-8b] [--save]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from jaxinfer.bench import results_io

SHAPES = {
    "qwen2.5-0.5b": dict(architectures=["Qwen2ForCausalLM"], vocab_size=151936, hidden_size=896,
                         intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, max_position_embeddings=32768, tie_word_embeddings=True),
    "llama-3-8b": dict(architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=4096,
                       intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, max_position_embeddings=8192),
}


def add_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("checkpoint load (--checkpoint-load)")
    g.add_argument("--checkpoint-load", action="store_true",
                   help="time loading a checkpoint (safetensors, orbax) instead of serving")
    g.add_argument("--shape", default="qwen2.5-0.5b", choices=sorted(SHAPES),
                   help="the model shape, random weights")
    g.add_argument("--repeats", type=int, default=3, help="timed loads per format")


def run(args: argparse.Namespace) -> dict:
    """Loads each format --repeats times; the record (--save) is load_<shape>_<device>."""
    import jax
    import jax.numpy as jnp

    from jaxinfer.model.config import config_from_dict
    from jaxinfer.model.weights import load_params, save_orbax, save_safetensors
    raw = SHAPES[args.shape]
    cfg = config_from_dict(raw)
    params = load_params(None, cfg, jnp.bfloat16, load_format="dummy")
    nbytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(params))
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "config.json").write_text(json.dumps(raw))
        save_safetensors(params, cfg, d)
        save_orbax(params, d)
        del params
        results = {}
        for fmt in ("safetensors", "orbax"):
            times = []
            for i in range(args.repeats + 1):
                t0 = time.perf_counter()
                p = load_params(d, cfg, jnp.bfloat16, load_format=fmt, progress=False)
                jax.block_until_ready(p)
                if i:
                    times.append(time.perf_counter() - t0)
                del p
            results[fmt] = statistics.median(times)
    out = dict(shape=args.shape, params=cfg.num_params(), bytes=nbytes, device=str(jax.devices()[0]),
               seconds=results, gb_per_s={k: nbytes / v / 1e9 for k, v in results.items()})
    print(f"{args.shape}: {cfg.num_params() / 1e6:.0f}M params, {nbytes / 1e9:.2f} GB bf16 on "
          f"{jax.devices()[0]}")
    for fmt, sec in results.items():
        print(f"  {fmt:12s} {sec:6.2f} s  {nbytes / sec / 1e9:5.2f} GB/s")
    if args.save:
        metrics = {f"{fmt}_s": round(sec, 3) for fmt, sec in results.items()}
        metrics.update({f"{fmt}_gb_per_s": round(nbytes / sec / 1e9, 3) for fmt, sec in results.items()})
        results_io.save(args.save, args.name or f"load_{args.shape}_{results_io.device_slug()}",
                        config={"preset": args.shape, "repeats": args.repeats, "params": out["params"],
                                "bytes": nbytes}, metrics=metrics)
    return out
