"""FP8 KV cache: decode kernel speed on its bytes, kernel correctness on the device, and the demo
model's held-out perplexity and top-1 agreement with an fp8 cache against a bf16 one.

    jaxinfer bench throughput --suite quant-kv -- [--parts check,decode,prefill,ppl,checkv]
        [--fp8-variants mosaic:q1,...] [--save [DIR]] [--name NAME] [--merge RECORD.json]
    JAX_PLATFORMS=cpu BENCH_TINY_SHAPES=1 jaxinfer bench throughput --suite quant-kv -- \
        --parts check,decode,checkv --no-triton                      # CPU smoke run

- check: the Mosaic decode kernel on an fp8 cache against the jnp reference on the same fp8 pages,
  ragged lengths (GPU only); checkv: the same for `--check-variants`, last (a variant that fails
  or hangs costs nothing measured before it).
- decode: B64 x ctx 4096, Hq 32 / Hkv 8 / d 128 / page 16 (kernel_decode's shape and timing),
  bf16 and fp8 caches, each as TB/s of its own KV bytes and as a fraction of the HBM read ceiling
  (the best of `jaxinfer.bench.anchors`' plain reads over 8 GiB, named in `read_kernel`) measured in
  the same run; the fp8 variants named beside the default, e.g. "mosaic:q1" (QK^T as one fp8
  wgmma) as `decode_fp8kv_b64x4096_mosaic_q1_*`.
- prefill: the Mosaic paged prefill kernel over a bf16 and an fp8 cache (GPU only).
- ppl: the demo model (bf16 weights) over `checkpoints/heldout_sample.txt` in windows, through
  the paged cache and the jnp reference: perplexity and the share of positions whose argmax is
  the bf16 cache's, fp8 scales calibrated as the engine does (`kv_scales.calibrate_kv_scales`).
`--save` writes benchmarks/results/quant_kv_<gpu>.json (`--name` another record, `--merge` keeps a
stored record's other keys). BENCH_TINY_SHAPES=1 (CPU): batch 2 x 256 tokens at Hq 8 / Hkv 2; the
checks run the Mosaic kernel in its interpreter, the timed parts the jnp reference in its place
(the script's plumbing and keys, no speed).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.bench import anchors, results_io
from jaxinfer.bench.kernel_decode import fp8_variant_config
from jaxinfer.paths import REPO_ROOT

DEMO = REPO_ROOT / "checkpoints" / "demo-target"
TINY = os.environ.get("BENCH_TINY_SHAPES") == "1"
BATCH, CTX = (2, 256) if TINY else (64, 4096)
HQ, HKV = (8, 2) if TINY else (32, 8)


def paged_logits_fn(cfg, kernels, kv_dtype, block_size: int = 16, compiler_options=None):
    """jit fn(params, tokens[B, L]) -> float32 logits [B, L, V]: every row is one sequence
    prefilled in one step through a fresh paged cache of `kv_dtype` and `kernels` (the engine's
    path: write_kv, then attention over the cache), compiled with XLA's `compiler_options`."""
    from jaxinfer.worker.kv import allocate_kv_cache
    from jaxinfer.model.transformer import forward
    from pallas_kernels.attention.metadata import AttentionMetadata

    @functools.partial(jax.jit, compiler_options=compiler_options)
    def logits(params, tokens):
        b, length = tokens.shape
        per_seq = -(-length // block_size)
        cache = allocate_kv_cache(cfg, b * per_seq, block_size, kv_dtype)
        tables = jnp.arange(b * per_seq, dtype=jnp.int32).reshape(b, per_seq)
        pos = jnp.tile(jnp.arange(length, dtype=jnp.int32), b)
        slots = (tables[:, :, None] * block_size + jnp.arange(block_size)).reshape(b, -1)
        md = AttentionMetadata(slots[:, :length].reshape(-1),
                               jnp.arange(b + 1, dtype=jnp.int32) * length,
                               jnp.full((b,), length, jnp.int32), tables)
        out, _ = forward(params, cfg, tokens.reshape(-1), pos, cache, md, kernels)
        return out.reshape(b, length, -1)

    return logits


def demo_windows(tokenizer, length: int) -> np.ndarray:
    ids = np.asarray(tokenizer.encode((REPO_ROOT / "checkpoints" / "heldout_sample.txt").read_text()))
    n = (len(ids) - 1) // length
    return ids[: n * length + 1][np.arange(n)[:, None] * length + np.arange(length + 1)]


def demo_ppl(length: int = 256, compiler_options=None) -> dict:
    """Perplexity (bf16 cache, fp8 cache) and fp8's top-1 agreement with bf16, demo model; the
    forwards compiled with XLA's `compiler_options`."""
    from jaxinfer.bench.perplexity import perplexity_and_top1
    from jaxinfer.worker.kv.kv_scales import calibrate_kv_scales, calibration_tokens
    from jaxinfer.model.config import load_config
    from jaxinfer.model.tokenizer import Tokenizer
    from jaxinfer.model.weights import load_params
    from jaxinfer.model.kernel_table import REFERENCE_KERNELS, current_platform, resolve_kernels
    from pallas_kernels.attention.kv_quant import FP8KVAttention
    cfg = load_config(DEMO)
    params = load_params(DEMO, cfg, jnp.bfloat16, progress=False)
    tok = Tokenizer.from_dir(DEMO)
    windows = demo_windows(tok, length)
    k, v = calibrate_kv_scales(cfg, params, calibration_tokens(tok, cfg.vocab_size, 512))
    def fp8(kernels):
        return dataclasses.replace(kernels, attention=FP8KVAttention(kernels.attention, k, v))

    fns = {"bf16": paged_logits_fn(cfg, REFERENCE_KERNELS, jnp.bfloat16,
                                   compiler_options=compiler_options),
           "fp8kv": paged_logits_fn(cfg, fp8(REFERENCE_KERNELS), jnp.float8_e4m3fn,
                                    compiler_options=compiler_options)}
    if current_platform().gpu:  # the same through the Mosaic kernels (prefill + decode)
        fns["fp8kv_mosaic"] = paged_logits_fn(
            cfg, fp8(resolve_kernels(current_platform(), attention="mosaic")), jnp.float8_e4m3fn)
    out, top = {}, {}
    for name, fn in fns.items():
        out[f"demo_ppl_{name}"], top[name] = perplexity_and_top1(fn, params, windows)
    for name in fns:
        if name != "bf16":
            out[f"demo_top1_agreement_{name}"] = float((top["bf16"] == top[name]).mean())
    out["demo_positions"] = int(windows[:, 1:].size)
    out["demo_ppl_fp8kv_rel_change"] = out["demo_ppl_fp8kv"] / out["demo_ppl_bf16"] - 1
    out["demo_kv_scales"] = {"k": list(k), "v": list(v)}
    return out


# (batch, max blocks, forced splits, variant): the default kernel at the target shape and with one
# split forced at batch 7 (ragged lengths, several steps per item).
CHECKS = ((2, 6, None, "mosaic"), (3, 5, 1, "mosaic")) if TINY else (
    (64, 256, None, "mosaic"), (7, 40, 1, "mosaic"))


def check_mosaic(log, errs: dict, save, checks=CHECKS) -> None:
    """Max |Mosaic - reference| on fp8 pages (random, ragged), in units of the output's scale,
    into `errs` (saved after each)."""
    from pallas_kernels.attention.kv_quant import quantize
    from pallas_kernels.attention.paged_decode import paged_decode_mosaic
    from pallas_kernels.attention.reference import paged_decode_reference
    for batch, max_blocks, splits, variant in checks:
        rng = np.random.default_rng(batch)
        nb = batch * max_blocks + 5
        q = jnp.asarray(rng.standard_normal((batch, HQ, 128)), jnp.bfloat16)
        k8 = quantize(jnp.asarray(rng.standard_normal((HKV, nb, 16, 128)), jnp.float32), 0.25)
        v8 = quantize(jnp.asarray(rng.standard_normal((HKV, nb, 16, 128)), jnp.float32), 0.25)
        bt = jnp.asarray(rng.permutation(nb)[: batch * max_blocks].reshape(batch, max_blocks),
                         jnp.int32)
        lens = jnp.asarray(rng.integers(0, max_blocks * 16 + 1, batch), jnp.int32).at[0].set(1)
        config = dataclasses.replace(fp8_variant_config(variant), num_splits=splits,
                                     **(dict(num_ctas=2, stages=2) if TINY else {}))
        out = paged_decode_mosaic(q, k8, v8, bt, lens, scale=128 ** -0.5, config=config,
                                  interpret=TINY)
        ref = paged_decode_reference(q.astype(jnp.float32), k8, v8, bt, lens, scale=128 ** -0.5)
        err = float(jnp.abs(out.astype(jnp.float32) - ref).max() / jnp.abs(ref).max())
        key = f"fp8kv_{variant.replace(':', '_')}_rel_err_b{batch}x{max_blocks * 16}"
        errs[key] = err
        log(f"check {variant} B{batch} x {max_blocks * 16} splits={splits}: rel err {err:.2e}")
        save()


# The fp8 read paths worth timing beside the default (128-token steps, V in 64-token chunks, the
# hand-over tile over the staging tiles; docs/kernels/paged_decode.md): QK^T as one fp8 wgmma,
# two context splits (twice the items: a more even tail).
FP8_VARIANTS = ("mosaic:q1", "mosaic:s2")


def summary_table(metrics: dict) -> str:
    """The decode figures as a table (the last thing printed)."""
    rows = [f"{'kernel':<44} {'us':>8} {'TB/s':>6} {'of HBM':>7}"]
    for key in sorted(k for k in metrics if k.startswith("decode_") and k.endswith("_us")):
        stem = key[:-3]
        rows.append(f"{stem[len('decode_'):]:<44} {metrics[key]:8.1f} "
                    f"{metrics[stem + '_tbps']:6.2f} {metrics[stem + '_frac_of_hbm']:7.1%}")
    rows += [f"{k}: {v}" for k, v in metrics.items() if k.endswith("_error")]
    rows += [f"{k}: {v:.2e}" for k, v in metrics.items() if "_rel_err_" in k]
    return "\n".join(rows)


def decode_speed(log, out: dict, save, fp8_variants=(), triton: bool = True,
                 page32: bool = False) -> None:
    """Fills `out` (saving after every figure: a job cut short keeps what it measured): the
    production kernel on bf16 and fp8 caches, the fp8 variants named (`fp8_variant_config`), and
    the Triton kernel on both."""
    from jaxinfer.bench.kernel_decode import D, make_paged_case, tbps, time_paged
    from pallas_kernels.attention.kv_quant import quantize
    from pallas_kernels.attention.paged_decode import paged_decode_mosaic, paged_decode_triton_configured
    from pallas_kernels.attention.reference import paged_decode_reference
    rates = anchors.measure()  # warms the clocks up first on a GPU
    ceiling = rates["read_tbps"]
    log(f"read ceiling {ceiling:.2f} TB/s ({rates['read_kernel']})")
    out.update(hbm_read_tbps=ceiling, read_kernel=rates["read_kernel"],
               read_tbps_by_kernel=rates["read_tbps_by_kernel"])
    case = make_paged_case(BATCH, CTX, hq=HQ, hkv=HKV, **(dict(chain=1) if TINY else {}))
    scale = D ** -0.5

    def kernel(config=None):  # TINY: the reference stands in for every kernel (no speed)
        if TINY:
            return functools.partial(paged_decode_reference, scale=scale)
        return functools.partial(paged_decode_mosaic, scale=scale,
                                 **({} if config is None else dict(config=config)))
    mosaic = kernel()
    shape = f"b{BATCH}x{CTX}"
    cases = {"bf16": case, "fp8kv": dict(case, k=quantize(case["k"], 1.0),
                                         v=quantize(case["v"], 1.0), kv_bytes=case["kv_bytes"] // 2)}
    runs = [("mosaic", mosaic, "bf16"), ("mosaic", mosaic, "fp8kv")]
    runs += [(name.replace(":", "_"), kernel(fp8_variant_config(name)), "fp8kv")
             for name in fp8_variants]
    if triton:
        fn = functools.partial(paged_decode_triton_configured, scale=scale)
        runs += [("triton", fn, "bf16"), ("triton", fn, "fp8kv")]
    if page32:  # diagnostic: 32-token pages, each TMA copy as many bytes as a bf16 page of 16
        c32 = make_paged_case(BATCH, CTX, page=32, hq=HQ, hkv=HKV)
        cases["fp8kv_page32"] = dict(c32, k=quantize(c32["k"], 1.0), v=quantize(c32["v"], 1.0),
                                     kv_bytes=c32["kv_bytes"] // 2)
        del c32
        runs.append(("mosaic", mosaic, "fp8kv_page32"))
    for name, fn, kind in runs:
        case = cases[kind]
        try:
            t = time_paged(fn, case)
        except Exception as e:  # reported, not fatal
            out[f"decode_{kind}_{shape}_{name}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
            log(f"{kind} {name}: {out[f'decode_{kind}_{shape}_{name}_error']}")
            continue
        key = f"decode_{kind}_{shape}" + ("" if name == "mosaic" else f"_{name}")
        out[key + "_us"] = t * 1e6
        out[key + "_tbps"] = tbps(case["kv_bytes"], t)
        out[key + "_frac_of_hbm"] = out[key + "_tbps"] / ceiling
        log(f"{kind} {name}: {t * 1e6:.1f} us, {out[key + '_tbps']:.2f} TB/s "
            f"({out[key + '_frac_of_hbm']:.1%} of the ceiling)")
        save()
    if f"decode_fp8kv_{shape}_us" in out and f"decode_bf16_{shape}_us" in out:
        out[f"decode_fp8kv_{shape}_speedup_vs_bf16"] = (out[f"decode_bf16_{shape}_us"]
                                                        / out[f"decode_fp8kv_{shape}_us"])


def prefill_speed(log) -> dict:
    """The paged prefill kernel over a bf16 and an fp8 cache: 8 sequences x 512 new tokens over
    8192 cached, page 16 (kernel_prefill's paged shape), timed interleaved."""
    from jaxinfer.bench.kernel_prefill import HKV, HQ, D, bench_interleaved
    from pallas_kernels.attention import flash_prefill as fp
    from pallas_kernels.attention.kv_quant import quantize
    from pallas_kernels.common.testing import random_paged_batch
    s, new, cached = 8, 512, 8192
    q, k, v, *rest = random_paged_batch(np.random.default_rng(3), hq=HQ, hkv=HKV, d=D,
                                        block_size=16, q_lens=[new] * s, prefixes=[cached] * s)
    fn = jax.jit(functools.partial(fp.flash_prefill_mosaic, scale=D ** -0.5))
    calls = {"bf16": (fn, (q, k, v, *rest)), "fp8kv": (fn, (q, quantize(k, 1.0), quantize(v, 1.0),
                                                            *rest))}
    flops = 4 * D * HQ * s * (new * cached + new * (new + 1) / 2)
    out = {}
    for kind, t in bench_interleaved(calls).items():
        out[f"prefill_{kind}_s8_new512_cached8192_ms"] = t * 1e3
        out[f"prefill_{kind}_s8_new512_cached8192_tflops"] = flops / t / 1e12
        log(f"prefill {kind}: {t * 1e3:.3f} ms, {flops / t / 1e12:.0f} TFLOP/s")
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default="check,decode,prefill,ppl,checkv")
    ap.add_argument("--ppl-window", type=int, default=256)
    ap.add_argument("--fp8-variants", default=",".join(FP8_VARIANTS),
                    help="comma list of fp8 decode kernel variants to time beside the default "
                         "(`fp8_variant_config` names)")
    ap.add_argument("--no-triton", action="store_true", help="skip the Triton decode kernel")
    ap.add_argument("--check-variants", default=",".join(FP8_VARIANTS),
                    help="comma list of variants the 'checkv' part checks at the CHECKS shapes")
    ap.add_argument("--page32", action="store_true",
                    help="also time the default fp8 kernel on 32-token pages (diagnostic)")
    results_io.add_save_arg(ap, "quant_kv_<gpu>")
    results_io.add_merge_arg(ap)
    args = ap.parse_args(argv)
    if TINY:  # before the backend starts: Mosaic GPU's interpreter (the checks) deadlocks under
        # XLA CPU's concurrency-optimized scheduler (tests/conftest.py says how)
        os.environ["XLA_FLAGS"] = " ".join(filter(None, [
            os.environ.get("XLA_FLAGS"), "--xla_cpu_enable_concurrency_optimized_scheduler=false"]))
    parts = args.parts.split(",")
    metrics: dict = {}
    name = args.name or f"quant_kv_{results_io.device_slug()}"

    def save():
        if args.save:
            results_io.save(args.save, name, metrics=metrics, merge=args.merge,
                            config=dict(batch=BATCH, ctx=CTX, hq=HQ, hkv=HKV, d=128, page=16,
                                        kv_dtype="float8_e4m3fn", parts=parts, tiny=TINY,
                                        ppl_window=args.ppl_window, jax=jax.__version__))

    log = functools.partial(print, flush=True)
    for part in parts:  # in the order given (a job cut short keeps the first ones)
        if part == "check":
            check_mosaic(log, metrics, save)
        elif part == "checkv":  # the variants' checks, after everything else
            check_mosaic(log, metrics, save, [(b, mb, sp, v) for v in args.check_variants.split(",")
                                              if v for b, mb, sp, _ in CHECKS])
        elif part == "decode":
            decode_speed(log, metrics, save, [v for v in args.fp8_variants.split(",") if v],
                         not args.no_triton, args.page32)
        elif part == "ppl":
            metrics.update(demo_ppl(args.ppl_window))
            log({k: v for k, v in metrics.items() if k.startswith("demo")})
        elif part == "prefill":
            metrics.update(prefill_speed(log))
        else:
            raise SystemExit(f"unknown part {part!r} in --parts")
        save()
    log(summary_table(metrics))


if __name__ == "__main__":
    main()
