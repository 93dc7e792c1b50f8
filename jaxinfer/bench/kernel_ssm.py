"""The recurrent-layer kernels (pallas_kernels/ssm) on the GPU: Gated DeltaNet and Mamba-2 SSD
prefill against the same-run bf16 matmul ceiling, their decode steps and the causal conv1d against
the same-run HBM read ceiling (jaxinfer/bench/anchors.py).

    jaxinfer bench kernels --only ssm [--save [DIR]] [-- --sweep]
    JAX_PLATFORMS=cpu python -m jaxinfer.bench.kernel_ssm --tiny     # CPU smoke run (interpreter)

Shapes: Gated DeltaNet as Qwen3-Next-80B-A3B (16 key heads, 32 value heads, K = V = 128), SSD as
Nemotron-H-8B (128 heads of 64, 8 groups, state 128), the conv as Qwen3-Next's (width 4 over
q, k, v: 8192 channels), bf16 inputs, float32 states, chunk 64. Prefill batches: `b1x8192` (one
8192-token prompt) and `b8x1024` (8 prompts of 1024), every sequence continuing from a state.
Decode: `b1` and `b64` (one token per sequence).

First each kernel is checked against its jnp reference (pallas_kernels/ssm/reference.py) on a
small batch of the real head shapes (`*_rel_err`). Then per-call times, queued back to back with
the state pool donated (as the engine must call them, or XLA copies the pool before each call):
  gdn_prefill_{case}_us, _tflops (useful FLOPs: `gated_deltanet.gdn_prefill_flops`), and
  gdn_prefill_frac_of_matmul (b8x1024's TF/s over the matmul ceiling); ssd_prefill_* the same
  (`mamba2.ssd_prefill_flops`); {gdn,ssd}_decode_b{S}_us and _frac_of_hbm (the state read and
  written, over the read ceiling, b64); conv1d_prefill_{case}_us / conv1d_update_b64_us with
  _frac_of_hbm (x read, y written). --sweep also times block_v / block_p 32 and 128 beside the
  default 64 (`gdn_prefill_b8x1024_bv{n}_us`, ...). Record: ssm_kernels_<gpu>.json.
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.bench import anchors, results_io
from pallas_kernels.ssm import conv1d, gated_deltanet, mamba2, reference

GDN = dict(hk=16, hv=32, kd=128, vd=128)
SSD = dict(h=128, p=64, g=8, n=128)
CONV = dict(c=2 * 16 * 128 + 32 * 128, w=4)
PREFILL = {"b1x8192": [8192], "b8x1024": [1024] * 8}
DECODE = (1, 64)
TINY = dict(gdn=dict(hk=1, hv=2, kd=16, vd=16), ssd=dict(h=2, p=16, g=1, n=16),
            conv=dict(c=32, w=4), prefill={"b2x40": [40, 24]}, decode=(2,))


def ragged(lens):
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
    s = len(lens)
    return cu, jnp.arange(s, dtype=jnp.int32), jnp.ones((s,), bool)


def gdn_args(t, s, hk, hv, kd, vd, seed=0):
    ks = jax.random.split(jax.random.key(seed), 6)
    q = jax.random.normal(ks[0], (t, hk, kd), jnp.bfloat16)
    k = jax.random.normal(ks[1], (t, hk, kd), jnp.bfloat16)
    v = jax.random.normal(ks[2], (t, hv, vd), jnp.bfloat16)
    g, beta = reference.gdn_gating(jax.random.normal(ks[3], (t, hv)),
                                   jax.random.normal(ks[4], (t, hv)),
                                   jnp.log(jnp.linspace(1.0, 16.0, hv)), jnp.ones((hv,)))
    pool = jax.random.normal(ks[5], (s, hv, kd, vd), jnp.float32) * 0.1
    return (q, k, v, g, beta), pool


def ssd_args(t, s, h, p, g, n, seed=0):
    ks = jax.random.split(jax.random.key(seed), 5)
    x = jax.random.normal(ks[0], (t, h, p), jnp.bfloat16)
    dt = reference.mamba2_dt(jax.random.normal(ks[1], (t, h)) - 2.0, jnp.zeros((h,)))
    b = jax.random.normal(ks[2], (t, g, n), jnp.bfloat16)
    c = jax.random.normal(ks[3], (t, g, n), jnp.bfloat16)
    pool = jax.random.normal(ks[4], (s, h, p, n), jnp.float32) * 0.1
    return (x, dt, -jnp.linspace(1.0, 16.0, h), b, c), pool


def rel_err(got, want) -> float:
    got, want = jnp.asarray(got, jnp.float32), jnp.asarray(want, jnp.float32)
    return float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))


def pool_time(fn, pool, *inputs) -> float:
    """Seconds per call of fn(pool, *inputs) -> (out, pool), the pool donated and fed back. The
    inputs are arguments, not closed over: XLA would fold megabytes of constants into the program
    (an 8192-token prefill's compile did not finish)."""
    f = jax.jit(fn, donate_argnums=0)
    return anchors.queued_time(lambda st: f(st[1], *inputs), (None, pool))


def check(m, tiny, interpret):
    """Each kernel against its reference on two short sequences of the real head shapes."""
    gs, ss, cs = (TINY["gdn"], TINY["ssd"], TINY["conv"]) if tiny else (GDN, SSD, CONV)
    cu, slots, init = ragged([100, 37])
    t = 137
    ins, pool = gdn_args(t, 2, **gs)
    got = gated_deltanet.gdn_prefill(*ins, pool, cu, slots, init, interpret=interpret)
    want = reference.gdn_chunked_reference(*ins, pool, cu, slots, init)
    m["gdn_prefill_rel_err"] = rel_err(got[0], want[0])
    m["gdn_prefill_state_rel_err"] = rel_err(got[1], want[1])
    dec = tuple(x[:2] for x in ins)
    m["gdn_decode_rel_err"] = rel_err(
        gated_deltanet.gdn_decode(*dec, pool, slots, interpret=interpret)[0],
        reference.gdn_decode_reference(*dec, pool, slots)[0])
    (x, dt, a, b, c), pool = ssd_args(t, 2, **ss)
    d = jnp.ones((ss["h"],))
    got = mamba2.ssd_prefill(x, dt, a, b, c, pool, cu, slots, init, d=d, interpret=interpret)
    want = reference.ssd_chunked_reference(x, dt, a, b, c, pool, cu, slots, init, d=d)
    m["ssd_prefill_rel_err"] = rel_err(got[0], want[0])
    m["ssd_prefill_state_rel_err"] = rel_err(got[1], want[1])
    m["ssd_decode_rel_err"] = rel_err(
        mamba2.ssd_decode(x[:2], dt[:2], a, b[:2], c[:2], pool, slots, d=d,
                          interpret=interpret)[0],
        reference.ssd_decode_reference(x[:2], dt[:2], a, b[:2], c[:2], pool, slots, d=d)[0])
    xc = jax.random.normal(jax.random.key(1), (t, cs["c"]), jnp.bfloat16)
    w = jax.random.normal(jax.random.key(2), (cs["w"], cs["c"]), jnp.bfloat16)
    st = jax.random.normal(jax.random.key(3), (2, cs["w"] - 1, cs["c"]), jnp.bfloat16)
    m["conv1d_rel_err"] = rel_err(
        conv1d.causal_conv1d(xc, w, None, st, cu, slots, init, interpret=interpret)[0],
        reference.causal_conv1d_reference(xc, w, None, st, cu, slots, init)[0])


def run(tiny: bool, sweep: bool) -> dict:
    interpret = jax.default_backend() == "cpu"
    rates = anchors.measure(tiny=tiny)
    m = {k: rates[k] for k in ("matmul_tflops", "matmul_shape", "read_tbps", "read_kernel")}
    check(m, tiny, interpret)
    gs, ss, cs = (TINY["gdn"], TINY["ssd"], TINY["conv"]) if tiny else (GDN, SSD, CONV)
    cases, decodes = (TINY["prefill"], TINY["decode"]) if tiny else (PREFILL, DECODE)
    blocks = (32, 64, 128) if sweep and not tiny else (64,)
    peak, hbm = rates["matmul_tflops"] * 1e12, rates["read_tbps"] * 1e12
    for case, lens in cases.items():
        cu, slots, init = ragged(lens)
        t, s = sum(lens), len(lens)
        ins, pool = gdn_args(t, s, **gs)
        for bv in blocks:
            sec = pool_time(lambda p, ins, cu, slots, init, bv=bv: gated_deltanet.gdn_prefill(
                *ins, p, cu, slots, init, block_v=bv, interpret=interpret),
                pool, ins, cu, slots, init)
            key = f"gdn_prefill_{case}" + ("" if bv == 64 else f"_bv{bv}")
            m[f"{key}_us"] = round(sec * 1e6, 1)
        flops = gated_deltanet.gdn_prefill_flops(lens, gs["hv"], gs["kd"], gs["vd"])
        m[f"gdn_prefill_{case}_tflops"] = round(flops / m[f"gdn_prefill_{case}_us"] / 1e6, 2)
        (x, dt, a, b, c), pool = ssd_args(t, s, **ss)
        for bp in blocks:
            sec = pool_time(lambda p, ins, cu, slots, init, bp=bp: mamba2.ssd_prefill(
                *ins, p, cu, slots, init, block_p=bp, interpret=interpret),
                pool, (x, dt, a, b, c), cu, slots, init)
            m[f"ssd_prefill_{case}" + ("" if bp == 64 else f"_bp{bp}") + "_us"] = round(sec * 1e6, 1)
        flops = mamba2.ssd_prefill_flops(lens, ss["h"], ss["p"], ss["n"])
        m[f"ssd_prefill_{case}_tflops"] = round(flops / m[f"ssd_prefill_{case}_us"] / 1e6, 2)
        xc = jax.random.normal(jax.random.key(1), (t, cs["c"]), jnp.bfloat16)
        w = jax.random.normal(jax.random.key(2), (cs["w"], cs["c"]), jnp.bfloat16)
        st = jnp.zeros((s, cs["w"] - 1, cs["c"]), jnp.bfloat16)
        sec = pool_time(lambda p, xc, w, cu, slots, init: conv1d.causal_conv1d(
            xc, w, None, p, cu, slots, init, interpret=interpret), st, xc, w, cu, slots, init)
        m[f"conv1d_prefill_{case}_us"] = round(sec * 1e6, 1)
        m[f"conv1d_prefill_{case}_frac_of_hbm"] = round(2 * xc.nbytes / sec / hbm, 3)
    for s in decodes:
        slots = jnp.arange(s, dtype=jnp.int32)
        ins, pool = gdn_args(s, s, **gs)
        sec = pool_time(lambda p, ins, slots: gated_deltanet.gdn_decode(
            *ins, p, slots, interpret=interpret), pool, ins, slots)
        m[f"gdn_decode_b{s}_us"] = round(sec * 1e6, 2)
        m[f"gdn_decode_b{s}_frac_of_hbm"] = round(2 * pool.nbytes / sec / hbm, 3)
        (x, dt, a, b, c), pool = ssd_args(s, s, **ss)
        sec = pool_time(lambda p, ins, slots: mamba2.ssd_decode(
            *ins, p, slots, interpret=interpret), pool, (x, dt, a, b, c), slots)
        m[f"ssd_decode_b{s}_us"] = round(sec * 1e6, 2)
        m[f"ssd_decode_b{s}_frac_of_hbm"] = round(2 * pool.nbytes / sec / hbm, 3)
        xc = jax.random.normal(jax.random.key(1), (s, cs["c"]), jnp.bfloat16)
        w = jax.random.normal(jax.random.key(2), (cs["w"], cs["c"]), jnp.bfloat16)
        st = jnp.zeros((s, cs["w"] - 1, cs["c"]), jnp.bfloat16)
        sec = pool_time(lambda p, xc, w, slots: conv1d.causal_conv1d_update(
            xc, w, None, p, slots, interpret=interpret), st, xc, w, slots)
        m[f"conv1d_update_b{s}_us"] = round(sec * 1e6, 2)
    if not tiny:
        for name in ("gdn", "ssd"):
            m[f"{name}_prefill_frac_of_matmul"] = round(
                m[f"{name}_prefill_b8x1024_tflops"] * 1e12 / peak, 3)
            m[f"{name}_decode_frac_of_hbm"] = m[f"{name}_decode_b64_frac_of_hbm"]
    return m


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (a CPU smoke run)")
    ap.add_argument("--sweep", action="store_true", help="also block_v / block_p 32 and 128")
    results_io.add_save_arg(ap, "ssm_kernels_<gpu>")
    a = ap.parse_args(argv)
    m = run(a.tiny, a.sweep)
    if a.save:
        results_io.save(a.save, a.name or f"ssm_kernels_{results_io.device_slug()}",
                        config=dict(tiny=a.tiny, sweep=a.sweep, gdn=GDN, ssd=SSD, conv=CONV,
                                    prefill={k: len(v) for k, v in PREFILL.items()}),
                        metrics=m)
    print(json.dumps(m, indent=1))


if __name__ == "__main__":
    main()
