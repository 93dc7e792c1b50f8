"""The Mosaic GPU kernels a jitted call lowers to, as MLIR text, on any machine (no GPU needed): SSA
names and locations normalised, so the kernels of two commits can be diffed op for op. A refactor
meant to change nothing in a kernel should show no difference.

    python -m tools.mosaic_ir [--kernel prefill-dense] [--out FILE]
    # e.g. in a worktree of another commit, then: diff A.mlir B.mlir

Kernels (benchmark shapes: Hq 32 / Hkv 8 / d 128, bf16, default configs): prefill-dense (non-causal
B2 S4096), prefill-paged (8 sequences of 512 new tokens, page 16), decode (batch 1 x 32768).
"""

from __future__ import annotations

import argparse
import functools
import re
from pathlib import Path


import jax
import jax.numpy as jnp
from jaxlib.mlir import ir

from pallas_kernels.attention import flash_prefill as fp
from pallas_kernels.attention.paged_decode_mosaic import paged_decode_mosaic


def normalise(text: str) -> str:
    """SSA value and block-argument names -> %v, locations dropped."""
    text = re.sub(r"\s*loc\([^()]*(\([^()]*\)[^()]*)*\)", "", text)
    return re.sub(r"%[\w.#-]+", "%v", text)


def mosaic_modules(lowered) -> list[str]:
    """The normalised MLIR of every Mosaic GPU custom call in a `jax.jit(...).lower(...)` result."""
    module = lowered.compiler_ir("stablehlo")
    calls = []

    def walk(op):
        for region in op.regions:
            for block in region.blocks:
                for child in block.operations:
                    name = child.operation.attributes["call_target_name"] \
                        if child.operation.name == "stablehlo.custom_call" else None
                    if name is not None and ir.StringAttr(name).value.startswith("mosaic_gpu"):
                        calls.append(child.operation)
                    walk(child.operation)

    walk(module.operation)
    ctx = module.context
    ctx.allow_unregistered_dialects = True  # the kernel's own dialects are not registered here
    out = []
    with ctx:
        for call in calls:
            data = ir.StringAttr(call.attributes["mhlo.backend_config"]["module"]).value_bytes
            out.append(normalise(str(ir.Module.parse(data))))
    return out


def lower(kernel: str):
    bf16, i32 = jnp.bfloat16, jnp.int32
    spec = jax.ShapeDtypeStruct
    if kernel == "prefill-dense":
        q, kv = spec((2, 4096, 32, 128), bf16), spec((2, 4096, 8, 128), bf16)
        fn, args = functools.partial(fp.flash_attention, causal=False), (q, kv, kv)
    elif kernel == "prefill-paged":
        cache = spec((8, 4200, 16, 128), bf16)
        fn = functools.partial(fp.flash_prefill_mosaic, scale=128 ** -0.5)
        args = (spec((4096, 32, 128), bf16), cache, cache, spec((9,), i32), spec((8,), i32),
                spec((8, 520), i32))
    elif kernel == "decode":
        cache = spec((8, 2049, 16, 128), bf16)
        fn = functools.partial(paged_decode_mosaic, scale=128 ** -0.5)
        args = (spec((1, 32, 128), bf16), cache, cache, spec((1, 2048), i32), spec((1,), i32))
    else:
        raise ValueError(f"--kernel {kernel!r}: prefill-dense, prefill-paged or decode")
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernel", default="prefill-dense")
    ap.add_argument("--out", default=None, help="write here (default: stdout)")
    args = ap.parse_args()
    text = "\n// ----- next kernel -----\n".join(mosaic_modules(lower(args.kernel)))
    if args.out:
        Path(args.out).write_text(text)
    else:
        print(text)


if __name__ == "__main__":
    main()
