"""The GPU kernels a jitted call lowers to, as MLIR text, on any machine (no GPU needed): the
Mosaic GPU modules and the Triton-lowered ones (lowered for an abstract H200), SSA names and
locations normalised, so the kernels of two commits can be diffed op for op. A refactor meant to
change nothing in a kernel should show no difference: `--check` compares every kernel with the
sha256 digests in tests/fixtures/kernel_ir.json (`--digest` rewrites them after a deliberate
kernel change), and tests/test_kernel_ir.py checks a few cheap ones in CI.

    python -m jaxinfer.bench.profile.mosaic_ir [--kernel prefill-dense] [--out FILE]
    python -m jaxinfer.bench.profile.mosaic_ir --check    # or --digest

Kernels (attention at benchmark shapes: Hq 32 / Hkv 8 / d 128, default configs): prefill-dense
(bf16, non-causal B2 S4096), prefill-paged[-fp8] (8 sequences of 512 new tokens, page 16; bf16 or
e4m3 cache), decode[-fp8] (batch 1 x 32768: the decode kernel and its split combine; -b64: batch 64
x 4096, one split), gmm-decode / gmm-prefill[-fp8] (`moe_experts` on the Mosaic kernels,
Qwen3-30B-A3B experts: 128 x 2048 x 768, 64 and 8192 routed rows; bf16 or e4m3 stacks), rms-norm
(the Triton add + RMSNorm, 1 x 4096).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import json
import re
from pathlib import Path

import jax
import jax.numpy as jnp
from jax.sharding import AbstractDevice, AbstractMesh
from jaxlib.mlir import ir

from jaxinfer.paths import REPO_ROOT
from pallas_kernels.attention import flash_prefill as fp
from pallas_kernels.attention.paged_decode_mosaic import paged_decode_mosaic
from pallas_kernels.moe.grouped_matmul import moe_experts
from pallas_kernels.norm.rms_norm import add_rms_norm_triton

# Triton lowering asks the device for its compute capability: lower for an H200 on any machine.
H200 = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(device_kind="NVIDIA H200",
                                                                   num_cores=132, platform="cuda"))


def _drop_locations(text: str) -> str:
    """Every `loc(...)` (any nesting; quoted strings may hold parentheses) and the blanks before it
    removed: locations name source files, which a move changes."""
    out, i = [], 0
    for m in re.finditer(r"\s*\bloc\(", text):
        if m.start() < i:
            continue
        out.append(text[i:m.start()])
        j, depth, quoted = m.end(), 1, False
        while depth:
            c = text[j]
            if c == '"' and text[j - 1] != "\\":
                quoted = not quoted
            elif not quoted:
                depth += {"(": 1, ")": -1}.get(c, 0)
            j += 1
        i = j
    return "".join(out) + text[i:]


def normalise(text: str) -> str:
    """SSA value and block-argument names -> %v, locations dropped, and the process-wide counter
    Mosaic GPU appends to a kernel's dump name removed."""
    text = re.sub(r'(dump_basename = "[^"]*?)_\d+"', r'\1"', _drop_locations(text))
    return re.sub(r"%[\w.#-]+", "%v", text)


def mosaic_modules(lowered) -> list[str]:
    """The normalised MLIR of every Mosaic GPU and Triton custom call in a
    `jax.jit(...).lower(...)` result."""
    module = lowered.compiler_ir("stablehlo")
    calls = []

    def walk(op):
        for region in op.regions:
            for block in region.blocks:
                for child in block.operations:
                    name = child.operation.attributes["call_target_name"] \
                        if child.operation.name == "stablehlo.custom_call" else None
                    if name is not None and (ir.StringAttr(name).value.startswith("mosaic_gpu")
                                             or ir.StringAttr(name).value.endswith("triton")):
                        calls.append(child.operation)
                    walk(child.operation)

    walk(module.operation)
    ctx = module.context
    ctx.allow_unregistered_dialects = True  # the kernel's own dialects are not registered here
    out = []
    with ctx:
        for call in calls:
            config = call.attributes["mhlo.backend_config"]
            data = ir.StringAttr(config["module" if "module" in config else "ir"]).value_bytes
            out.append(normalise(str(ir.Module.parse(data))))
    return out


def _attention(kernel: str):
    bf16, i32 = jnp.bfloat16, jnp.int32
    spec = jax.ShapeDtypeStruct
    cache_dtype = jnp.float8_e4m3fn if "-fp8" in kernel else bf16
    if kernel == "prefill-dense":
        q, kv = spec((2, 4096, 32, 128), bf16), spec((2, 4096, 8, 128), bf16)
        return functools.partial(fp.flash_attention, causal=False), (q, kv, kv)
    if kernel.startswith("prefill-paged"):
        cache = spec((8, 4200, 16, 128), cache_dtype)
        return (functools.partial(fp.flash_prefill_mosaic, scale=128 ** -0.5),
                (spec((4096, 32, 128), bf16), cache, cache, spec((9,), i32), spec((8,), i32),
                 spec((8, 520), i32)))
    batch, blocks = (64, 256) if "-b64" in kernel else (1, 2048)
    cache = spec((8, batch * blocks + 1, 16, 128), cache_dtype)
    return (functools.partial(paged_decode_mosaic, scale=128 ** -0.5),
            (spec((batch, 32, 128), bf16), cache, cache, spec((batch, blocks), i32),
             spec((batch,), i32)))


def _experts(kernel: str):
    spec = jax.ShapeDtypeStruct
    rows = 64 if "decode" in kernel else 8192
    e, h, f = 128, 2048, 768
    x, sizes = spec((rows, h), jnp.bfloat16), spec((e,), jnp.int32)
    if not kernel.endswith("-fp8"):
        w = spec((e, h, f), jnp.bfloat16), spec((e, h, f), jnp.bfloat16), spec((e, f, h), jnp.bfloat16)
        return functools.partial(moe_experts, impl="mosaic"), (x, w, sizes)
    w8 = (spec((e, h, f), jnp.float8_e4m3fn), spec((e, h, f), jnp.float8_e4m3fn),
          spec((e, f, h), jnp.float8_e4m3fn))
    scales = spec((e, f), jnp.float32), spec((e, f), jnp.float32), spec((e, h), jnp.float32)
    return (lambda x, w, g, s: moe_experts(x, w, g, impl="mosaic", scales=s)), (x, w8, sizes, scales)


KERNELS = ("prefill-dense", "prefill-paged", "prefill-paged-fp8", "decode", "decode-fp8",
           "decode-b64", "decode-fp8-b64", "gmm-decode", "gmm-prefill", "gmm-decode-fp8",
           "gmm-prefill-fp8", "rms-norm")
# The digests of the production kernels as the last deliberate kernel change left them.
# The checkout's digests (a kernel developer's tool: the wheel has no tests/).
DIGESTS = REPO_ROOT / "tests" / "fixtures" / "kernel_ir.json"


def lower(kernel: str):
    if kernel not in KERNELS:
        raise ValueError(f"--kernel {kernel!r}: one of {', '.join(KERNELS)}")
    if kernel.startswith("gmm"):
        fn, args = _experts(kernel)
    elif kernel == "rms-norm":
        x = jax.ShapeDtypeStruct((1, 4096), jnp.bfloat16)
        fn = functools.partial(add_rms_norm_triton, eps=1e-5)
        args = x, x, jax.ShapeDtypeStruct((4096,), jnp.bfloat16)
    else:
        fn, args = _attention(kernel)
    # The engine's matmul precision (the tests raise theirs), and an H200 for Triton.
    with jax.default_matmul_precision(None), contextlib.ExitStack() as stack:
        if kernel == "rms-norm":
            stack.enter_context(jax.sharding.use_abstract_mesh(H200))
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))


def kernel_text(kernel: str) -> str:
    """Every GPU kernel `kernel` lowers to, normalised, in call order."""
    return "\n// ----- next kernel -----\n".join(mosaic_modules(lower(kernel)))


def digest(kernel: str) -> str:
    return hashlib.sha256(kernel_text(kernel).encode()).hexdigest()


def changed(kernels=KERNELS) -> list[str]:
    """The kernels whose lowered modules differ from DIGESTS'."""
    want = json.loads(DIGESTS.read_text())
    return [k for k in kernels if digest(k) != want.get(k)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernel", default="prefill-dense")
    ap.add_argument("--out", default=None, help="write here (default: stdout)")
    ap.add_argument("--digest", action="store_true",
                    help=f"write every kernel's sha256 to {DIGESTS.relative_to(DIGESTS.parents[2])}")
    ap.add_argument("--check", action="store_true",
                    help="exit 1 naming the kernels whose modules differ from the digests")
    args = ap.parse_args()
    if args.digest:
        DIGESTS.write_text(json.dumps({k: digest(k) for k in KERNELS}, indent=1) + "\n")
        return
    if args.check:
        diff = changed()
        print("changed: " + ", ".join(diff) if diff else "every kernel as in the digests")
        raise SystemExit(1 if diff else 0)
    text = kernel_text(args.kernel)
    if args.out:
        Path(args.out).write_text(text)
    else:
        print(text)


if __name__ == "__main__":
    main()
