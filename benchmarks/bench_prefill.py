"""Flash prefill attention on the GPU: correctness at real sizes, timing beside the anchors, and the
greedy-output check of a small random model.

    python3 benchmarks/bench_prefill.py [--skip-model] [--quick]     # JSON -> $OUT/bench_prefill.json
    python3 benchmarks/bench_prefill.py --sweep default,s3 [--check s3] [--tag T]

Sections (each isolated: a failure is recorded and the rest still runs):
  correctness  Mosaic GPU dense (causal / not, bf16 / f16, d 64 / 128, GQA, ragged L, soft-cap),
               Mosaic and Triton ragged paged prefill on random batches vs the float32 references.
  timing       dense causal B1 S8192 and B2 S4096, non-causal B2 S4096 (Hq 32 / Hkv 8, d 128):
               ours (Mosaic, bf16 and f16), cuDNN and XLA through jax.nn.dot_product_attention,
               jax's bundled attention_mgpu (f16 only) and Triton mha (K/V repeated);
               paged chunk: 8 sequences x 512 new tokens over 8192 cached (page 16 and 32), ours
               Mosaic paged, Mosaic over contiguous K/V (the cost of paging), Triton paged.
  model        greedy tokens of a small random model: flash prefill backend vs the reference one.
--sweep times the named kernel configurations of SWEEP (flash_config.KernelConfig; "all" = every one)
beside cuDNN / attention_mgpu only (every output compared with cuDNN's), runs the small correctness
cases for the --check ones, and skips Triton, XLA and the model: each configuration compiles its
own kernels, so a call stays short. --tag names the JSON (bench_prefill_T.json), so several sweeps
can run as separate processes of one call (a hang in one loses only its own results).
TF/s counts only visible (unmasked) query-key pairs: 4 * D * Hq * pairs (causal ~ half the square).
`run(out_dir)` is what benchmarks/bench_kernels.py calls.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from pallas_kernels import flash_mgpu, reference  # noqa: E402
from pallas_kernels import flash_prefill as fp  # noqa: E402
from pallas_kernels.flash_config import KernelConfig  # noqa: E402
from pallas_kernels.testing import random_paged_batch  # noqa: E402

HQ, HKV, D = 32, 8, 128
DENSE_SHAPES = [(1, 8192, True), (2, 4096, True), (2, 4096, False)]  # (B, L, causal)

# Kernel configurations compared side by side by --sweep: the default (the production kernel)
# and single-knob changes of it.
SWEEP = {
    "default": KernelConfig(),
    "s3": KernelConfig(stages=3),
    "kv192": KernelConfig(block_kv=192),
    "r232": KernelConfig(consumer_registers=232, producer_registers=40),
    "lazy4": KernelConfig(rescale_threshold=4.0),
}


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


# ----------------------------------------------------------------------------------- correctness
def check_dense(results, configs=None, small_only=False):
    configs = configs or {"default": None}
    cases = [  # (B, L, Hq, Hkv, D, causal, dtype, softcap, q gain)
        (2, 1024, 8, 2, 128, True, jnp.bfloat16, None, 1.0),
        (2, 1000, 8, 8, 64, True, jnp.float16, None, 1.0),
        (1, 777, 4, 1, 128, False, jnp.bfloat16, None, 1.0),
        (1, 513, 8, 1, 64, True, jnp.bfloat16, 30.0, 1.0),
        # Wide logits (std ~12): row maxima jump by more than the lazy threshold mid-item, so
        # the rescale and the stale-max redo run on steps other than an item's first.
        (1, 900, 4, 1, 128, True, jnp.bfloat16, None, 12.0),
        (2, 700, 8, 2, 64, False, jnp.float16, None, 12.0),
        (1, 8192, HQ, HKV, D, True, jnp.bfloat16, None, 1.0),
        (2, 4096, HQ, HKV, D, False, jnp.bfloat16, None, 1.0),
    ]
    if small_only:  # a sweep: the real-size cases are covered by the timing's check
        cases = [c for c in cases if c[1] < 4096]
    for i, (b, l, hq, hkv, d, causal, dt, cap, gain) in enumerate(cases):
        base = (f"dense_B{b}_L{l}_Hq{hq}_Hkv{hkv}_d{d}_{'causal' if causal else 'full'}_"
                f"{jnp.dtype(dt).name}" + (f"_cap{cap}" if cap else "")
                + (f"_gain{gain:g}" if gain != 1 else ""))
        ks = jax.random.split(jax.random.key(100 + i), 3)
        q, k, v = ((gain * _normal(ks[0], (b, l, hq, d), jnp.float32)).astype(dt),
                   _normal(ks[1], (b, l, hkv, d), dt), _normal(ks[2], (b, l, hkv, d), dt))
        ref = jax.jit(functools.partial(reference.causal_attention_reference, scale=d ** -0.5,
                                        softcap=cap, causal=causal))(q, k, v)
        for cname, cfg in configs.items():
            name = base if cname == "default" else f"{base}_{cname}"
            try:
                f = jax.jit(functools.partial(fp.flash_attention, causal=causal, scale=d ** -0.5,
                                              softcap=cap, config=cfg))
                results[name] = {"rel_err": rel_err(f(q, k, v), ref)}
            except Exception as e:  # noqa: BLE001 - record and go on
                results[name] = {"error": "".join(traceback.format_exception_only(type(e), e))[-800:]}
            print(name, results[name], flush=True)


PAGED_CASES = [  # (Hq, Hkv, D, block, q_lens, prefixes, extra padding tokens, softcap)
    (4, 1, 64, 16, [37, 1, 130, 300], [0, 20, 45, 1000], 5, None),
    (8, 8, 128, 32, [5, 200, 129], [300, 0, 17], 0, None),
    (32, 4, 128, 16, [1, 64, 65, 128, 257], [0, 127, 3, 500, 2048], 11, None),
    (16, 2, 64, 32, [700, 3], [33, 4000], 3, 50.0),
    (HQ, HKV, D, 16, [512] * 2, [8192] * 2, 0, None),  # real-size chunk (reference memory: S=2)
]


def check_paged(results, which, configs=None):
    """which: "triton" and/or Mosaic configuration names of `configs` (None: the default)."""
    configs = configs or {}
    rng = np.random.default_rng(7)
    for i, (hq, hkv, d, bs, ql, pre, extra, cap) in enumerate(PAGED_CASES):
        for dt in (jnp.bfloat16,) if i != 1 else (jnp.bfloat16, jnp.float16):
            args = random_paged_batch(rng, hq=hq, hkv=hkv, d=d, block_size=bs, q_lens=ql,
                                      prefixes=pre, dtype=dt, extra_tokens=extra)
            ref = jax.jit(functools.partial(reference.ragged_prefill_reference,
                                            scale=d ** -0.5, softcap=cap))(*args)
            for impl in which:
                label = {"default": "mosaic", "triton": "triton"}.get(impl, f"mosaic_{impl}")
                name = f"paged_{label}_Hq{hq}_Hkv{hkv}_d{d}_bs{bs}_S{len(ql)}_{jnp.dtype(dt).name}" + (f"_cap{cap}" if cap else "")
                try:
                    fn = fp.flash_prefill_triton if impl == "triton" else functools.partial(
                        fp.flash_prefill_mosaic, config=configs.get(impl))
                    out = jax.jit(functools.partial(fn, scale=d ** -0.5, softcap=cap))(*args)
                    t_used = int(args[3][-1])
                    results[name] = {"rel_err": rel_err(out[:t_used], ref[:t_used]),
                                     "padding_max_abs": float(jnp.abs(out[t_used:].astype(jnp.float32)).max()) if extra else 0.0}
                except Exception as e:  # noqa: BLE001
                    results[name] = {"error": "".join(traceback.format_exception_only(type(e), e))[-800:]}
                print(name, results[name], flush=True)


# ---------------------------------------------------------------------------------------- timing
def dense_flops(b, l, causal):
    pairs = l * (l + 1) / 2 if causal else l * l
    return 4 * D * HQ * b * pairs


def time_dense(results, quick=False, sweep=()):
    from jax.experimental.pallas.ops.gpu import attention as tri_mha
    from jax.experimental.pallas.ops.gpu import attention_mgpu as am

    shapes = DENSE_SHAPES
    sm = D ** -0.5
    for b, l, causal in shapes:
        key = f"dense_B{b}_S{l}_{'causal' if causal else 'noncausal'}"
        row = results.setdefault(key, {})
        fl = dense_flops(b, l, causal)
        ks = jax.random.split(jax.random.key(b * l), 3)
        inputs = {dt: (_normal(ks[0], (b, l, HQ, D), dt), _normal(ks[1], (b, l, HKV, D), dt),
                       _normal(ks[2], (b, l, HKV, D), dt)) for dt in (jnp.bfloat16, jnp.float16)}
        rep = HQ // HKV
        impls = {
            "ours_mosaic_bf16": (jnp.bfloat16, lambda q, k, v: fp.flash_attention(q, k, v, causal=causal, scale=sm)),
            "ours_mosaic_f16": (jnp.float16, lambda q, k, v: fp.flash_attention(q, k, v, causal=causal, scale=sm)),
            "cudnn_bf16": (jnp.bfloat16, lambda q, k, v: jax.nn.dot_product_attention(q, k, v, scale=sm, is_causal=causal, implementation="cudnn")),
            "cudnn_f16": (jnp.float16, lambda q, k, v: jax.nn.dot_product_attention(q, k, v, scale=sm, is_causal=causal, implementation="cudnn")),
            "xla_bf16": (jnp.bfloat16, lambda q, k, v: jax.nn.dot_product_attention(q, k, v, scale=sm, is_causal=causal, implementation="xla")),
            "jax_attention_mgpu_f16": (jnp.float16, lambda q, k, v: am.attention(
                (q * sm).astype(q.dtype), k, v, am.TuningConfig(block_q=64, block_kv=128, max_concurrent_steps=2, causal=causal))),
            "jax_triton_mha_bf16": (jnp.bfloat16, lambda q, k, v: tri_mha.mha(
                q, jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2), None, sm_scale=sm, causal=causal)),
        }
        if quick:
            impls = {k: impls[k] for k in ("ours_mosaic_bf16", "cudnn_bf16")}
        if sweep:
            impls = {k: impls[k] for k in ("cudnn_bf16", "jax_attention_mgpu_f16")}
            for cname in sweep:
                cfg = SWEEP[cname]
                impls[f"ours_{cname}"] = (jnp.bfloat16, functools.partial(
                    lambda q, k, v, cfg: fp.flash_attention(q, k, v, causal=causal, scale=sm,
                                                            config=cfg), cfg=cfg))
        ref, ready = {}, {}
        for name, (dt, f) in impls.items():
            try:
                fj = jax.jit(f)
                args = inputs[dt]
                t0 = time.perf_counter()
                out = jax.block_until_ready(fj(*args))
                first = time.perf_counter() - t0
                if dt not in ref:  # cuDNN in the same dtype is the check (f32 reference too big)
                    ref[dt] = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
                        q, k, v, scale=sm, is_causal=causal, implementation="cudnn"))(*args)
                row[name] = {"rel_err_vs_cudnn": round(rel_err(out, ref[dt]), 5),
                             "first_call_s": round(first, 1)}
                ready[name] = (fj, args)
            except Exception as e:  # noqa: BLE001
                row[name] = {"error": "".join(traceback.format_exception_only(type(e), e))[-500:]}
        _record_times(key, row, ready, fl)


def time_paged(results, quick=False, sweep=()):
    s, new, cached = 8, 512, 8192
    ctx = new + cached
    fl = 4 * D * HQ * s * (new * cached + new * (new + 1) / 2)
    rng = np.random.default_rng(3)
    sm = D ** -0.5
    for bs in (16, 32):
        key = f"paged_chunk_S{s}_new{new}_cached{cached}_page{bs}"
        row = results.setdefault(key, {})
        args = random_paged_batch(rng, hq=HQ, hkv=HKV, d=D, block_size=bs, q_lens=[new] * s,
                                  prefixes=[cached] * s, dtype=jnp.bfloat16)
        q, k_cache, v_cache, qsl, lens, tables = args
        # The same keys laid out contiguously, token-major: what the paging costs.
        k_flat = reference.gather_context(k_cache, tables)[:, :ctx].reshape(s * ctx, HKV, D)
        v_flat = reference.gather_context(v_cache, tables)[:, :ctx].reshape(s * ctx, HKV, D)
        starts = qsl[:-1]
        tiles = fp.tile_table(starts, qsl[1:] - starts, lens, jnp.arange(s, dtype=jnp.int32) * ctx // 8,
                              q.shape[0], causal=True)
        contiguous = lambda q, k, v, tiles: flash_mgpu.mosaic_attention(
            q, k, v, tiles, jnp.zeros((1, 1), jnp.int32), kv_mode="contiguous", causal=True,
            scale=sm, softcap=None, config=KernelConfig())
        impls = {
            "ours_mosaic_paged": (fp.flash_prefill_mosaic, args),
            "ours_mosaic_contiguous_kv": (contiguous, (q, k_flat, v_flat, tiles)),
            "ours_triton_paged": (fp.flash_prefill_triton, args),
        }
        if quick or sweep or bs != 16:
            impls.pop("ours_triton_paged")
        if sweep:
            impls = {f"ours_mosaic_paged_{cname}": (functools.partial(
                fp.flash_prefill_mosaic, config=SWEEP[cname]), args) for cname in sweep}
        ref, ready = None, {}
        for name, (f, a) in impls.items():
            try:
                fj = jax.jit(functools.partial(f, scale=sm, softcap=None)) if f is not contiguous else jax.jit(f)
                out = fj(*a)
                if ref is None:
                    ref = out
                row[name] = {"rel_diff_vs_mosaic_paged": round(rel_err(out, ref), 5)}
                ready[name] = (fj, a)
            except Exception as e:  # noqa: BLE001
                row[name] = {"error": "".join(traceback.format_exception_only(type(e), e))[-500:]}
        _record_times(key, row, ready, fl)


def _record_times(key, row, ready, flops):
    """Times the compiled calls of one shape side by side (interleaved) into row[name]."""
    for name, t in bench_interleaved(ready).items():
        row[name] = {"ms": round(t * 1e3, 3), "TFLOPs": round(flops / t / 1e12, 1), **row[name]}
    for name in row:
        print(key, name, row[name], flush=True)


# ------------------------------------------------------------------------------- model greedy
def model_greedy(results):
    from jaxinfer.model.config import config_from_dict
    from jaxinfer.core.kv_cache.device_cache import allocate_kv_cache
    from jaxinfer.model.transformer import forward, init_params
    from pallas_kernels.backend import REFERENCE, AttentionBackend
    from pallas_kernels.metadata import AttentionMetadata

    cfg = config_from_dict(dict(architectures=["LlamaForCausalLM"], vocab_size=512, hidden_size=512,
                                intermediate_size=1024, num_hidden_layers=2, num_attention_heads=8,
                                num_key_value_heads=2, max_position_embeddings=4096))
    params = init_params(cfg, jax.random.key(0), jnp.bfloat16, std=0.1)
    bs, nb, m = 16, 256, 32
    flash = AttentionBackend("flash", decode=reference.paged_decode_reference, prefill=fp.flash_prefill_mosaic)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (37, 150, 300)]
    tables = np.arange(len(prompts) * m, dtype=np.int32).reshape(len(prompts), m)

    def step(backend, kv, seqs, starts, num_decodes):
        """seqs[i]: token list of sequence i; the tokens from starts[i] on are new this step."""
        toks, pos, slots, qsl = [], [], [], [0]
        for i, (sq, st) in enumerate(zip(seqs, starts)):
            for p in range(st, len(sq)):
                toks.append(sq[p]); pos.append(p)
                slots.append(int(tables[i, p // bs]) * bs + p % bs)
            qsl.append(len(toks))
        md = AttentionMetadata(slot_mapping=jnp.asarray(slots, jnp.int32),
                               query_start_loc=jnp.asarray(qsl, jnp.int32),
                               seq_lens=jnp.asarray([len(sq) for sq in seqs], jnp.int32),
                               block_tables=jnp.asarray(tables), num_decodes=num_decodes)
        last = jnp.asarray(qsl[1:], jnp.int32) - 1
        logits, kv = jax.jit(forward, static_argnums=(1, 6))(
            params, cfg, jnp.asarray(toks, jnp.int32), jnp.asarray(pos, jnp.int32), kv, md, backend, last)
        return logits, kv

    def generate(backend, n_new=12):
        kv = allocate_kv_cache(cfg, nb, bs, jnp.bfloat16)
        seqs = [list(p) for p in prompts]
        # Chunked prefill: first half of every prompt, then the rest over the cached prefix.
        half = [len(p) // 2 for p in prompts]
        _, kv = step(backend, kv, [s[:h] for s, h in zip(seqs, half)], [0] * len(seqs), 0)
        logits, kv = step(backend, kv, seqs, half, 0)
        all_logits = [logits]
        for _ in range(n_new):
            nxt = np.asarray(jnp.argmax(logits, -1))
            for s, t in zip(seqs, nxt):
                s.append(int(t))
            logits, kv = step(backend, kv, seqs, [len(s) - 1 for s in seqs], len(seqs))
            all_logits.append(logits)
        return [s[len(p):] for s, p in zip(seqs, prompts)], jnp.stack(all_logits)

    ref_tokens, ref_logits = generate(REFERENCE)
    flash_tokens, flash_logits = generate(flash)
    results["model_greedy"] = {
        "tokens_equal": ref_tokens == flash_tokens,
        "reference_tokens": ref_tokens, "flash_tokens": flash_tokens,
        "first_step_logits_rel_err": rel_err(flash_logits[0], ref_logits[0]),
    }
    print("model_greedy", results["model_greedy"], flush=True)


def run(out_dir: str | None = None, *, skip_model: bool = False, quick: bool = False,
        sweep: tuple[str, ...] = (), sweep_paged: tuple[str, ...] | None = None,
        check: tuple[str, ...] = (), tag: str = "") -> dict:
    results = {"jax": jax.__version__, "device": str(jax.devices()[0]), "correctness": {},
               "timing": {}, "default_config": str(KernelConfig())}
    if sweep:
        sweep_paged = sweep if sweep_paged is None else sweep_paged
        unknown = [c for c in (*sweep, *sweep_paged, *check) if c not in SWEEP]
        if unknown:
            raise ValueError(f"unknown configurations {unknown}; SWEEP has {list(SWEEP)}")
        results["sweep"] = {k: str(SWEEP[k]) for k in sweep}
        checked = {k: SWEEP[k] for k in check}
        sections = [  # timing first: the part a short call must not lose
            ("time_dense", lambda: time_dense(results["timing"], sweep=sweep)),
            ("dense", lambda: check_dense(results["correctness"], checked, small_only=True) if checked else None),
            ("paged", lambda: check_paged(results["correctness"], check, checked) if check else None),
            ("time_paged", lambda: time_paged(results["timing"], sweep=sweep_paged)),
        ]
        skip_model = True
    else:
        sections = [
            ("dense", lambda: check_dense(results["correctness"])),
            ("paged", lambda: check_paged(results["correctness"], ("default", "triton"))),
            ("time_dense", lambda: time_dense(results["timing"], quick)),
            ("time_paged", lambda: time_paged(results["timing"], quick)),
        ]
    if not skip_model:
        sections.append(("model", lambda: model_greedy(results)))
    out_dir = out_dir or os.environ.get("OUT", "/tmp")
    for name, fn in sections:
        t0 = time.time()
        try:
            fn()
        except Exception as e:  # noqa: BLE001
            results[f"{name}_error"] = "".join(traceback.format_exception(type(e), e, e.__traceback__))[-1500:]
            print(name, "FAILED", results[f"{name}_error"], flush=True)
        results[f"{name}_wall_s"] = round(time.time() - t0, 1)
        with open(os.path.join(out_dir, f"bench_prefill{'_' + tag if tag else ''}.json"), "w") as f:
            json.dump(results, f, indent=1)
    print_table(results)
    return results


def print_table(results):
    print("\n== correctness (rel err vs f32 reference) ==")
    for k, v in results["correctness"].items():
        print(f"  {k:60s} {v.get('rel_err', v.get('error', ''))!s:.80}")
    print("\n== timing ==")
    for shape, row in results["timing"].items():
        cudnn = row.get("cudnn_bf16", {}).get("TFLOPs")
        for impl, v in row.items():
            tf = v.get("TFLOPs")
            ratio = f"{tf / cudnn:.2f}x cuDNN" if tf and cudnn else ""
            print(f"  {shape:42s} {impl:28s} {v.get('ms', '')!s:>9} ms {tf!s:>7} TF/s {ratio} {str(v.get('error', ''))[:60]}")
    if "model_greedy" in results:
        print("\nmodel greedy tokens equal:", results["model_greedy"]["tokens_equal"])


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--skip-model", action="store_true")
    ap.add_argument("--quick", action="store_true", help="ours vs cuDNN only")
    ap.add_argument("--sweep", default="", help="comma list of SWEEP configurations to time, or all")
    ap.add_argument("--sweep-paged", help="comma list for the paged chunk (default: --sweep's)")
    ap.add_argument("--check", default="", help="comma list of SWEEP configurations to check")
    ap.add_argument("--tag", default="", help="JSON name suffix")
    ns = ap.parse_args()
    names = lambda x: tuple(SWEEP) if x == "all" else tuple(c for c in x.split(",") if c)
    run(skip_model=ns.skip_model, quick=ns.quick, sweep=names(ns.sweep),
        sweep_paged=None if ns.sweep_paged is None else names(ns.sweep_paged),
        check=names(ns.check), tag=ns.tag)
