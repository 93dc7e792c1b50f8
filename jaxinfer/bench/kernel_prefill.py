"""Flash prefill attention on the GPU: our Mosaic kernel beside cuDNN and the other anchors,
measured in the same run.

    python -m jaxinfer.bench.kernel_prefill [--quick] [--shapes dense,paged] [--save [DIR]]

dense   causal B1 S8192 and B2 S4096, non-causal B2 S4096 (Hq 32 / Hkv 8, d 128): ours (Mosaic,
        bf16 and f16), cuDNN and XLA through jax.nn.dot_product_attention, jax's bundled
        attention_mgpu (f16 only) and Triton mha (K/V repeated). Every output is compared with
        cuDNN's in the same dtype (rel_err_vs_cudnn).
paged   a chunk of 8 sequences x 512 new tokens over 8192 cached (page 16 and 32): ours Mosaic
        paged, Mosaic over contiguous K/V (the cost of paging), Triton paged.
--quick times ours and cuDNN only. TF/s counts only visible (unmasked) query-key pairs:
4 * D * Hq * pairs (causal ~ half the square). The record (`--save`) is flash_prefill_<gpu>.json;
its metrics name each shape `prefill_{causal|noncausal}_b{B}s{S}` with `_tflops`, the anchor's
`_cudnn_tflops` and their ratio `_over_cudnn`. The kernels' correctness at real sizes is
tests/gpu/test_flash_prefill_gpu.py.
"""

from __future__ import annotations

import argparse
import functools
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.bench import results_io
from pallas_kernels.attention import flash_mgpu, reference
from pallas_kernels.attention import flash_prefill as fp
from pallas_kernels.attention.flash_config import KernelConfig
from pallas_kernels.common.testing import random_paged_batch

HQ, HKV, D = 32, 8, 128
DENSE_SHAPES = [(1, 8192, True), (2, 4096, True), (2, 4096, False)]  # (B, L, causal)
CUDNN = {jnp.bfloat16: "cudnn_bf16", jnp.float16: "cudnn_f16"}  # each dtype's check


def bench_interleaved(calls: dict, reps: int = 7, inner: int = 10) -> dict:
    """name -> median seconds per call of calls[name] = (f, args): `inner` back-to-back calls per
    sample, after warm-up. The samples of all names are interleaved (one of each per rep), so
    clock and thermal drift during the run falls on every implementation alike and their ratios
    hold even when the absolute figures move."""
    for f, args in calls.values():
        for _ in range(2):
            jax.block_until_ready(f(*args))
    ts = {name: [] for name in calls}
    for _ in range(reps):
        for name, (f, args) in calls.items():
            t = time.perf_counter()
            for _ in range(inner):
                out = f(*args)
            jax.block_until_ready(out)
            ts[name].append((time.perf_counter() - t) / inner)
    return {name: float(np.median(v)) for name, v in ts.items()}


def rel_err(out, ref) -> float:
    out = jnp.asarray(out, jnp.float32)
    ref = jnp.asarray(ref, jnp.float32)
    if bool(jnp.isnan(out).any()):
        return float("nan")
    return float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))


def _normal(key, shape, dtype):
    return jax.random.normal(key, shape, jnp.float32).astype(dtype)


def _error(e: Exception, limit: int = 500) -> dict:
    return {"error": "".join(traceback.format_exception_only(type(e), e))[-limit:]}


def dense_flops(b, l, causal):
    pairs = l * (l + 1) / 2 if causal else l * l
    return 4 * D * HQ * b * pairs


def dense_key(b, l, causal) -> str:
    return f"prefill_{'causal' if causal else 'noncausal'}_b{b}s{l}"


def dense_impls(causal: bool, quick: bool) -> dict:
    """name -> (dtype, fn(q, k, v)) for one dense shape."""
    from jax.experimental.pallas.ops.gpu import attention as tri_mha
    from jax.experimental.pallas.ops.gpu import attention_mgpu as am

    sm, rep = D ** -0.5, HQ // HKV
    ours = lambda q, k, v: fp.flash_attention(q, k, v, causal=causal, scale=sm)
    sdpa = lambda impl: lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, scale=sm, is_causal=causal, implementation=impl)
    impls = {
        "ours_mosaic_bf16": (jnp.bfloat16, ours),
        "cudnn_bf16": (jnp.bfloat16, sdpa("cudnn")),
        "ours_mosaic_f16": (jnp.float16, ours),
        "cudnn_f16": (jnp.float16, sdpa("cudnn")),
        "xla_bf16": (jnp.bfloat16, sdpa("xla")),
        "jax_attention_mgpu_f16": (jnp.float16, lambda q, k, v: am.attention(
            (q * sm).astype(q.dtype), k, v,
            am.TuningConfig(block_q=64, block_kv=128, max_concurrent_steps=2, causal=causal))),
        "jax_triton_mha_bf16": (jnp.bfloat16, lambda q, k, v: tri_mha.mha(
            q, jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2), None, sm_scale=sm,
            causal=causal)),
    }
    return {k: impls[k] for k in list(impls)[:2]} if quick else impls


def time_dense(results: dict, quick: bool = False) -> None:
    for b, l, causal in DENSE_SHAPES:
        key = dense_key(b, l, causal)
        row = results.setdefault(key, {})
        ks = jax.random.split(jax.random.key(b * l), 3)
        inputs = {dt: (_normal(ks[0], (b, l, HQ, D), dt), _normal(ks[1], (b, l, HKV, D), dt),
                       _normal(ks[2], (b, l, HKV, D), dt)) for dt in (jnp.bfloat16, jnp.float16)}
        impls = dense_impls(causal, quick)
        ref, ready = {}, {}
        for name, (dt, f) in impls.items():
            try:
                fj, args = jax.jit(f), inputs[dt]
                t0 = time.perf_counter()
                out = jax.block_until_ready(fj(*args))
                first = time.perf_counter() - t0
                if dt not in ref:  # cuDNN in the same dtype is the check (f32 reference too big)
                    ref[dt] = jax.jit(impls[CUDNN[dt]][1])(*args)
                row[name] = {"rel_err_vs_cudnn": round(rel_err(out, ref[dt]), 5),
                             "first_call_s": round(first, 1)}
                ready[name] = (fj, args)
            except Exception as e:  # a failing implementation is recorded, the others still run
                row[name] = _error(e)
        _record_times(key, row, ready, dense_flops(b, l, causal))


def time_paged(results: dict, quick: bool = False) -> None:
    s, new, cached = 8, 512, 8192
    ctx = new + cached
    fl = 4 * D * HQ * s * (new * cached + new * (new + 1) / 2)
    rng = np.random.default_rng(3)
    sm = D ** -0.5
    for bs in (16, 32):
        key = f"prefill_paged_s{s}_new{new}_cached{cached}_page{bs}"
        row = results.setdefault(key, {})
        args = random_paged_batch(rng, hq=HQ, hkv=HKV, d=D, block_size=bs, q_lens=[new] * s,
                                  prefixes=[cached] * s, dtype=jnp.bfloat16)
        q, k_cache, v_cache, qsl, lens, tables = args
        # The same keys laid out contiguously, token-major: what the paging costs.
        k_flat = reference.gather_context(k_cache, tables)[:, :ctx].reshape(s * ctx, HKV, D)
        v_flat = reference.gather_context(v_cache, tables)[:, :ctx].reshape(s * ctx, HKV, D)
        starts = qsl[:-1]
        tiles = fp.tile_table(starts, qsl[1:] - starts, lens,
                              jnp.arange(s, dtype=jnp.int32) * ctx // 8, q.shape[0], causal=True)
        contiguous = lambda q, k, v, tiles: flash_mgpu.mosaic_attention(
            q, k, v, tiles, jnp.zeros((1, 1), jnp.int32), kv_mode="contiguous", causal=True,
            scale=sm, softcap=None, config=KernelConfig())
        paged = lambda f: functools.partial(f, scale=sm, softcap=None)
        impls = {"ours_mosaic_paged": (paged(fp.flash_prefill_mosaic), args),
                 "ours_mosaic_contiguous_kv": (contiguous, (q, k_flat, v_flat, tiles))}
        if not quick and bs == 16:
            impls["ours_triton_paged"] = (paged(fp.flash_prefill_triton), args)
        ref, ready = None, {}
        for name, (f, a) in impls.items():
            try:
                fj = jax.jit(f)
                out = fj(*a)
                ref = out if ref is None else ref
                row[name] = {"rel_diff_vs_mosaic_paged": round(rel_err(out, ref), 5)}
                ready[name] = (fj, a)
            except Exception as e:  # a failing implementation is recorded, the others still run
                row[name] = _error(e)
        _record_times(key, row, ready, fl)


def _record_times(key, row, ready, flops):
    """Times the compiled calls of one shape side by side (interleaved) into row[name]."""
    for name, t in bench_interleaved(ready).items():
        row[name] = {"ms": round(t * 1e3, 3), "TFLOPs": round(flops / t / 1e12, 1), **row[name]}
    for name in row:
        print(key, name, row[name], flush=True)


def metrics(timing: dict) -> dict:
    """The record's flat metrics: per shape, ours (bf16) in TF/s and ms, the cuDNN anchor measured
    beside it and their ratio; every other implementation's TF/s as `<shape>_<impl>_tflops`."""
    out = {}
    for key, row in timing.items():
        ours = row.get("ours_mosaic_bf16") or row.get("ours_mosaic_paged") or {}
        cudnn = row.get("cudnn_bf16", {})
        if "TFLOPs" in ours:
            out[f"{key}_tflops"], out[f"{key}_ms"] = ours["TFLOPs"], ours["ms"]
        if "TFLOPs" in cudnn:
            out[f"{key}_cudnn_tflops"] = cudnn["TFLOPs"]
            if "TFLOPs" in ours:
                out[f"{key}_over_cudnn"] = round(ours["TFLOPs"] / cudnn["TFLOPs"], 3)
        for impl, rec in row.items():
            if "TFLOPs" in rec and rec is not ours and rec is not cudnn:
                out[f"{key}_{impl}_tflops"] = rec["TFLOPs"]
            if "rel_err_vs_cudnn" in rec and impl.startswith("ours"):
                out[f"{key}_{impl}_rel_err_vs_cudnn"] = rec["rel_err_vs_cudnn"]
            if "error" in rec:
                out[f"{key}_{impl}_error"] = rec["error"][-200:]
    return out


def print_table(timing: dict) -> None:
    print("\n| shape | implementation | ms | TF/s | vs cuDNN bf16 |\n|---|---|---|---|---|")
    for shape, row in timing.items():
        cudnn = row.get("cudnn_bf16", {}).get("TFLOPs")
        for impl, v in row.items():
            tf = v.get("TFLOPs")
            ratio = f"{tf / cudnn:.2f}x" if tf and cudnn else v.get("error", "")[:60]
            print(f"| {shape} | {impl} | {v.get('ms', '–')} | {tf or '–'} | {ratio} |")


def run(shapes=("dense", "paged"), quick: bool = False) -> dict:
    timing = {}
    if "dense" in shapes:
        time_dense(timing, quick)
    if "paged" in shapes:
        time_paged(timing, quick)
    return timing


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="ours vs cuDNN only")
    ap.add_argument("--shapes", default="dense,paged", help="comma list of dense, paged")
    results_io.add_save_arg(ap, "flash_prefill_<gpu>")
    args = ap.parse_args(argv)
    shapes = tuple(args.shapes.split(","))
    timing = run(shapes, args.quick)
    print_table(timing)
    if args.save:
        results_io.save(args.save, args.name or f"flash_prefill_{results_io.device_slug()}",
                        config={"hq": HQ, "hkv": HKV, "d": D, "dtype": "bfloat16",
                                "shapes": list(shapes), "quick": args.quick,
                                "default_config": str(KernelConfig())},
                        metrics=metrics(timing))
    return timing


if __name__ == "__main__":
    main()
