"""The kernel section of jaxinfer/bench/suites/moe.py: the routed experts' whole MLP (gate, up, down) in
one device call, per model shape and phase, our grouped-matmul kernel beside `ragged_dot` and the
padded einsum (and with `fp8`, the e4m3 experts), against ceilings measured in the same run.
BENCH_TINY_SHAPES=1 (a CPU smoke run): tiny shapes under the same names, the XLA paths and the
routed layer only (the Mosaic kernels run in the interpreter in tests/, not timed here)."""

from __future__ import annotations

import dataclasses
import os
import time

TINY = os.environ.get("BENCH_TINY_SHAPES") == "1"
SHAPES = {  # experts, hidden, expert intermediate, top-k
    "qwen3_30b_a3b": (8, 128, 128, 2) if TINY else (128, 2048, 768, 8),
    "mixtral_8x7b": (4, 128, 256, 2) if TINY else (8, 4096, 14336, 2),
}
PHASE_TOKENS = {"decode": 8, "prefill": 64} if TINY else {"decode": 64, "prefill": 2048}
# Tilings timed per phase beside `mosaic` (what `moe_experts` runs: `mosaic_configs`' pair):
# (gate/up fused, down) candidates as `grouped_matmul.config_from_fields` reads them.
SWEEP = {
    "decode": ([(64, 128, 64, 4)], [(64, 128, 64, 6)]),
    "prefill": ([(64, 128, 64, 4), (128, 128, 64, 3, "m")],
                [(128, 128, 64, 6), (128, 256, 64, 3, "m")]),
}
# mosaic_1 at prefill: the dispatched gate/up, down on 128 x 256 tiles (half the units of K = 768
# each, so half the per-unit ring fill and epilogue; docs/kernels/grouped_matmul.md).
# e4m3 tilings timed beside `fp8_mosaic`: half the bytes per panel, so deeper rings fit, and at
# prefill consumers that split N (each widens only its half of the panel).
FP8_SWEEP = {
    "decode": ([(64, 128, 64, 6, "n")], [(64, 256, 64, 6, "n")]),
    "prefill": ([(64, 256, 64, 3, "n")], [(64, 256, 64, 4, "n")]),
}


def config_fields(config) -> tuple:
    """The inverse of `grouped_matmul.config_from_fields` (num_ctas left at its default)."""
    return dataclasses.astuple(config)[:5 if hasattr(config, "split") else 4]


def computed_rows(group_sizes, rows: int, config) -> int:
    """Rows a kernel call's wgmmas compute (real and past a group's end) for `group_sizes` over
    `rows` rows of x under `config`: per used tile of `tile_table`, block_m rows, or with split
    "m" block_m / 2 per consumer half holding rows of the tile (the other half skips its wgmma)."""
    import jax
    import numpy as np

    from pallas_kernels.moe.grouped_matmul_mosaic import padded_rows, tile_table

    t = np.asarray(jax.jit(tile_table, static_argnums=(1, 2))(
        group_sizes, padded_rows(rows, config.block_m), config.block_m))
    used = t[t[:, 3] > 0]
    if getattr(config, "split", None) != "m":
        return int(len(used) * config.block_m)
    first = used[:, 1] - used[:, 2] * 8  # the tile's first row in its window
    last = first + used[:, 3]
    half = config.block_m // 2
    return int(half * (np.sum(first < half) + np.sum(last > half)))


def routed_case(experts, hidden, inter, top_k, tokens, seed=0):
    """x sorted by expert, weights, group sizes, and the unsorted layer input (x, chosen experts,
    routing weights): routing is top-k of a random router's softmax."""
    import jax
    import jax.numpy as jnp

    keys = jax.random.split(jax.random.key(seed), 5)
    x = jax.random.normal(keys[0], (tokens, hidden), jnp.bfloat16)
    router = jax.random.normal(keys[1], (hidden, experts), jnp.float32)
    probs, chosen = jax.lax.top_k(jax.nn.softmax(x.astype(jnp.float32) @ router), top_k)
    flat = chosen.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    xs = x[order // top_k]
    sizes = jnp.bincount(flat, length=experts).astype(jnp.int32)
    std = hidden ** -0.5
    ws = tuple((jax.random.normal(k, s, jnp.float32) * std).astype(jnp.bfloat16)
               for k, s in zip(keys[2:], [(experts, hidden, inter), (experts, hidden, inter),
                                          (experts, inter, hidden)]))
    return xs, ws, sizes, (x, chosen, probs / probs.sum(-1, keepdims=True))


def fp8_case(ws, tokens: int, phase: str, sweep: bool, baselines) -> tuple:
    """The experts `ws` quantized as `--quantization fp8` stores them: (stacks, scales, float32
    reference inputs, calls: name -> f(x, stacks, scales, sizes), tilings)."""
    import jax
    import jax.numpy as jnp

    from jaxinfer.model.quant.ops import dequantize, quantize
    from pallas_kernels.moe import grouped_matmul as gm

    qs = [quantize(w, "fp8", axis=-2) for w in ws]
    wq, sq = tuple(q for q, _ in qs), tuple(s for _, s in qs)
    deq = tuple(dequantize(q, s, axis=-2) for q, s in qs)

    def pair(up, down):
        def f(x, ws, ss, sizes):
            h = gm.gmm(x.astype(jnp.float16), ws[:2], sizes, gm.config_from_fields(up), scales=ss[:2])
            return gm.gmm(h, ws[2:], sizes, gm.config_from_fields(down), scales=ss[2:], out_dtype=x.dtype)
        return jax.jit(f)

    def impl_call(impl):
        return jax.jit(lambda x, ws, ss, sizes: gm.moe_experts(
            x, ws, sizes, impl=impl, max_group_size=tokens, scales=ss))

    ups, downs = FP8_SWEEP[phase] if sweep else ((), ())
    tilings = {f"fp8_mosaic_{i}": p for i, p in enumerate(zip(ups, downs))}
    calls = {f"fp8_{impl}": impl_call(impl) for impl in ("mosaic", *baselines)}
    calls.update({name: pair(*p) for name, p in tilings.items()})
    return wq, sq, deq, calls, tilings


def kernel_section(deadline: float, models=tuple(SHAPES), sweep: bool = True,
                   phases=tuple(PHASE_TOKENS), baselines=("ragged", "padded"),
                   fp8: bool = False, fp8_sweep: bool = True, save=lambda res: None) -> dict:
    import functools

    import jax
    import jax.numpy as jnp

    from jaxinfer.bench import anchors
    from jaxinfer.bench.kernel_prefill import bench_interleaved, rel_err
    from jaxinfer.model.experts import routed_experts
    from pallas_kernels.moe import grouped_matmul as gm

    start = time.perf_counter()
    res: dict = {}
    rates = anchors.measure()  # the best plain read and bf16 matmul of this run, named
    res.update(hbm_read_tbps=rates["read_tbps"], read_kernel=rates["read_kernel"],
               matmul_tfs=rates["matmul_tflops"], matmul_shape=rates["matmul_shape"])
    if TINY:
        sweep, fp8_sweep = False, False
    print(f"ceilings: HBM read {res['hbm_read_tbps']:.2f} TB/s ({res['read_kernel']}), bf16 "
          f"matmul {res['matmul_tfs']:.0f} TF/s ({res['matmul_shape']})", flush=True)
    save(res)

    def time_parts(xs, ws, sizes, up, down):
        h = gm.gmm(xs, ws[:2], sizes, gm.config_from_fields(up))
        parts = bench_interleaved({
            "up": (functools.partial(gm.gmm, config=gm.config_from_fields(up)), (xs, ws[:2], sizes)),
            "down": (functools.partial(gm.gmm, config=gm.config_from_fields(down)), (h, ws[2:], sizes))},
            reps=3, inner=10)
        return {k: round(v * 1e6, 1) for k, v in parts.items()}

    def time_fp8_parts(xs, wq, sq, sizes, up, down):
        x16 = xs.astype(jnp.float16)
        up_f = functools.partial(gm.gmm, config=gm.config_from_fields(up), scales=sq[:2])
        down_f = functools.partial(gm.gmm, config=gm.config_from_fields(down), scales=sq[2:],
                                   out_dtype=xs.dtype)
        h = up_f(x16, wq[:2], sizes)
        parts = bench_interleaved({"up": (up_f, (x16, wq[:2], sizes)),
                                   "down": (down_f, (h, wq[2:], sizes))}, reps=3, inner=10)
        return {k: round(v * 1e6, 1) for k, v in parts.items()}

    def mosaic_pair(up, down):
        def f(x, ws, sizes):
            h = gm.gmm(x, ws[:2], sizes, gm.config_from_fields(up))
            return gm.gmm(h, ws[2:], sizes, gm.config_from_fields(down))
        return jax.jit(f)

    for model in models:
        e, hidden, inter, k = SHAPES[model]
        for phase in phases:
            tokens = PHASE_TOKENS[phase]
            if time.perf_counter() - start > deadline:
                res[f"{model}_{phase}"] = "skipped: deadline"
                continue
            xs, ws, sizes, layer_in = routed_case(e, hidden, inter, k, tokens)
            rows = xs.shape[0]
            touched = int(jnp.sum(sizes > 0))
            nbytes = touched * 3 * hidden * inter * 2
            flops = 2 * rows * hidden * inter * 3
            ref = jax.jit(functools.partial(gm.moe_experts, impl="ragged"))(
                xs.astype(jnp.float32), tuple(w.astype(jnp.float32) for w in ws), sizes)
            ups, downs = SWEEP[phase] if sweep else ((), ())
            dispatched = gm.mosaic_configs(rows, e)
            pairs = {} if TINY else {"mosaic": tuple(config_fields(c) for c in dispatched)}
            pairs.update({f"mosaic_{i}": p for i, p in enumerate(zip(ups, downs))})
            calls = {impl: (jax.jit(functools.partial(gm.moe_experts, impl=impl,
                                                      max_group_size=tokens)), (xs, ws, sizes))
                     for impl in baselines}
            calls.update({name: (mosaic_pair(*p), (xs, ws, sizes)) for name, p in pairs.items()})
            row: dict = {"rows": rows, "touched_experts": touched, "weight_bytes": nbytes,
                         "flops": flops, "errors": {}, "us": {}, "configs": pairs,
                         # real rows over the rows the dispatched tilings' wgmmas compute
                         "real_row_frac": {name: round(rows / computed_rows(sizes, rows, c), 3)
                                           for name, c in zip(("up", "down"), dispatched)}}
            refs = {name: ref for name in calls}
            if fp8:
                wq, sq, deq, f8_calls, f8_tilings = fp8_case(ws, tokens, phase, fp8_sweep, baselines)
                if TINY:  # the XLA paths on e4m3 stacks only
                    f8_calls.pop("fp8_mosaic")
                ref8 = jax.jit(functools.partial(gm.moe_experts, impl="ragged"))(
                    xs.astype(jnp.float32), deq, sizes)
                del deq
                calls.update({n: (f, (xs, wq, sq, sizes)) for n, f in f8_calls.items()})
                refs.update({n: ref8 for n in f8_calls})
                row["fp8_configs"] = f8_tilings
                row["fp8_weight_bytes"] = nbytes // 2
            ok = {}
            for name, (f, args) in calls.items():
                try:
                    row["errors"][name] = rel_err(f(*args), refs[name])
                    ok[name] = (f, args)
                except Exception as exc:  # a tiling that does not compile is a result, not a crash
                    row["errors"][name] = f"{type(exc).__name__}: {str(exc)[:300]}"
            # The whole routed layer as the model runs it (sort, gather, the dispatched experts,
            # back to token order, weighted sum): its time past the experts' is routing overhead.
            ok["layer"] = (jax.jit(lambda x, c, p, ws: routed_experts(x, c, p, ws)),
                           (*layer_in, ws))
            times = bench_interleaved(ok, reps=2 if TINY else 5, inner=2 if TINY else 10)
            for name, (up, down) in pairs.items():  # each kernel alone: where the time goes
                if name in ok:
                    row.setdefault("parts_us", {})[name] = time_parts(xs, ws, sizes, up, down)
            if fp8 and "fp8_mosaic" in ok:
                up, down = (config_fields(c) for c in gm.mosaic_configs(rows, e))
                row.setdefault("parts_us", {})["fp8_mosaic"] = time_fp8_parts(
                    xs, wq, sq, sizes, up, down)
            for name, t in times.items():
                row["us"][name] = round(t * 1e6, 1)
            row["tbps"] = {n: round((nbytes // 2 if n.startswith("fp8") else nbytes) / t / 1e12, 3)
                           for n, t in times.items()}
            row["tfs"] = {n: round(flops / t / 1e12, 1) for n, t in times.items()}
            res[f"{model}_{phase}"] = row
            for key, pick in (("ours", "mosaic" if "mosaic" in times else None),
                              ("best", min((n for n in times if n.startswith("mosaic")),
                                           key=times.get, default=None))):
                if pick:
                    frac = (nbytes / times[pick] / 1e12 / res["hbm_read_tbps"] if phase == "decode"
                            else flops / times[pick] / 1e12 / res["matmul_tfs"])
                    res[f"{model}_{phase}_{key}"] = {"name": pick, "frac": round(frac, 3)}
            if "fp8_mosaic" in times:
                t8 = times["fp8_mosaic"]
                res[f"{model}_{phase}_fp8"] = {
                    "frac_of_hbm": round(nbytes / 2 / t8 / 1e12 / res["hbm_read_tbps"], 3),
                    "speedup_vs_bf16_mosaic": (round(times["mosaic"] / t8, 3)
                                               if "mosaic" in times else None)}
            print(f"{model} {phase}: rows {rows}, touched {touched}: " + ", ".join(
                f"{n} {row['us'][n]} us ({row['tbps'][n]} TB/s, {row['tfs'][n]} TF/s)"
                for n in times), flush=True)
            print(f"  errors: {row['errors']}", flush=True)
            save(res)
            del xs, ws, ref, refs, calls, ok, layer_in
            if fp8:
                del wq, sq, ref8
    return res
