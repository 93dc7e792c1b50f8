"""Paged decode attention on the GPU: our kernels beside jax's bundled Pallas `paged_attention`, XLA
on a gathered contiguous cache, and the HBM read ceiling measured in the same run.

    python -m jaxinfer.bench.kernel_decode [--batches 1,8,64,256] [--contexts 512,4096,32768]
                                       [--shapes BxCTX,...] [--variants mosaic,triton] [--save [DIR]]

Figure of merit: TB/s of KV read = (K + V bytes of every sequence's context) / kernel time, and its
share of the read ceiling (a sum over 8 GiB of bf16, measured here). Timing: CHAIN calls inside one
jit (no host round trip between them), that jit queued many times, the median per call over several
repetitions. When one call's KV bytes fit in L2, successive calls cycle through disjoint page sets
(256 MiB in all, or MAX_SETS sets: 134 MB at batch 1 x 512), so no call is served from the 60 MB
L2; one jit holds only CHAIN kernel instances whatever the number of sets, which keeps compile time
(and the device call) short. Shapes under SMALL_KV_BYTES chain SMALL_CHAIN = 16 calls instead: with 4,
one jit call of a few MB holds about as much GPU work as jax's dispatch costs on the host, and the
figures swing by several µs between runs. `--chain N` forces one length for every shape. Each
jit call also pays one XLA executable launch (~6 µs on the H200), a quarter of which lands in
every per-call figure of a 4-call chain; the "marginal" variant reports the Mosaic call's cost
inside a larger program instead, as the slope between chains of 2 and 6 calls (`time_marginal`);
jaxinfer/bench/profile/trace_decode.py gives the device timeline of the same chains.
`--save` writes the record paged_decode_<gpu>.json (`results_io`): per shape
`decode_b{B}x{CTX}_us`, `_tbps` and `_frac_of_hbm` for the default Mosaic kernel, every other
variant as `decode_b{B}x{CTX}_<variant>_tbps`, and the read ceiling as `hbm_read_tbps`.
`jaxinfer bench kernels` runs it (kernels.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import math
import warnings

import jax
import jax.numpy as jnp
from jax import lax

from jaxinfer.bench import anchors, results_io
from pallas_kernels.attention.paged_decode import (
                                                   MosaicDecodeConfig,
                                                   paged_decode_mosaic,
                                                   paged_decode_triton_configured,
                                                   )
from pallas_kernels.common.device_info import num_sms
from pallas_kernels.attention.paged_decode_mosaic import mosaic_decode_call

HQ, HKV, D, PAGE = 32, 8, 128, 16
L2_FLUSH_BYTES = 256 * 2**20  # read this much per measurement at least, so L2 (60 MB) can't serve it
MAX_SETS = 64
CHAIN = 4  # kernel calls chained inside one jit
SMALL_CHAIN, SMALL_KV_BYTES = 16, 64e6  # ... and for shapes whose KV is under 64 MB
FORCED_CHAIN = None  # --chain
MARGINAL_CHAINS = (2, 6)  # chain lengths whose difference gives the per-call time in a program


def warm_up_gpu(seconds: float = 1.5) -> None:
    anchors.warm_up(seconds)


def read_ceiling_tbps(nbytes: int = 8 * 1024**3) -> float:
    """HBM read bandwidth: the best of benchmarks.anchors' plain read kernels over `nbytes` of
    bf16, queued back to back. (`nbytes`: smaller, for a CPU smoke run.)"""
    return max(anchors.read_rates(nbytes).values()) / 1e12


def tbps(nbytes: float, seconds: float) -> float:
    return nbytes / seconds / 1e12


_queued_time = anchors.queued_time


def make_paged_case(batch: int, ctx: int, *, seed: int = 0, hq=HQ, hkv=HKV, d=D, page=PAGE,
                    chain: int | None = None):
    """q, K/V pools and `sets` block tables over disjoint shuffled page sets: enough sets that one
    timed jit call reads >= L2_FLUSH_BYTES, and at least 4 where memory allows (distinct calls);
    all sequences hold exactly `ctx` tokens. `chain` overrides the chain length."""
    pages = ctx // page
    kv_bytes = 2 * batch * ctx * hkv * d * 2
    chain = chain or FORCED_CHAIN or (SMALL_CHAIN if kv_bytes < SMALL_KV_BYTES else CHAIN)
    sets = int(min(MAX_SETS, max(1, math.ceil(L2_FLUSH_BYTES / kv_bytes))))
    if kv_bytes * chain <= 20e9:
        sets = max(sets, chain)
    if sets > chain:
        sets = -(-sets // chain) * chain  # whole groups of chain
    num_blocks = sets * batch * pages
    ks = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(ks[0], (batch, hq, d), jnp.bfloat16)
    k = jax.random.normal(ks[1], (hkv, num_blocks, page, d), jnp.bfloat16)
    v = jax.random.normal(ks[2], (hkv, num_blocks, page, d), jnp.bfloat16)
    bts = jax.random.permutation(ks[3], num_blocks).astype(jnp.int32).reshape(sets, batch, pages)
    lens = jnp.full((batch,), ctx, jnp.int32)
    return dict(q=q, k=k, v=v, bts=bts, lens=lens, kv_bytes=kv_bytes, sets=sets, chain=chain)


def _set_groups(case) -> list[jax.Array]:
    """The case's page-set indices in groups of its chain length (int32[chain] each): one group
    per jit call, so successive calls read successive groups."""
    sets, chain = case["sets"], case["chain"]
    idx = [i % sets for i in range(max(sets, chain))]
    return [jnp.asarray(idx[i:i + chain], jnp.int32) for i in range(0, len(idx), chain)]


def _table_groups(case) -> itertools.cycle:
    """The case's block tables in groups of its chain length ([chain, B, pages] each), cycled."""
    return itertools.cycle([case["bts"][g] for g in _set_groups(case)])


def chained_calls(fn, case):
    """q -> q after the case's chain of fn(q, k, v, block_table, lens) calls in one jit, each on
    its own page set where there are several (the next group of tables at every use), each call's
    q being the previous call's output: no call can be merged with another or skipped, and the
    output stays a realistic attention output."""
    chain = case["chain"]

    @jax.jit
    def many(q, k, v, bts, lens):
        for i in range(chain):
            q = fn(q, k, v, bts[i], lens).astype(q.dtype)
        return q

    k, v, lens, groups = case["k"], case["v"], case["lens"], _table_groups(case)
    return lambda q: many(q, k, v, next(groups), lens)


def time_paged(fn, case) -> float:
    """Seconds per call of fn(q, k, v, block_table, lens), chained (`chained_calls`) and queued."""
    return _queued_time(chained_calls(fn, case), case["q"]) / case["chain"]


def time_marginal(fn, batch: int, ctx: int, chains=MARGINAL_CHAINS) -> float:
    """Seconds one more chained call of fn adds to a jit call: (T(hi) - T(lo)) / (hi - lo), with
    T(n) the seconds per jit call of a chain of n calls (`time_paged` on a case of that chain).
    The XLA executable launch that every jit call pays once (~6 us on the H200, a quarter of it in
    each per-call figure of a 4-call chain) cancels out: this is what a call costs inside a larger
    jitted program, such as an engine step with one attention call per layer."""
    lo, hi = chains
    t = {}
    for n in chains:
        case = make_paged_case(batch, ctx, chain=n)
        t[n] = time_paged(fn, case) * n
        del case
    return (t[hi] - t[lo]) / (hi - lo)


def time_read_same_size(case) -> float:
    """The anchor for a shape's ceiling at its own size: seconds per call of a plain read of the
    case's KV bytes (a bf16 sum, like `read_ceiling_tbps`), chained and cycled over distinct
    buffers exactly as the attention calls are (`chained_calls`). It carries the same per-call
    launch, first round trip and tail as any one-kernel read of that many bytes, which the 8 GiB
    ceiling amortises away."""
    chain, n = case["chain"], case["kv_bytes"] // 2
    xs = jax.random.normal(jax.random.key(3), (case["sets"], n), jnp.bfloat16)

    @jax.jit
    def many(s, xs, idx):
        for i in range(chain):
            # Each sum depends on the one before (a scalar factor of 1 that XLA cannot fold), so
            # the chain's reads stay separate kernels in order, as chained attention calls are.
            x = lax.dynamic_index_in_dim(xs, idx[i], keepdims=False)
            s = jnp.sum(x * (s * 0 + 1).astype(x.dtype), dtype=jnp.float32)
        return s

    groups = itertools.cycle(_set_groups(case))
    return _queued_time(lambda s: many(s, xs, next(groups)), jnp.float32(1)) / chain


def time_mosaic_kernel_only(case, scale: float) -> float:
    """The Mosaic kernel without the XLA work around it (the split combine, when there are several
    splits): the case's chain of independent calls per jit on distinct page sets (none can be
    merged), queued.
    Not chained, so back-to-back kernels may overlap their launch: a lower bound."""
    fn = functools.partial(mosaic_decode_call, scale=scale)
    chain = case["chain"]

    @jax.jit
    def many(q, k, v, bts, lens):
        return [fn(q, k, v, bts[i], lens)[0] for i in range(chain)]

    q, k, v, lens, groups = case["q"], case["k"], case["v"], case["lens"], _table_groups(case)
    return _queued_time(lambda _: many(q, k, v, next(groups), lens), None) / chain


def mosaic_config(name: str) -> MosaicDecodeConfig:
    """A variant name's Mosaic config: "mosaic" is the default, and ":"-separated options change
    it: "s<N>" forces N context splits, "la<N>" reads block ids N steps ahead, "pdl" / "nopdl"
    turn programmatic dependent launch on / off, "t<N>" takes N tokens per step, "xlac" merges
    splits in XLA instead of the combine kernel; e.g. "mosaic:s1:pdl"."""
    fields = {}
    for opt in name.split(":")[1:]:
        for prefix, field in (("s", "num_splits"), ("la", "bt_lookahead"),
                              ("t", "tokens_per_step")):
            if opt.startswith(prefix) and opt[len(prefix):].isdigit():
                fields[field] = int(opt[len(prefix):])
                break
        else:
            if opt == "xlac":
                fields["combine_kernel"] = False
            elif opt in ("pdl", "nopdl"):
                fields["pdl"] = opt == "pdl"
            else:
                raise ValueError(f"unknown option {opt!r} in variant {name!r}")
    return dataclasses.replace(MosaicDecodeConfig(), **fields)


def our_variants(scale: float, names=()) -> dict:
    """name -> fn(q, k, v, bt, lens) for the kernels of this repo in their benchmarked configs,
    plus the Mosaic variants named in `names` (see `mosaic_config`)."""
    out = {"mosaic": functools.partial(paged_decode_mosaic, scale=scale,
                                       config=MosaicDecodeConfig()),
           "triton": functools.partial(paged_decode_triton_configured, scale=scale)}
    for name in names:
        if name.startswith("mosaic:"):
            out[name] = functools.partial(paged_decode_mosaic, scale=scale,
                                          config=mosaic_config(name))
    return out


def bundled_variants(scale: float) -> dict:
    """jax's bundled Triton-lowered paged_attention (deprecated) at a few block settings."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from jax.experimental.pallas.ops.gpu import paged_attention as pa
    out = {}
    # The probe's three settings; (16, 16, 8) was never the fastest on the H200 (2026-11-29).
    for bh, ppcb, ksp in [(16, 8, 16), (16, 4, 32)]:
        f = functools.partial(pa.paged_attention, block_h=bh, pages_per_compute_block=ppcb,
                              k_splits=ksp)
        out[f"bundled_p{ppcb}_k{ksp}"] = (lambda f: lambda q, k, v, bt, lens: f(
            (q * scale).astype(q.dtype), k, v, bt, lens))(f)
    return out


def time_xla_contiguous(case, scale: float) -> float:
    """XLA attention on the same context already gathered into contiguous [S, L, Hkv, D] arrays
    (the probe's anchor), chained and queued like `time_paged`."""
    sets = min(case["sets"], 8)
    hkv, _, page, d = case["k"].shape
    ks, vs = [], []
    for i in range(sets):
        bt = case["bts"][i]
        ks.append(case["k"][:, bt].reshape(hkv, bt.shape[0], -1, d).transpose(1, 2, 0, 3))
        vs.append(case["v"][:, bt].reshape(hkv, bt.shape[0], -1, d).transpose(1, 2, 0, 3))
    ks, vs = jnp.stack(ks), jnp.stack(vs)
    r = max(sets, 4)

    @jax.jit
    def many(q, ks, vs):
        for i in range(r):
            q = jax.nn.dot_product_attention(q[:, None], ks[i % sets], vs[i % sets], scale=scale,
                                             implementation="xla")[:, 0]
        return q

    t = _queued_time(lambda q, ks=ks, vs=vs: many(q, ks, vs), case["q"]) / r
    del ks, vs
    return t


def run_grid(batches, contexts, variants=("mosaic", "triton", "bundled", "xla"), log=print,
             on_row=None, shapes=None) -> dict:
    """Time every (batch, context) shape (or the (batch, context) pairs of `shapes`, in that
    order); returns a JSON-able dict with the ceiling and rows.
    The ceiling is measured before and after the grid; rows use the higher of the two.
    `on_row(result)` is called after each shape (e.g. to save partial results)."""
    scale = D ** -0.5
    warm_up_gpu()
    ceiling = read_ceiling_tbps()
    log(f"read ceiling {ceiling:.2f} TB/s")
    result = {"jax": jax.__version__, "device": str(jax.devices()[0]), "read_ceiling_TBps": ceiling,
              "shape": dict(hq=HQ, hkv=HKV, d=D, page=PAGE, dtype="bfloat16"), "rows": []}
    # A variant runs if its name or its family (the part before "_") is listed.
    fns = {n: f for n, f in {**our_variants(scale, variants), **bundled_variants(scale)}.items()
           if n in variants or n.split("_")[0] in variants}
    for batch, ctx in shapes or [(b, c) for b in batches for c in contexts]:
        kv_gb = 2 * batch * ctx * HKV * D * 2 / 1e9
        if kv_gb > 40:
            log(f"skip B{batch} ctx{ctx}: {kv_gb:.0f} GB of KV")
            continue
        case = make_paged_case(batch, ctx)
        row = {"batch": batch, "ctx": ctx, "kv_bytes": case["kv_bytes"], "sets": case["sets"],
               "kernels": {}}
        timers = {name: functools.partial(time_paged, fn, case) for name, fn in fns.items()}
        # The kernel alone differs from the whole call only where the plan splits contexts
        # (batch x kv heads below one item per SM): there the split-combine kernel follows it.
        if "diag" in variants and batch * HKV < num_sms():
            timers["mosaic_kernel_only"] = functools.partial(time_mosaic_kernel_only, case,
                                                             scale)
        if "marginal" in variants and case["kv_bytes"] * MARGINAL_CHAINS[1] <= 20e9:
            timers["mosaic_marginal"] = functools.partial(time_marginal, our_variants(scale)["mosaic"],
                                                          batch, ctx)
        if "read" in variants:
            timers["read_same_size"] = functools.partial(time_read_same_size, case)
        if "xla" in variants and kv_gb <= 8:
            timers["xla_contiguous"] = functools.partial(time_xla_contiguous, case, scale)
        for name, timer in timers.items():
            try:
                t = timer()
                row["kernels"][name] = {"us": t * 1e6, "TBps": tbps(case["kv_bytes"], t)}
            except Exception as e:  # a variant that fails at a shape is reported, not fatal
                row["kernels"][name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        for rec in row["kernels"].values():
            if "TBps" in rec:
                rec["pct_ceiling"] = 100 * rec["TBps"] / ceiling
        result["rows"].append(row)
        log(format_row(row))
        del case
        if on_row:
            on_row(result)
    after = read_ceiling_tbps()
    log(f"read ceiling after the grid {after:.2f} TB/s")
    result["read_ceiling_after_TBps"] = after
    if after > ceiling:
        result["read_ceiling_TBps"] = ceiling = after
        for row in result["rows"]:
            for rec in row["kernels"].values():
                if "TBps" in rec:
                    rec["pct_ceiling"] = 100 * rec["TBps"] / ceiling
    return result


def _best(row, prefix):
    ok = [(k, r) for k, r in row["kernels"].items() if k.startswith(prefix) and "us" in r]
    return min(ok, key=lambda kr: kr[1]["us"]) if ok else (None, None)


def format_row(row) -> str:
    parts = [f"B{row['batch']:>3} ctx{row['ctx']:>5}"]
    for name, rec in row["kernels"].items():
        parts.append(f"{name} " + (f"{rec['us']:.1f}us {rec['TBps']:.2f}TB/s" if "us" in rec
                                   else "ERR"))
    return " | ".join(parts)


def table(result) -> str:
    """Markdown table: our Mosaic kernel, the best of each other family, per shape."""
    lines = ["| batch | ctx | KV MB | Mosaic µs | TB/s | % ceiling | in a program µs | % ceiling "
             "| same-size read µs | % ceiling | kernel alone µs "
             "| bundled best µs | TB/s | XLA contiguous µs | TB/s | our Triton µs | TB/s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in result["rows"]:
        ours = row["kernels"].get("mosaic")
        _, bun = _best(row, "bundled")
        _, tri = _best(row, "triton")
        xla = row["kernels"].get("xla_contiguous", {})
        f = lambda r, k, fmt: ((fmt.format(r[k]) if isinstance(r[k], float) else r[k])
                               if r and k in r else "–")
        alone = row["kernels"].get("mosaic_kernel_only")
        marginal = row["kernels"].get("mosaic_marginal")
        if marginal and marginal.get("us", 1) <= 0:  # a launch-bound shape: the slope is noise
            marginal = {"us": "noise", "pct_ceiling": "noise"}
        read = row["kernels"].get("read_same_size")
        lines.append(f"| {row['batch']} | {row['ctx']} | {row['kv_bytes'] / 1e6:.0f} | "
                     f"{f(ours, 'us', '{:.1f}')} | {f(ours, 'TBps', '{:.2f}')} | "
                     f"{f(ours, 'pct_ceiling', '{:.0f}%')} | {f(marginal, 'us', '{:.1f}')} | "
                     f"{f(marginal, 'pct_ceiling', '{:.0f}%')} | {f(read, 'us', '{:.1f}')} | "
                     f"{f(read, 'pct_ceiling', '{:.0f}%')} | {f(alone, 'us', '{:.1f}')} | "
                     f"{f(bun, 'us', '{:.1f}')} | {f(bun, 'TBps', '{:.2f}')} | "
                     f"{f(xla, 'us', '{:.1f}')} | {f(xla, 'TBps', '{:.2f}')} | "
                     f"{f(tri, 'us', '{:.1f}')} | {f(tri, 'TBps', '{:.2f}')} |")
    return "\n".join(lines)


def metrics(result) -> dict:
    """The record's flat metrics (see the module docstring)."""
    out = {"hbm_read_tbps": round(result["read_ceiling_TBps"], 3)}
    if "read_ceiling_after_TBps" in result:
        out["hbm_read_after_tbps"] = round(result["read_ceiling_after_TBps"], 3)
    for row in result["rows"]:
        key = f"decode_b{row['batch']}x{row['ctx']}"
        for name, rec in row["kernels"].items():
            if "TBps" not in rec:
                out[f"{key}_{name}_error"] = rec.get("error", "")[:200]
                continue
            prefix = key if name == "mosaic" else f"{key}_{name}"
            out[f"{prefix}_us"] = round(rec["us"], 2)
            out[f"{prefix}_tbps"] = round(rec["TBps"], 3)
            if name in ("mosaic", "read_same_size"):
                out[f"{prefix}_frac_of_hbm"] = round(rec["pct_ceiling"] / 100, 4)
    return out


def fp8_variant_config(name: str):
    """A variant name's Mosaic config: `mosaic_config`'s options over the default,
    plus the fp8 read paths (`MosaicDecodeConfig`'s fp8 fields): "up2" / "up4" / "8bit" (the
    widening layout), "st<N>" (N ring stages), "shared" / "noshared" (the hand-over tile over
    the V staging tiles), "pv<N>" (V widened and multiplied in N-token chunks), "ft<N>" (N tokens
    per step on an fp8 cache), "q1" (QK^T as one fp8 wgmma against q_hi alone); e.g.
    "mosaic:ft128:pv64:shared"."""
    ours = {"up2": dict(fp8_widen_layout="WGMMA_UPCAST_2X"),
            "up4": dict(fp8_widen_layout="WGMMA_UPCAST_4X"),
            "8bit": dict(fp8_widen_layout="WGMMA_8BIT"), "q1": dict(fp8_q_split=False)}
    ours.update({f"st{n}": dict(stages=n) for n in range(2, 17, 2)})
    ours.update(shared=dict(fp8_shared_scratch=True), noshared=dict(fp8_shared_scratch=False))
    ours.update({f"pv{n}": dict(fp8_pv_tokens=n) for n in (64, 128, 256)})
    ours.update({f"ft{n}": dict(fp8_tokens_per_step=n) for n in (64, 128, 256)})
    opts = name.split(":")
    config = mosaic_config(":".join(o for o in opts if o not in ours))
    for o in opts:
        config = dataclasses.replace(config, **ours.get(o, {}))
    if config.profile_dir:
        raise ValueError("timed kernels take no profiler (its dump is a host callback)")
    return config


def main(argv=None):
    global FORCED_CHAIN
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,8,64,256")
    ap.add_argument("--contexts", default="512,4096,32768")
    ap.add_argument("--shapes", default=None,
                    help="BxCTX pairs in the order to run, e.g. 64x4096,1x32768 (overrides "
                         "--batches/--contexts)")
    ap.add_argument("--variants", default="mosaic,triton,bundled,xla,diag",
                    help="diag: also the Mosaic kernel alone, without the XLA ops around it; "
                         "marginal: also the Mosaic call's cost inside a larger program "
                         "(time_marginal; compiles chains of 2 and 6 calls per shape); "
                         "read: also a plain read of the same bytes, chained the same way")
    ap.add_argument("--chain", type=int, default=None,
                    help=f"kernel calls chained in one jit (default: {CHAIN}, {SMALL_CHAIN} for "
                         f"shapes under {SMALL_KV_BYTES / 1e6:.0f} MB of KV)")
    results_io.add_save_arg(ap, "paged_decode_<gpu>")
    args = ap.parse_args(argv)
    FORCED_CHAIN = args.chain
    ints = lambda s: [int(x) for x in s.split(",") if x]
    shapes = ([tuple(int(x) for x in p.split("x")) for p in args.shapes.split(",")]
              if args.shapes else None)
    config = {"hq": HQ, "hkv": HKV, "d": D, "page": PAGE, "dtype": "bfloat16",
              "shapes": args.shapes or f"{args.batches} x {args.contexts}",
              "variants": args.variants, "chain": args.chain or "default"}

    def save(result):  # after every shape, so a run cut short keeps what it measured
        if args.save:
            results_io.save(args.save, args.name or f"paged_decode_{results_io.device_slug()}",
                            config=config, metrics=metrics(result))

    result = run_grid(ints(args.batches), ints(args.contexts), tuple(args.variants.split(",")),
                      log=lambda s: print(s, flush=True), on_row=save, shapes=shapes)
    save(result)
    print(table(result))
    return result


if __name__ == "__main__":
    main()
