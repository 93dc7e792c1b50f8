"""Where a flash-prefill step's time goes, from Mosaic GPU's in-kernel profiler (on the H200).

    python -m jaxinfer.bench.profile.profile_prefill [--configs default,stages=3] [--causal]

Dense attention at B1 S2048 Hq 8 / Hkv 2 / d 128 (bf16): 16 query tiles x 8 heads = 128 items, one
per CTA, each streaming 16 K/V steps -- every CTA busy at once, as in a large call, but few enough
events per warpgroup for the profiler's shared-memory buffer. Each configuration ("default" or
field overrides such as "stages=3", `prefill_config.py`) runs once unprofiled and once with
`KernelConfig.profile_dir` set; the summary gives each named range's mean and max per occurrence
in µs (at the maximum SM clock):
  consumers: qk (issue QK, hand the turn over, wait for S), softmax, wait_v_turn (V landed and
  the turn back), pv (PV, with the next K's wait inside); producer: wait_free (a slot released).
A step of one consumer is qk + softmax + wait_v_turn + pv; with the tensor cores never idle, two
consumers' steps take 4 matmuls of 64 x 128 x 128 (~0.6 µs at the dense bf16 peak).
Traces and summary.json go under $OUT/prefill_profiles (or --out).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from pathlib import Path


import jax
import jax.numpy as jnp

from jaxinfer.bench.profile.prefill_config import prefill_config
from jaxinfer.bench.profile.profile_decode import read_trace
from pallas_kernels.attention import flash_prefill as fp

B, L, HQ, HKV, D = 1, 2048, 8, 2, 128


def profile_config(name: str, causal: bool, out_dir: Path) -> dict:
    config = prefill_config(name)
    ks = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(ks[0], (B, L, HQ, D), jnp.bfloat16)
    k = jax.random.normal(ks[1], (B, L, HKV, D), jnp.bfloat16)
    v = jax.random.normal(ks[2], (B, L, HKV, D), jnp.bfloat16)
    trace_dir = out_dir / f"{name}_{'causal' if causal else 'noncausal'}"
    trace_dir.mkdir(parents=True, exist_ok=True)
    for cfg in (config, dataclasses.replace(config, profile_dir=str(trace_dir))):
        jax.block_until_ready(jax.jit(lambda q, k, v, cfg=cfg: fp.flash_attention(
            q, k, v, causal=causal, config=cfg))(q, k, v))
    return {**read_trace(trace_dir), "config": name, "causal": causal}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="default")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    out_dir = Path(args.out or os.path.join(os.environ.get("OUT", "/tmp"), "prefill_profiles"))
    rows = [profile_config(name, args.causal, out_dir) for name in args.configs.split(",")]
    (out_dir / "summary.json").write_text(json.dumps(rows, indent=1))
    names = ("qk", "softmax", "wait_v_turn", "pv", "wait_free")
    print("\n| config | span µs | " + " | ".join(f"{n} mean / max µs" for n in names) + " |")
    print("|---|---|" + "---|" * len(names))
    for r in rows:
        if "error" in r:
            print(f"| {r['config']} | {r['error']} |")
            continue
        cells = [f"{r['ranges_us'][n]['mean']:.3f} / {r['ranges_us'][n]['max']:.3f}"
                 if n in r["ranges_us"] else "–" for n in names]
        print(f"| {r['config']} | {r['span_us']:.1f} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
