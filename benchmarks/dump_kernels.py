"""Compile our Mosaic GPU kernels with Mosaic's dump flags and summarise what ptxas made of them.

    MOSAIC_GPU_DUMP_TO=$OUT/dump python3 benchmarks/dump_kernels.py [--kernels prefill,decode]

Mosaic GPU reads MOSAIC_GPU_DUMP_{PTX,PTXAS,SASS} when it compiles a kernel; this script sets them
(unless set already), compiles and runs each kernel once at a benchmark shape, then prints, per
dumped kernel: registers per thread, spill stores/loads, the wgmma instructions and the waits ptxas
put between them, and any ptxas warning (e.g. "wgmma.mma_async instructions are serialized"), which
is where a kernel can lose its tensor-core overlap without any error.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

for flag in ("MOSAIC_GPU_DUMP_PTX", "MOSAIC_GPU_DUMP_PTXAS", "MOSAIC_GPU_DUMP_SASS"):
    os.environ.setdefault(flag, "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def compile_prefill(causal: bool, timed: bool) -> None:
    from pallas_kernels import flash_prefill as fp
    b, l, hq, hkv, d = 2, 4096, 32, 8, 128
    ks = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(ks[0], (b, l, hq, d), jnp.bfloat16)
    k = jax.random.normal(ks[1], (b, l, hkv, d), jnp.bfloat16)
    v = jax.random.normal(ks[2], (b, l, hkv, d), jnp.bfloat16)
    ours = jax.jit(lambda q, k, v: fp.flash_attention(q, k, v, causal=causal, scale=d ** -0.5))
    jax.block_until_ready(ours(q, k, v))
    if timed:  # beside cuDNN, as bench_prefill times them
        from benchmarks.bench_prefill import bench, dense_flops
        cudnn = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, scale=d ** -0.5, is_causal=causal, implementation="cudnn"))
        for name, f in (("ours", ours), ("cudnn", cudnn), ("ours", ours)):
            t = bench(f, q, k, v)
            print(f"prefill B{b} S{l} causal={causal} {name}: {t * 1e3:.3f} ms "
                  f"{dense_flops(b, l, causal) / t / 1e12:.1f} TF/s", flush=True)


def compile_decode() -> None:
    from benchmarks import bench_decode as bd
    from pallas_kernels.paged_decode import MosaicDecodeConfig, paged_decode_mosaic_configured
    case = bd.make_paged_case(1, 32768)
    jax.block_until_ready(jax.jit(lambda q, k, v, bt, lens: paged_decode_mosaic_configured(
        q, k, v, bt, lens, scale=bd.D ** -0.5, config=MosaicDecodeConfig()))(
        case["q"], case["k"], case["v"], case["bts"][0], case["lens"]))


def summarise(dump_dir: str) -> None:
    for name in sorted(os.listdir(dump_dir)):
        path = os.path.join(dump_dir, name)
        text = open(path, errors="replace").read()
        print(f"== {name} ({len(text)} chars)")
        if name.endswith(".sass") or "sass" in name:
            ops = re.findall(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", text, re.M)
            counts: dict[str, int] = {}
            for op in ops:
                base = op.split(".")[0]
                counts[base] = counts.get(base, 0) + 1
            top = sorted(counts.items(), key=lambda kv: -kv[1])[:25]
            print("   instructions:", len(ops), " ".join(f"{k}:{v}" for k, v in top))
            for key in ("HGMMA", "WARPGROUP", "MUFU", "STL", "LDL", "BAR", "SYNCS"):
                print(f"   {key}: {sum(v for k, v in counts.items() if k.startswith(key))}")
        else:
            for line in text.splitlines():
                if re.search(r"registers|spill|warn|serializ|Potential", line, re.I):
                    print("  ", line.strip()[:300])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernels", default="prefill,decode")
    ap.add_argument("--time", action="store_true", help="also time the prefill beside cuDNN")
    ap.add_argument("--summarise-only", metavar="DIR", help="only summarise an existing dump")
    args = ap.parse_args()
    if args.summarise_only:
        summarise(args.summarise_only)
        return
    dump_dir = os.environ.get("MOSAIC_GPU_DUMP_TO")
    kinds = args.kernels.split(",")
    if "prefill" in kinds:
        compile_prefill(causal=False, timed=args.time)
    if "decode" in kinds:
        compile_decode()
    if dump_dir and os.path.isdir(dump_dir):
        summarise(dump_dir)


if __name__ == "__main__":
    main()
