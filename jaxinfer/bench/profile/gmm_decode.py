"""The routed experts' grouped matmul at decode on a model's expert shapes: each tiling of TILINGS
timed on the rows a step of `--tokens` tokens routes, beside a plain read of the bytes it streams
(the same run's ceiling). It answers which tiling streams a shape whose K and N are not multiples
of 128 (gpt-oss-20b: K = N = 2880, so the warp-specialised tilings narrow to the one-warpgroup
kernel's 64-column blocks: `grouped_matmul._fit`).

    python -m jaxinfer.bench.profile.gmm_decode [--shape gpt_oss_20b ...] [--tokens 1 64] [--save]

One call is one plain grouped matmul (one weight stack [E, K, N], bf16): a gate, up or down
projection, or gate and up as one stack twice as wide (`gpt_oss_20b_gate_up`: the layout one GPU
serves gpt-oss in, one call where the separate stacks take two). The timed jit runs ROUTINGS
calls, each on another random routing, so a call's experts are not the previous call's (L2 holds
50 MB; four gpt-oss experts are 66 MB). Reported per shape, tiling and token count: µs per call,
the streamed experts' bytes over that time (TB/s) and over the read ceiling, and the output's
error against `jax.lax.ragged_dot`.
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp

from jaxinfer.bench import anchors, results_io
from jaxinfer.bench.kernel_prefill import bench_interleaved, rel_err
from pallas_kernels.moe import grouped_matmul as gm

SHAPES = {"gpt_oss_20b": (32, 2880, 2880, 4), "gpt_oss_20b_gate_up": (32, 2880, 5760, 4),
          "qwen3_30b_a3b": (128, 2048, 768, 8)}  # E, K, N, k
# name -> config fields (`grouped_matmul.config_from_fields`), each timed where its block_n
# divides N. The first is the 64-column one-warpgroup tiling `_fit` falls back to; ws_m_n192,
# what it gives gpt-oss's decode calls at N = 2880; ws_n_n128, the decode tiling, which N = 5760
# keeps; ws_m_n64, three times the units of ws_m_n192 on the same kernel (a batch-1 call's 4
# experts make 60 units of 192 columns at N = 2880, for 132 SMs). gmm_decode_h100.json also
# holds tilings that lost there (K split into parts among them).
TILINGS = {
    "wg_n64_s4": (64, 64, 64, 4),
    "wg_n64_s8": (64, 64, 64, 8),
    "wg_n192_s4": (64, 192, 64, 4),
    "ws_m_n192_s4": (128, 192, 64, 4, "m"),
    "ws_n_n128_s4": (64, 128, 64, 4, "n"),
    "ws_m_n64_s4": (128, 64, 64, 4, "m"),
}
ROUTINGS = 8


def flat_metrics(res: dict) -> dict:
    """The record's metrics: {shape}_t{tokens}_{tiling}_us / _frac_of_read / _rel_err, and the
    read ceiling."""
    m = {"read_tbps": round(res["read_tbps"], 3)}
    for key, case in res.items():
        if not (key.startswith("t") and isinstance(case, dict)):
            continue
        for name, r in case["tilings"].items():
            for field, value in r.items():
                m[f"{res['shape']}_{key}_{name}_{field}"] = value
    return m


def routings(experts: int, k: int, hidden: int, tokens: int, count: int):
    """`count` (x sorted by expert [tokens * k, K], group sizes) of distinct random routings."""
    out = []
    for i in range(count):
        key_x, key_r = jax.random.split(jax.random.key(100 + i))
        chosen = jnp.argsort(jax.random.uniform(key_r, (tokens, experts)), axis=1)[:, :k]
        flat = chosen.reshape(-1)
        order = jnp.argsort(flat, stable=True)
        x = jax.random.normal(key_x, (tokens, hidden), jnp.bfloat16)
        out.append((x[order // k], jnp.bincount(flat, length=experts).astype(jnp.int32)))
    return out


def run(shape: str, token_counts, read: float, tilings=TILINGS) -> dict:
    """Each tiling at each token count on `shape`, against `read` (the read ceiling, bytes/s)."""
    experts, k_dim, n_dim, top_k = SHAPES[shape]
    tilings = {name: fields for name, fields in tilings.items() if n_dim % fields[1] == 0}
    w = (jax.random.normal(jax.random.key(0), (experts, k_dim, n_dim), jnp.float32)
         * k_dim ** -0.5).astype(jnp.bfloat16)
    res: dict = {"shape": shape, "experts_k_n_topk": SHAPES[shape], "read_tbps": read / 1e12}
    for tokens in token_counts:
        cases = routings(experts, top_k, k_dim, tokens, ROUTINGS)
        touched = [int(jnp.sum(s > 0)) for _, s in cases]
        nbytes = sum(touched) / len(touched) * k_dim * n_dim * 2
        calls, errs = {}, {}
        for name, fields in tilings.items():
            cfg = gm.config_from_fields(fields)
            try:
                xs, sizes = cases[0]
                got = gm.gmm(xs, (w,), sizes, cfg)
                ref = jax.lax.ragged_dot(xs.astype(jnp.float32), w.astype(jnp.float32), sizes)
                errs[name] = round(rel_err(got[:int(sizes.sum())], ref[:int(sizes.sum())]), 5)
            except Exception as e:  # noqa: BLE001 - recorded; the other tilings still run
                errs[name] = f"{type(e).__name__}: {e}"[:200]
                continue
            many = jax.jit(lambda cases, w, cfg=cfg: [gm.gmm(x, (w,), s, cfg) for x, s in cases])
            calls[name] = (many, (cases, w))
        secs = bench_interleaved(calls, reps=5, inner=5)
        row = {}
        for name in tilings:
            if name not in secs:
                row[name] = {"error": errs[name]}
                continue
            us = secs[name] / ROUTINGS * 1e6
            tbps = nbytes / (us * 1e-6) / 1e12
            row[name] = {"us": round(us, 1), "tbps": round(tbps, 3),
                         "frac_of_read": round(tbps * 1e12 / read, 3), "rel_err": errs[name]}
        res[f"t{tokens}"] = {"rows": tokens * top_k, "experts_touched": sum(touched) / len(touched),
                             "bytes_per_call": nbytes, "tilings": row}
    return res


def print_table(res: dict) -> None:
    print(f"{res['shape']}: read ceiling {res['read_tbps']:.2f} TB/s")
    print(f"{'tokens':>6}  {'tiling':<22}{'us':>8}{'TB/s':>8}{'of read':>9}  err")
    for key, case in res.items():
        if not key.startswith("t") or not isinstance(case, dict):
            continue
        for name, r in case["tilings"].items():
            if "error" in r:
                print(f"{key[1:]:>6}  {name:<22}  FAILED {r['error']}")
            else:
                print(f"{key[1:]:>6}  {name:<22}{r['us']:>8}{r['tbps']:>8}{r['frac_of_read']:>9}"
                      f"  {r['rel_err']}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", nargs="+", default=["gpt_oss_20b", "gpt_oss_20b_gate_up"],
                    choices=sorted(SHAPES))
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--json", default=None, help="write the figures here")
    results_io.add_save_arg(ap, "gmm_decode_<gpu>")
    a = ap.parse_args(argv)
    read = max(anchors.read_rates(256 << 20).values())
    results = [run(shape, a.tokens, read) for shape in a.shape]
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    if a.save:
        metrics = {k: v for res in results for k, v in flat_metrics(res).items()}
        results_io.save(a.save, a.name or f"gmm_decode_{results_io.device_slug()}",
                        config=dict(shapes={s: SHAPES[s] for s in a.shape}, tokens=a.tokens,
                                    routings=ROUTINGS, tilings=TILINGS),
                        metrics=metrics)
    for res in results:
        print_table(res)


if __name__ == "__main__":
    main()
