"""The recurrent-layer kernels (pallas_kernels/ssm) on the GPU: Gated DeltaNet and Mamba-2 SSD
prefill against the same-run bf16 matmul ceiling, their decode steps and the causal conv1d against
the same-run HBM read ceiling (jaxinfer/bench/anchors.py), every block size, stage and warp count of
the sweep below timed in the one run, with a table of them printed before the metrics.

    jaxinfer bench kernels --only ssm [--save [DIR]] [-- --no-sweep]
    JAX_PLATFORMS=cpu python -m jaxinfer.bench.kernel_ssm --tiny     # CPU smoke run (interpreter)

Shapes: Gated DeltaNet as Qwen3-Next-80B-A3B (16 key heads, 32 value heads, K = V = 128), SSD as
Nemotron-H-8B (128 heads of 64, 8 groups, state 128), the conv as Qwen3-Next's (width 4 over
q, k, v: 8192 channels), bf16 inputs, float32 states, chunk 64. Prefill batches: `b1x8192` (one
8192-token prompt) and `b8x1024` (8 prompts of 1024), every sequence continuing from a state.
Decode: `b1` and `b64` (one token per sequence).

First each kernel is checked against its jnp reference (pallas_kernels/ssm/reference.py) on a
small batch of the real head shapes (`*_rel_err`, every prefill config: `*_rel_err_{config}`).
Then per-call times with the state pool donated (as the engine must call them, or XLA copies
the pool before each call). Prefill calls are queued back to back, one jit call each:
  gdn_prefill_{case}_{config}_us, _tflops for each config of GDN_PREFILL (useful FLOPs:
  `gated_deltanet.gdn_prefill_flops` at chunk 64 for every config, so a config's TF/s is the
  same work over its time); gdn_prefill_{case}_kernels_us: the default config's device time per
  kernel (jax's profiler); gdn_prefill_{case}_us / _tflops the default config's (the
  first), gdn_prefill_frac_of_matmul (b8x1024's TF/s over the matmul ceiling), and
  gdn_prefill_best (the fastest config at b8x1024) with gdn_prefill_best_frac_of_matmul;
  ssd_prefill_* the same over SSD_PREFILL (`mamba2.ssd_prefill_flops`); conv1d_prefill_{case}_us
  (default config) and _{config}_us over CONV_PREFILL, _frac_of_hbm (x read, y written).
Decode steps are microseconds, less than a jit call's host dispatch, so they are timed as
DECODE_CALLS calls inside one jit (the engine's decode step is one jit too):
  {gdn,ssd}_decode_b{S}_us / _{config}_us (per call) and _frac_of_hbm (the state read and
  written, over the read ceiling); `{gdn,ssd}_decode_frac_of_hbm` is b64's;
  *_decode_b{S}_call_us: one jit call per step, queued (the record before the sweep timed this);
  conv1d_update_b{S}_us the same way. Record: ssm_kernels_<gpu>.json.
"""

from __future__ import annotations

import argparse
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.bench import anchors, results_io
from pallas_kernels.ssm import conv1d, gated_deltanet, mamba2, reference

GDN = dict(hk=16, hv=32, kd=128, vd=128)
SSD = dict(h=128, p=64, g=8, n=128)
CONV = dict(c=2 * 16 * 128 + 32 * 128, w=4)
PREFILL = {"b8x1024": [1024] * 8, "b1x8192": [8192]}  # the goal case first
DECODE = (1, 64)
# name -> keyword arguments; the first of each is the kernel's default, whose times keep the
# record's plain keys.
# The prefill variants' sweep (ssm_kernels_h100.json) chose GDN's split form and SSD's fused one;
# these tune what is left. Left out after losing on the H100 (a run at 1a18fab): 8 warps, block
# 16 at 8 x 1024, and SSD programs walking 2 or 4 heads of a group (C B^T shared; 0.4-0.7x).
GDN_PREFILL = {
    "c32_bv64_stages2": dict(chunk_size=32, block_v=64, num_stages=2),
    "bv64_stages2": dict(chunk_size=64, block_v=64, num_stages=2),
    "c32_bv32_stages2": dict(chunk_size=32, block_v=32, num_stages=2),
    "c32_bv16_stages2": dict(chunk_size=32, block_v=16, num_stages=2),  # one prompt: 256 walks
    "c32_bv64_stages3": dict(chunk_size=32, block_v=64, num_stages=3),
    # The UT transform's diagonal blocks inverted by 3xTF32 dots (`ut_solve`), at the default
    # chunk and at 64, whose four diagonal blocks the row loop makes costlier.
    "c32_bv64_stages2_doubling": dict(chunk_size=32, block_v=64, num_stages=2,
                                      ut_solve="doubling"),
    "bv64_stages2_doubling": dict(chunk_size=64, block_v=64, num_stages=2, ut_solve="doubling"),
}
SSD_PREFILL = {
    "bp64": dict(block_p=64),  # stages by batch: mamba2.default_stages
    "bp64_stages1": dict(block_p=64, num_stages=1),
    "bp64_stages2": dict(block_p=64, num_stages=2),
    "bp64_stages3": dict(block_p=64, num_stages=3),
    "bp32_stages2": dict(block_p=32, num_stages=2),
    "c32_bp64_stages2": dict(chunk_size=32, block_p=64, num_stages=2),
}
CONV_PREFILL = {"bt32": dict(block_t=32), "bt64": dict(block_t=64)}
# Decode: fla's fused_recurrent runs [K, 8]-column tiles on one warp (the K reduction stays in
# the warp); the small-tile configs try that shape at Triton's 16-column floor.
GDN_DECODE = {"bv64": dict(block_v=64), "bv32": dict(block_v=32), "bv128": dict(block_v=128),
              "bv128_w8": dict(block_v=128, num_warps=8), "bv16_w1": dict(block_v=16, num_warps=1),
              "bv32_w2": dict(block_v=32, num_warps=2)}
SSD_DECODE = {"bp64": dict(block_p=64), "bp32": dict(block_p=32),
              "bp64_w8": dict(block_p=64, num_warps=8), "bp16_w1": dict(block_p=16, num_warps=1)}
SWEEPS = dict(gdn_prefill=GDN_PREFILL, ssd_prefill=SSD_PREFILL, conv_prefill=CONV_PREFILL,
              gdn_decode=GDN_DECODE, ssd_decode=SSD_DECODE)
DECODE_CALLS = 16
TINY = dict(gdn=dict(hk=1, hv=2, kd=16, vd=16), ssd=dict(h=2, p=16, g=1, n=16),
            conv=dict(c=32, w=4), prefill={"b2x40": [40, 24]}, decode=(2,))


def ragged(lens):
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
    s = len(lens)
    return cu, jnp.arange(s, dtype=jnp.int32), jnp.ones((s,), bool)


# Inputs are drawn on the host: made by jax.random, each shape's program compiles first (seconds
# of a CPU run each, longer than the interpreted kernels they feed).
def normal(rng, shape, dtype, scale=1.0):
    return jnp.asarray((rng.standard_normal(shape, np.float32) * scale).astype(dtype))


def gdn_args(t, s, hk, hv, kd, vd, seed=0):
    rng = np.random.default_rng(seed)
    q = normal(rng, (t, hk, kd), jnp.bfloat16)
    k = normal(rng, (t, hk, kd), jnp.bfloat16)
    v = normal(rng, (t, hv, vd), jnp.bfloat16)
    g, beta = jax.jit(reference.gdn_gating)(normal(rng, (t, hv), np.float32),
                                            normal(rng, (t, hv), np.float32),
                                            np.log(np.linspace(1.0, 16.0, hv, dtype=np.float32)),
                                            np.ones((hv,), np.float32))
    pool = normal(rng, (s, hv, kd, vd), np.float32, 0.1)
    return (q, k, v, g, beta), pool


def ssd_args(t, s, h, p, g, n, seed=0):
    rng = np.random.default_rng(seed)
    x = normal(rng, (t, h, p), jnp.bfloat16)
    dt = jax.jit(reference.mamba2_dt)(normal(rng, (t, h), np.float32, 1.0) - 2.0,
                                      np.zeros((h,), np.float32))
    b = normal(rng, (t, g, n), jnp.bfloat16)
    c = normal(rng, (t, g, n), jnp.bfloat16)
    pool = normal(rng, (s, h, p, n), np.float32, 0.1)
    return (x, dt, -jnp.asarray(np.linspace(1.0, 16.0, h, dtype=np.float32)), b, c), pool


def conv_args(t, s, c, w, random_state):
    """x [t, c] and weight [w, c] bf16, and the state [s, w - 1, c]: random, or zeros."""
    rng = np.random.default_rng(1)
    x, weight = normal(rng, (t, c), jnp.bfloat16), normal(rng, (w, c), jnp.bfloat16)
    return x, weight, normal(rng, (s, w - 1, c), jnp.bfloat16, 1.0 if random_state else 0.0)


def jitted(fn, **static):
    """fn with `static` keyword arguments bound, jitted (the check's calls: one compile each)."""
    return jax.jit(functools.partial(fn, **static))


@jax.jit
def _rel_err(got, want):
    got, want = jnp.asarray(got, jnp.float32), jnp.asarray(want, jnp.float32)
    return jnp.linalg.norm(got - want) / jnp.linalg.norm(want)


def rel_err(got, want) -> float:
    return float(_rel_err(got, want))


def pool_time(fn, pool, *inputs) -> float:
    """Seconds per call of fn(pool, *inputs) -> (out, pool), the pool donated and fed back. The
    inputs are arguments, not closed over: XLA would fold megabytes of constants into the program
    (an 8192-token prefill's compile did not finish). The pool is copied first, so the caller's
    stays valid for the next config."""
    f = jax.jit(fn, donate_argnums=0)
    return anchors.queued_time(lambda st: f(st[1], *inputs), (None, jnp.copy(pool)))


def kernel_split(fn, pool, *inputs, calls: int = 5) -> dict:
    """{kernel name: device µs per call} of fn(pool, *inputs) -> (out, pool), from jax's profiler
    (CUPTI) around `calls` queued calls after a warm-up: which of a prefill's kernels (and XLA's
    pads and selects around them) takes the time. GPU only."""
    import tempfile

    from jaxinfer.bench.profile.trace_decode import device_events
    f = jax.jit(fn, donate_argnums=0)
    p = jax.block_until_ready(f(jnp.copy(pool), *inputs)[1])
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            for _ in range(calls):
                p = f(p, *inputs)[1]
            jax.block_until_ready(p)
        events = device_events(d)
    split: dict[str, float] = {}
    for name, start, end in events:
        split[name[:48]] = split.get(name[:48], 0.0) + (end - start) / 1e3 / calls
    return {k: round(v, 1) for k, v in sorted(split.items(), key=lambda kv: -kv[1])}


def loop_time(fn, pool, *inputs, calls: int = DECODE_CALLS) -> float:
    """Seconds per call of fn(pool, *inputs) -> (out, pool) when `calls` of them run in one jit
    (unrolled: an XLA while loop would add its own per-step sync), the pool donated."""
    def many(p, *ins):
        for _ in range(calls):
            p = fn(p, *ins)[1]
        return p

    f = jax.jit(many, donate_argnums=0)
    return anchors.queued_time(lambda p: f(p, *inputs), jnp.copy(pool)) / calls


def check(m, tiny, interpret, cfg):
    """Each kernel against its reference on two short sequences of the real head shapes, beside a
    padding sequence (slot -1) and 3 padding tokens: the prefill outputs' zeros count too."""
    gs, ss, cs = (TINY["gdn"], TINY["ssd"], TINY["conv"]) if tiny else (GDN, SSD, CONV)
    cu, _, init = ragged([100, 37, 5])
    slots = jnp.asarray([0, 1, -1], jnp.int32)
    t = 145
    ins, pool = gdn_args(t, 2, **gs)
    want = jax.jit(reference.gdn_chunked_reference)(*ins, pool, cu, slots, init)
    for i, (name, kw) in enumerate(cfg["gdn_prefill"].items()):
        tail = "" if i == 0 else f"_{name}"
        try:
            got = jitted(gated_deltanet.gdn_prefill, interpret=interpret, **kw)(
                *ins, pool, cu, slots, init)
        except Exception as e:  # noqa: BLE001 - recorded; sweep() records its timing's failure
            m[f"gdn_prefill_rel_err{tail}_error"] = f"{type(e).__name__}: {e}"[:300]
            continue
        m[f"gdn_prefill_rel_err{tail}"] = rel_err(got[0], want[0])
        m[f"gdn_prefill_state_rel_err{tail}"] = rel_err(got[1], want[1])
    first_two = lambda fn, **kw: jax.jit(lambda ins, *rest: fn(*(x[:2] for x in ins), *rest,
                                                                **kw)[0])
    m["gdn_decode_rel_err"] = rel_err(
        first_two(gated_deltanet.gdn_decode, interpret=interpret)(ins, pool, slots[:2]),
        first_two(reference.gdn_decode_reference)(ins, pool, slots[:2]))
    (x, dt, a, b, c), pool = ssd_args(t, 2, **ss)
    d = jnp.ones((ss["h"],))
    want = jitted(reference.ssd_chunked_reference, d=d)(x, dt, a, b, c, pool, cu, slots, init)
    for i, (name, kw) in enumerate(cfg["ssd_prefill"].items()):
        tail = "" if i == 0 else f"_{name}"
        try:
            got = jitted(mamba2.ssd_prefill, d=d, interpret=interpret, **kw)(
                x, dt, a, b, c, pool, cu, slots, init)
        except Exception as e:  # noqa: BLE001 - recorded; sweep() records its timing's failure
            m[f"ssd_prefill_rel_err{tail}_error"] = f"{type(e).__name__}: {e}"[:300]
            continue
        m[f"ssd_prefill_rel_err{tail}"] = rel_err(got[0], want[0])
        m[f"ssd_prefill_state_rel_err{tail}"] = rel_err(got[1], want[1])
    ssd_decode = lambda fn, **kw: jax.jit(lambda x, dt, b, c, a, pool, slots: fn(
        x[:2], dt[:2], a, b[:2], c[:2], pool, slots, d=d, **kw)[0])
    m["ssd_decode_rel_err"] = rel_err(
        ssd_decode(mamba2.ssd_decode, interpret=interpret)(x, dt, b, c, a, pool, slots[:2]),
        ssd_decode(reference.ssd_decode_reference)(x, dt, b, c, a, pool, slots[:2]))
    xc, w, st = conv_args(t, 2, cs["c"], cs["w"], True)
    m["conv1d_rel_err"] = rel_err(
        jitted(conv1d.causal_conv1d, interpret=interpret)(xc, w, None, st, cu, slots, init)[0],
        jax.jit(reference.causal_conv1d_reference)(xc, w, None, st, cu, slots, init)[0])


def sweep(m, prefix, configs, time_one):
    """Times time_one(**kw) for every config: m[{prefix}_{name}_us], and the first's as
    m[{prefix}_us]. A config that fails (a Triton compile out of resources, say) is recorded as
    m[{prefix}_{name}_error] and the sweep goes on: one GPU call must decide them all. Returns
    {name: seconds} of those that ran."""
    secs = {}
    for i, (name, kw) in enumerate(configs.items()):
        try:
            secs[name] = time_one(**kw)
        except Exception as e:  # noqa: BLE001 - recorded, the other configs still run
            m[f"{prefix}_{name}_error"] = f"{type(e).__name__}: {e}"[:300]
            print(f"FAILED {prefix}_{name}: {m[f'{prefix}_{name}_error']}", flush=True)
            continue
        m[f"{prefix}_{name}_us"] = round(secs[name] * 1e6, 2)
        if i == 0:
            m[f"{prefix}_us"] = m[f"{prefix}_{name}_us"]
    return secs


def traced(fn, pool, *inputs) -> dict:
    """kernel_split's figures, or the error that stopped it (the sweep goes on)."""
    try:
        split = kernel_split(fn, pool, *inputs)
    except Exception as e:  # noqa: BLE001 - recorded; the timings do not depend on it
        return {"error": f"{type(e).__name__}: {e}"[:300]}
    print(f"kernels: {split}", flush=True)
    return split


def default_rate(m, prefix, configs, unit):
    """m[{prefix}_{unit}] = the default (first) config's, when it ran."""
    key = f"{prefix}_{next(iter(configs))}_{unit}"
    if key in m:
        m[f"{prefix}_{unit}"] = m[key]


def prefill_cases(m, tiny, interpret, table, cfg):
    gs, ss, cs = (TINY["gdn"], TINY["ssd"], TINY["conv"]) if tiny else (GDN, SSD, CONV)
    cases = TINY["prefill"] if tiny else PREFILL
    hbm = m["read_tbps"] * 1e12
    for case, lens in cases.items():
        cu, slots, init = ragged(lens)
        t, s = sum(lens), len(lens)
        ins, pool = gdn_args(t, s, **gs)
        gdn = lambda p, ins, cu, slots, init, **kw: gated_deltanet.gdn_prefill(
            *ins, p, cu, slots, init, interpret=interpret, **kw)
        secs = sweep(m, f"gdn_prefill_{case}", cfg["gdn_prefill"], lambda **kw: pool_time(
            functools.partial(gdn, **kw), pool, ins, cu, slots, init))
        if not interpret:
            m[f"gdn_prefill_{case}_kernels_us"] = traced(gdn, pool, ins, cu, slots, init)
        flops = gated_deltanet.gdn_prefill_flops(lens, gs["hv"], gs["kd"], gs["vd"])
        for name, sec in secs.items():
            tf = round(flops / sec / 1e12, 2)
            m[f"gdn_prefill_{case}_{name}_tflops"] = tf
            add_row(table, ("gdn_prefill", case, name, sec, f"{tf} TF/s"))
        default_rate(m, f"gdn_prefill_{case}", GDN_PREFILL, "tflops")
        (x, dt, a, b, c), pool = ssd_args(t, s, **ss)
        ssd = lambda p, ins, cu, slots, init, **kw: mamba2.ssd_prefill(
            *ins, p, cu, slots, init, interpret=interpret, **kw)
        secs = sweep(m, f"ssd_prefill_{case}", cfg["ssd_prefill"], lambda **kw: pool_time(
            functools.partial(ssd, **kw), pool, (x, dt, a, b, c), cu, slots, init))
        if not interpret:
            m[f"ssd_prefill_{case}_kernels_us"] = traced(ssd, pool, (x, dt, a, b, c), cu, slots,
                                                         init)
        flops = mamba2.ssd_prefill_flops(lens, ss["h"], ss["p"], ss["n"])
        for name, sec in secs.items():
            tf = round(flops / sec / 1e12, 2)
            m[f"ssd_prefill_{case}_{name}_tflops"] = tf
            add_row(table, ("ssd_prefill", case, name, sec, f"{tf} TF/s"))
        default_rate(m, f"ssd_prefill_{case}", SSD_PREFILL, "tflops")
        xc, w, st = conv_args(t, s, cs["c"], cs["w"], False)
        secs = sweep(m, f"conv1d_prefill_{case}", cfg["conv_prefill"], lambda **kw: pool_time(
            lambda p, xc, w, cu, slots, init: conv1d.causal_conv1d(
                xc, w, None, p, cu, slots, init, interpret=interpret, **kw),
            st, xc, w, cu, slots, init))
        for name, sec in secs.items():
            frac = round(2 * xc.nbytes / sec / hbm, 3)
            m[f"conv1d_prefill_{case}_{name}_frac_of_hbm"] = frac
            add_row(table, ("conv1d_prefill", case, name, sec, f"{frac} of HBM"))
        default_rate(m, f"conv1d_prefill_{case}", CONV_PREFILL, "frac_of_hbm")


def decode_cases(m, tiny, interpret, table, cfg):
    gs, ss, cs = (TINY["gdn"], TINY["ssd"], TINY["conv"]) if tiny else (GDN, SSD, CONV)
    hbm = m["read_tbps"] * 1e12
    loop_time_ = functools.partial(loop_time, calls=2 if tiny else DECODE_CALLS)
    for s in TINY["decode"] if tiny else DECODE:
        slots = jnp.arange(s, dtype=jnp.int32)
        ins, pool = gdn_args(s, s, **gs)
        gdn_step = lambda p, ins, slots, **kw: gated_deltanet.gdn_decode(
            *ins, p, slots, interpret=interpret, **kw)
        secs = sweep(m, f"gdn_decode_b{s}", cfg["gdn_decode"],
                     lambda **kw: loop_time_(functools.partial(gdn_step, **kw), pool, ins, slots))
        m[f"gdn_decode_b{s}_call_us"] = round(pool_time(gdn_step, pool, ins, slots) * 1e6, 2)
        for name, sec in secs.items():
            frac = round(2 * pool.nbytes / sec / hbm, 3)
            m[f"gdn_decode_b{s}_{name}_frac_of_hbm"] = frac
            add_row(table, ("gdn_decode", f"b{s}", name, sec, f"{frac} of HBM"))
        default_rate(m, f"gdn_decode_b{s}", GDN_DECODE, "frac_of_hbm")
        (x, dt, a, b, c), pool = ssd_args(s, s, **ss)
        ssd_step = lambda p, ins, slots, **kw: mamba2.ssd_decode(
            *ins, p, slots, interpret=interpret, **kw)
        secs = sweep(m, f"ssd_decode_b{s}", cfg["ssd_decode"], lambda **kw: loop_time_(
            functools.partial(ssd_step, **kw), pool, (x, dt, a, b, c), slots))
        m[f"ssd_decode_b{s}_call_us"] = round(
            pool_time(ssd_step, pool, (x, dt, a, b, c), slots) * 1e6, 2)
        for name, sec in secs.items():
            frac = round(2 * pool.nbytes / sec / hbm, 3)
            m[f"ssd_decode_b{s}_{name}_frac_of_hbm"] = frac
            add_row(table, ("ssd_decode", f"b{s}", name, sec, f"{frac} of HBM"))
        default_rate(m, f"ssd_decode_b{s}", SSD_DECODE, "frac_of_hbm")
        xc, w, st = conv_args(s, s, cs["c"], cs["w"], False)
        conv_step = lambda p, xc, w, slots: conv1d.causal_conv1d_update(
            xc, w, None, p, slots, interpret=interpret)
        sec = loop_time_(conv_step, st, xc, w, slots)
        m[f"conv1d_update_b{s}_us"] = round(sec * 1e6, 2)
        m[f"conv1d_update_b{s}_call_us"] = round(pool_time(conv_step, st, xc, w, slots) * 1e6, 2)
        add_row(table, ("conv1d_update", f"b{s}", "default", sec, ""))


TABLE_HEADER = f"{'kernel':<16}{'case':<10}{'config':<26}{'us':>10}  rate"


def table_line(kernel, case, name, sec, rate) -> str:
    return f"{kernel:<16}{case:<10}{name:<26}{sec * 1e6:>10.1f}  {rate}"


def add_row(table, row) -> None:
    """Keeps the row for the final table and prints it now (flushed): a run cut short by its
    time limit still shows what it measured."""
    table.append(row)
    print(table_line(*row), flush=True)


def print_table(table, m) -> None:
    """One line per (kernel, case, config): microseconds per call and the rate; then the configs
    that failed."""
    print(TABLE_HEADER)
    for row in table:
        print(table_line(*row))
    for key in (k for k in m if k.endswith("_error")):
        print(f"FAILED {key}: {m[key]}")


def run(tiny: bool, sweep: bool = True) -> dict:
    """The record's metrics; sweep=False times only each table's default (first) config."""
    interpret = jax.default_backend() == "cpu"
    cfg = {k: v if sweep else dict(list(v.items())[:1]) for k, v in SWEEPS.items()}
    rates = anchors.measure(tiny=tiny)
    m = {k: rates[k] for k in ("matmul_tflops", "matmul_shape", "read_tbps", "read_kernel")}
    check(m, tiny, interpret, cfg)
    table = []
    print(TABLE_HEADER, flush=True)
    prefill_cases(m, tiny, interpret, table, cfg)
    decode_cases(m, tiny, interpret, table, cfg)
    print_table(table, m)
    if not tiny:
        peak = rates["matmul_tflops"] * 1e12
        for name in ("gdn", "ssd"):
            tf = {c: m[k] for c in cfg[f"{name}_prefill"] if (k := f"{name}_prefill_b8x1024_{c}_tflops") in m}
            if f"{name}_prefill_b8x1024_tflops" in m:
                m[f"{name}_prefill_frac_of_matmul"] = round(
                    m[f"{name}_prefill_b8x1024_tflops"] * 1e12 / peak, 3)
            if tf:
                best = max(tf, key=tf.get)
                m[f"{name}_prefill_best"] = best
                m[f"{name}_prefill_best_frac_of_matmul"] = round(tf[best] * 1e12 / peak, 3)
            if f"{name}_decode_b64_frac_of_hbm" in m:
                m[f"{name}_decode_frac_of_hbm"] = m[f"{name}_decode_b64_frac_of_hbm"]
    return m


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (a CPU smoke run)")
    ap.add_argument("--no-sweep", action="store_true",
                    help="time only each kernel's default config")
    results_io.add_save_arg(ap, "ssm_kernels_<gpu>")
    a = ap.parse_args(argv)
    m = run(a.tiny, sweep=not a.no_sweep)
    if a.save:
        results_io.save(a.save, a.name or f"ssm_kernels_{results_io.device_slug()}",
                        config=dict(tiny=a.tiny, sweep=not a.no_sweep, gdn=GDN, ssd=SSD,
                                    conv=CONV, prefill={k: len(v) for k, v in PREFILL.items()},
                                    sweeps=SWEEPS, decode_calls=DECODE_CALLS),
                        metrics=m)
    print(json.dumps(m, indent=1))


if __name__ == "__main__":
    main()
