"""GPU checks of the paged decode kernels (run on the H200 through the device tool):

1. correctness at real sizes against the float32 oracle (random lengths incl. 0 and partial pages,
   shuffled block tables, GQA 1/4/8, head_dim 64/128, page 16/32, soft-cap), outputs of the previous
   case's NaN-filled buffers freed right before each run so fresh outputs are likely to land on them;
2. the cache write (`reference.write_kv`, an XLA scatter into the donated cache): its time per step
   next to the decode kernel's, and whether XLA did it in place;
3. greedy decoding of a small random model with the kernel equals the reference backend's.

    python3 benchmarks/gpu_check_decode.py        # JSON to $OUT/gpu_check_decode.json if $OUT set
    CHECKS=greedy,write_kv python3 benchmarks/gpu_check_decode.py    # a subset
    KERNELS=mosaic,mosaic_t128 python3 benchmarks/gpu_check_decode.py  # correctness of a subset
"""

from __future__ import annotations

import functools
import json
import os
import time
import traceback

import numpy as np

import jax
import jax.numpy as jnp

from pallas_kernels import reference
from pallas_kernels.backend import AttentionBackend, get_backend
from pallas_kernels.metadata import AttentionMetadata
from pallas_kernels.paged_decode import (MosaicDecodeConfig, paged_decode_mosaic,
                                         paged_decode_triton)

KERNELS = {
    "mosaic": paged_decode_mosaic,
    "mosaic_t128": functools.partial(paged_decode_mosaic,
                                     config=MosaicDecodeConfig(tokens_per_step=128)),
    "mosaic_s1": functools.partial(paged_decode_mosaic,
                                   config=MosaicDecodeConfig(num_splits=1)),
    "mosaic_xla_combine": functools.partial(paged_decode_mosaic,
                                            config=MosaicDecodeConfig(combine_kernel=False)),
    "triton": paged_decode_triton,
}

# (batch, hq, hkv, d, page, max_blocks, softcap)
CASES = [
    (64, 32, 8, 128, 16, 256, None),  # the target shape, random lengths up to 4096
    (3, 32, 8, 128, 16, 2048, None),  # few sequences, long contexts: many splits
    (33, 8, 8, 64, 32, 40, None),     # GQA 1, d 64, page 32
    (17, 32, 4, 128, 32, 64, 50.0),   # GQA 8, soft-cap
    (5, 16, 4, 64, 16, 100, None),    # GQA 4, d 64
]


def random_case(seed, batch, hq, hkv, d, page, max_blocks):
    rng = np.random.default_rng(seed)
    num_blocks = batch * max_blocks + 7
    ks = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(ks[0], (batch, hq, d), jnp.bfloat16)
    k = jax.random.normal(ks[1], (hkv, num_blocks, page, d), jnp.bfloat16)
    v = jax.random.normal(ks[2], (hkv, num_blocks, page, d), jnp.bfloat16)
    cap = max_blocks * page
    lens = rng.integers(1, cap + 1, batch)
    lens[: min(batch, 3)] = [0, 1, cap][: min(batch, 3)]
    rng.shuffle(lens)
    bt = rng.permutation(num_blocks)[: batch * max_blocks].reshape(batch, max_blocks)
    bt = np.where(np.arange(max_blocks)[None] < -(-lens[:, None] // page), bt, 0)
    return q, k, v, jnp.asarray(bt, jnp.int32), jnp.asarray(lens, jnp.int32)


def check_correctness(log) -> dict:
    out = {}
    names = [n for n in os.environ.get("KERNELS", ",".join(KERNELS)).split(",") if n]
    for i, (b, hq, hkv, d, page, mb, cap) in enumerate(CASES):
        q, k, v, bt, lens = random_case(i, b, hq, hkv, d, page, mb)
        scale = d ** -0.5
        ref = jax.jit(functools.partial(reference.paged_decode_reference, scale=scale,
                                        softcap=cap))(q.astype(jnp.float32), k, v, bt, lens)
        ref = np.asarray(ref)
        for name, fn in [(n, KERNELS[n]) for n in names]:
            key = f"B{b}_hq{hq}_hkv{hkv}_d{d}_p{page}_M{mb}_cap{cap}/{name}"
            try:
                poison = jnp.full((b, hq, d), jnp.nan, jnp.bfloat16)  # freed just before the run
                jax.block_until_ready(poison)
                del poison
                o = np.asarray(jax.jit(functools.partial(fn, scale=scale, softcap=cap))(
                    q, k, v, bt, lens).astype(jnp.float32))
                rel = float(np.linalg.norm(o - ref) / np.linalg.norm(ref))
                rec = {"rel_err": rel, "max_abs": float(np.abs(o - ref).max()),
                       "finite": bool(np.isfinite(o).all()),
                       "zero_rows_ok": bool((o[np.asarray(lens) == 0] == 0).all())}
                rec["ok"] = rec["finite"] and rec["zero_rows_ok"] and rel < 1e-2
            except Exception as e:
                rec = {"ok": False, "error": f"{type(e).__name__}: {str(e)[:1500]}"}
                traceback.print_exc()
            out[key] = rec
            log(f"{key}: {rec}")
    return out


def time_write_kv(log) -> dict:
    """The cache write of one decode step at the target shape (Hkv 8, d 128, a 4-GiB pool per K
    and V), cache donated: 16 writes chained in one jit, queued; and whether XLA kept it in place
    (no copy of the whole cache in the compiled HLO)."""
    hkv, d, page, nb = 8, 128, 16, 16384 * 8
    k_cache = jnp.zeros((hkv, nb, page, d), jnp.bfloat16)
    v_cache = jnp.zeros((hkv, nb, page, d), jnp.bfloat16)
    res = {}
    r = 16
    for t in (64, 256):
        kn = jax.random.normal(jax.random.key(1), (r, t, hkv, d), jnp.bfloat16)
        vn = jax.random.normal(jax.random.key(2), (r, t, hkv, d), jnp.bfloat16)
        slots = jax.random.permutation(jax.random.key(3), nb * page)[: r * t]
        slots = slots.astype(jnp.int32).reshape(r, t)

        def chain(k_cache, v_cache, kn, vn, slots):
            for i in range(r):
                k_cache, v_cache = reference.write_kv(k_cache, v_cache, kn[i], vn[i], slots[i])
            return k_cache, v_cache

        f = jax.jit(chain, donate_argnums=(0, 1))
        for _ in range(3):
            k_cache, v_cache = f(k_cache, v_cache, kn, vn, slots)
        jax.block_until_ready(k_cache)
        n = 20
        t0 = time.perf_counter()
        for _ in range(n):
            k_cache, v_cache = f(k_cache, v_cache, kn, vn, slots)
        jax.block_until_ready(k_cache)
        us = (time.perf_counter() - t0) / (n * r) * 1e6
        hlo = f.lower(k_cache, v_cache, kn, vn, slots).compile().as_text()
        res[f"T{t}"] = {"us_per_write": us,
                        "copies_whole_cache": any(
                            " copy(" in ln and f"bf16[{hkv},{nb},{page},{d}]" in ln
                            for ln in hlo.splitlines())}
        log(f"write_kv T={t}: {res[f'T{t}']}")
    return res


def greedy_model_check(log, kernel_name="mosaic", steps=24) -> dict:
    """A small random Llama-shaped model (fp32 weights, bf16 KV cache): prefill with the reference
    backend, then greedy decode with the reference backend and with the kernel as the decode
    backend. Reports whether the free-running greedy tokens are equal, and, teacher-forced on the
    reference's tokens, the top-1 agreement and the largest logit difference (so a flip at a
    near-tie is told apart from a wrong kernel)."""
    from jaxinfer.model.config import config_from_dict
    from jaxinfer.core.kv_cache.device_cache import allocate_kv_cache
    from jaxinfer.model.transformer import forward, init_params

    cfg = config_from_dict({"architectures": ["LlamaForCausalLM"], "vocab_size": 512,
                            "hidden_size": 256, "intermediate_size": 512,
                            "num_hidden_layers": 2, "num_attention_heads": 8,
                            "num_key_value_heads": 2, "head_dim": 128,
                            "max_position_embeddings": 4096})
    params = init_params(cfg, jax.random.key(0), jnp.float32, std=0.1)
    page, batch, max_blocks = 16, 4, 16
    prompt_lens = np.array([5, 17, 33, 60])
    rng = np.random.default_rng(0)
    bt = rng.permutation(batch * max_blocks).reshape(batch, max_blocks)
    kernel = KERNELS[kernel_name]
    backends = {"kernel": AttentionBackend(f"{kernel_name}+reference-prefill", decode=kernel,
                                           prefill=reference.ragged_prefill_reference)}
    try:
        backends["full_backend"] = get_backend(kernel_name.split("_")[0])
    except Exception as e:  # the prefill kernel's module may not import yet
        log(f"get_backend({kernel_name}) failed: {e}")
    ref_backend = get_backend("reference")
    step = jax.jit(forward, static_argnames=("cfg", "backend"), donate_argnums=(4,))
    prompts = [np.random.default_rng(100 + i).integers(0, cfg.vocab_size, n)
               for i, n in enumerate(prompt_lens)]

    def run(backend, forced=None):
        cache = allocate_kv_cache(cfg, batch * max_blocks, page, jnp.bfloat16)
        pos = np.concatenate([np.arange(n) for n in prompt_lens])
        seq = np.repeat(np.arange(batch), prompt_lens)
        slots = jnp.asarray(bt[seq, pos // page] * page + pos % page, jnp.int32)
        qsl = jnp.asarray(np.concatenate([[0], np.cumsum(prompt_lens)]), jnp.int32)
        md = AttentionMetadata(slots, qsl, jnp.asarray(prompt_lens, jnp.int32),
                               jnp.asarray(bt, jnp.int32), num_decodes=0)
        last = jnp.asarray(np.cumsum(prompt_lens) - 1, jnp.int32)
        logits, cache = step(params, cfg, jnp.asarray(np.concatenate(prompts), jnp.int32),
                             jnp.asarray(pos, jnp.int32), cache, md, backend=ref_backend,
                             logits_indices=last)
        tok = np.asarray(jnp.argmax(logits, -1), np.int32)
        toks, all_logits, lens = [tok], [], prompt_lens.copy()
        for i in range(steps):
            feed = tok if forced is None else forced[:, i]
            slots = jnp.asarray(bt[np.arange(batch), lens // page] * page + lens % page, jnp.int32)
            md = AttentionMetadata(slots, jnp.arange(batch + 1, dtype=jnp.int32),
                                   jnp.asarray(lens + 1, jnp.int32), jnp.asarray(bt, jnp.int32),
                                   num_decodes=batch)
            logits, cache = step(params, cfg, jnp.asarray(feed, jnp.int32),
                                 jnp.asarray(lens, jnp.int32), cache, md, backend=backend)
            all_logits.append(np.asarray(logits))
            tok = np.asarray(jnp.argmax(logits, -1), np.int32)
            toks.append(tok)
            lens = lens + 1
        return np.stack(toks, 1), np.stack(all_logits, 1)  # [S, steps+1], [S, steps, V]

    ref_tokens, ref_logits = run(ref_backend)
    res = {"reference_tokens_head": ref_tokens[:, :8].tolist()}
    for name, be in backends.items():
        try:
            toks, _ = run(be)
            _, forced_logits = run(be, forced=ref_tokens)
            agree = (forced_logits.argmax(-1) == ref_logits.argmax(-1))
            top2 = np.sort(ref_logits, -1)[..., -2:]
            margins = (top2[..., 1] - top2[..., 0])[~agree]
            res[name] = {"greedy_tokens_equal": bool((toks == ref_tokens).all()),
                         "first_divergence_step": int(np.argmax((toks != ref_tokens).any(0)))
                         if (toks != ref_tokens).any() else None,
                         "teacher_forced_top1_agreement": float(agree.mean()),
                         "teacher_forced_max_logit_diff": float(np.abs(forced_logits
                                                                       - ref_logits).max()),
                         "logit_std": float(ref_logits.std()),
                         "ref_margin_where_disagree": margins.tolist()[:8]}
        except Exception as e:
            res[name] = {"error": f"{type(e).__name__}: {str(e)[:800]}"}
            traceback.print_exc()
        log(f"greedy {name}: {res[name]}")
    return res


def main():
    log = lambda s: print(s, flush=True)
    result = {"device": str(jax.devices()[0])}
    parts = [p for p in os.environ.get("CHECKS", "correctness,write_kv,greedy").split(",") if p]
    checks = {"correctness": check_correctness, "write_kv": time_write_kv,
              "greedy": greedy_model_check}
    for name, fn in [(p, checks[p]) for p in parts]:
        try:
            result[name] = fn(log)
        except Exception as e:
            traceback.print_exc()
            result[name] = {"error": f"{type(e).__name__}: {str(e)[:1500]}"}
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "gpu_check_decode.json"), "w") as fh:
            json.dump(result, fh, indent=1)
    bad = [k for k, r in result.get("correctness", {}).items() if not r.get("ok")]
    print("correctness failures:", bad or "none")
    return result


if __name__ == "__main__":
    main()
