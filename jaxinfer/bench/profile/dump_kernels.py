"""Compile our Mosaic GPU kernels with Mosaic's dump flags and print what ptxas made of each (H200).

    python -m jaxinfer.bench.profile.dump_kernels [--kernels prefill,decode,latent]
        [--prefill-configs default,spec] [--dir DIR]

Mosaic GPU reads MOSAIC_GPU_DUMP_PTX / MOSAIC_GPU_DUMP_PTXAS / MOSAIC_GPU_DUMP_TO when it compiles a
kernel (in XLA's compile, so on the GPU machine). This script sets them, compiles and runs each
kernel once at a benchmark shape (prefill: dense non-causal B2 S4096 Hq 32 / Hkv 8 / d 128; decode:
batch 1 x 32768; latent: MLA's latent decode at batch 64 x 4096, 16 heads, heads-minor and
heads-major), then prints ptxas's report per kernel: registers per thread, spill stores and
loads, and any warning (e.g. a "wgmma ... serialized" note, where a kernel loses its tensor-core
overlap without an error). The PTX stays in DIR (default $OUT/mosaic_dump or /tmp/mosaic_dump):
`ptxas -arch=sm_90a` and `nvdisasm` from the CUDA toolkit turn it into SASS on any machine.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path


def compile_prefill(config_name: str = "default") -> None:
    import jax
    import jax.numpy as jnp

    from pallas_kernels.attention import flash_prefill as fp
    from jaxinfer.bench.profile.prefill_config import prefill_config
    config = prefill_config(config_name)
    b, l, hq, hkv, d = 2, 4096, 32, 8, 128
    ks = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(ks[0], (b, l, hq, d), jnp.bfloat16)
    k, v = (jax.random.normal(kk, (b, l, hkv, d), jnp.bfloat16) for kk in ks[1:])
    jax.block_until_ready(jax.jit(lambda q, k, v: fp.flash_attention(q, k, v, causal=False,
                                                                    config=config))(q, k, v))


def compile_decode() -> None:
    import jax

    from jaxinfer.bench import kernel_decode as bd
    from pallas_kernels.attention.paged_decode import MosaicDecodeConfig, paged_decode_mosaic
    case = bd.make_paged_case(1, 32768)
    jax.block_until_ready(jax.jit(lambda q, k, v, bt, lens: paged_decode_mosaic(
        q, k, v, bt, lens, scale=bd.D ** -0.5, config=MosaicDecodeConfig()))(
        case["q"], case["k"], case["v"], case["bts"][0], case["lens"]))


def compile_latent(heads_minor: bool) -> None:
    import jax
    import jax.numpy as jnp

    from pallas_kernels.attention.latent_decode_mosaic import (LatentDecodeConfig,
                                                               latent_decode_mosaic)
    batch, pages, heads, width = 64, 256, 16, 576
    ks = jax.random.split(jax.random.key(0), 2)
    cache = jax.random.normal(ks[0], (1, batch * pages, 16, width), jnp.bfloat16)
    q = jax.random.normal(ks[1], (batch, heads, width), jnp.bfloat16)
    tables = jnp.arange(batch * pages, dtype=jnp.int32).reshape(batch, pages)
    lens = jnp.full((batch,), pages * 16, jnp.int32)
    config = LatentDecodeConfig(heads_minor=heads_minor)
    jax.block_until_ready(jax.jit(lambda q, c, t, s: latent_decode_mosaic(
        q, c, c, t, s, scale=width ** -0.5, value_width=512, config=config))(q, cache, tables,
                                                                            lens))


def ptxas_reports(dump_dir: Path) -> list[str]:
    """One line per dumped kernel: its name, then ptxas's register / spill / warning lines."""
    lines = []
    for path in sorted(dump_dir.glob("*.ptxas")):
        keep = [ln.strip() for ln in path.read_text(errors="replace").splitlines()
                if any(w in ln for w in ("registers", "spill", "warning", "serializ"))]
        lines.append(f"{path.stem}: " + " | ".join(keep))
    return lines


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernels", default="prefill,decode")
    ap.add_argument("--prefill-configs", default="default",
                    help="comma list of configurations (prefill_config.py); each dumps into its own "
                         "folder")
    ap.add_argument("--dir", default=None, help="dump directory")
    args = ap.parse_args(argv)
    root = Path(args.dir or os.path.join(os.environ.get("OUT", "/tmp"), "mosaic_dump"))
    jobs = [("decode", compile_decode)] if "decode" in args.kernels.split(",") else []
    if "prefill" in args.kernels.split(","):
        jobs += [(f"prefill_{c}", lambda c=c: compile_prefill(c))
                 for c in args.prefill_configs.split(",")]
    if "latent" in args.kernels.split(","):
        jobs += [(f"latent_{name}", lambda hm=hm: compile_latent(hm))
                 for name, hm in (("heads_minor", True), ("heads_major", False))]
    root.mkdir(parents=True, exist_ok=True)
    os.environ.update(MOSAIC_GPU_DUMP_TO=str(root), MOSAIC_GPU_DUMP_PTX="1",
                      MOSAIC_GPU_DUMP_PTXAS="1")
    for name, compile_kernel in jobs:
        compile_kernel()
        # What this compile dumped moves to its own folder (the names Mosaic gives do not say
        # which configuration a kernel came from).
        dump_dir = root / name
        dump_dir.mkdir(exist_ok=True)
        for path in root.iterdir():
            if path.is_file():
                path.rename(dump_dir / path.name)
        print("\n".join(f"{name} {line}" for line in ptxas_reports(dump_dir)), flush=True)


if __name__ == "__main__":
    main()
