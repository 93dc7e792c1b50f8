"""GPU checks of the paged decode kernels (run on the H200 through the device tool):

1. correctness at real sizes against the float32 oracle (random lengths incl. 0 and partial pages,
   shuffled block tables, GQA 1/4/8, head_dim 64/128, page 16/32, soft-cap), outputs of the previous
   case's NaN-filled buffers freed right before each run so fresh outputs are likely to land on them;
2. the cache write (`reference.write_kv`, an XLA scatter into the donated cache): its time per step
   next to the decode kernel's, and whether XLA did it in place;
3. greedy decoding of a small random model with the kernel equals the reference backend's.

    python3 benchmarks/gpu_check_decode.py        # JSON to $OUT/gpu_check_decode.json if $OUT set
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
                                         paged_decode_mosaic_configured, paged_decode_triton)

KERNELS = {
    "mosaic": paged_decode_mosaic,
    "mosaic_t128": functools.partial(paged_decode_mosaic_configured,
                                     config=MosaicDecodeConfig(tokens_per_step=128)),
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
    for i, (b, hq, hkv, d, page, mb, cap) in enumerate(CASES):
        q, k, v, bt, lens = random_case(i, b, hq, hkv, d, page, mb)
        scale = d ** -0.5
        ref = jax.jit(functools.partial(reference.paged_decode_reference, scale=scale,
                                        softcap=cap))(q.astype(jnp.float32), k, v, bt, lens)
        ref = np.asarray(ref)
        for name, fn in KERNELS.items():
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
    """The cache write of one decode step at the target shape (64 new tokens, Hkv 8, d 128, a
    4-GiB pool), with the cache donated: XLA scatter time and whether it stayed in place."""
    hkv, d, page, nb = 8, 128, 16, 16384 * 8
    k_cache = jnp.zeros((hkv, nb, page, d), jnp.bfloat16)
    v_cache = jnp.zeros((hkv, nb, page, d), jnp.bfloat16)
    res = {}
    for t in (64, 256):
        kn = jax.random.normal(jax.random.key(1), (t, hkv, d), jnp.bfloat16)
        vn = jax.random.normal(jax.random.key(2), (t, hkv, d), jnp.bfloat16)
        slots = jax.random.permutation(jax.random.key(3), nb * page)[:t].astype(jnp.int32)
        f = jax.jit(reference.write_kv, donate_argnums=(0, 1))
        for _ in range(3):
            k_cache, v_cache = f(k_cache, v_cache, kn, vn, slots)
        jax.block_until_ready(k_cache)
        n = 50
        t0 = time.perf_counter()
        for _ in range(n):
            k_cache, v_cache = f(k_cache, v_cache, kn, vn, slots)
        jax.block_until_ready(k_cache)
        us = (time.perf_counter() - t0) / n * 1e6
        hlo = f.lower(k_cache, v_cache, kn, vn, slots).compile().as_text()
        res[f"T{t}"] = {"us_per_step_incl_dispatch": us,
                        "copies_whole_cache": "copy(" in hlo and "bf16[8,131072,16,128]" in hlo}
        log(f"write_kv T={t}: {res[f'T{t}']}")
    return res


def greedy_model_check(log, kernel_name="mosaic", steps=24) -> dict:
    """A small random Llama-shaped model: prefill with the reference backend, then greedy decode
    with (a) the reference backend and (b) the kernel as decode backend; tokens must agree."""
    from jaxinfer.config import config_from_dict
    from jaxinfer.kv_cache.device_cache import allocate_kv_cache
    from jaxinfer.model import forward, init_params

    cfg = config_from_dict({"architectures": ["LlamaForCausalLM"], "vocab_size": 512,
                            "hidden_size": 256, "intermediate_size": 512,
                            "num_hidden_layers": 2, "num_attention_heads": 8,
                            "num_key_value_heads": 2, "head_dim": 128,
                            "max_position_embeddings": 4096})
    params = init_params(cfg, jax.random.key(0), jnp.bfloat16, std=0.2)
    page, batch, max_blocks = 16, 4, 16
    prompt_lens = np.array([5, 17, 33, 60])
    rng = np.random.default_rng(0)
    bt = np.arange(batch * max_blocks).reshape(batch, max_blocks)
    bt = rng.permutation(batch * max_blocks)[bt]
    kernel = KERNELS[kernel_name]
    try:
        full = get_backend(kernel_name.split("_")[0])
        kernel_backend = AttentionBackend(f"{kernel_name}+ref-prefill", decode=kernel,
                                          prefill=reference.ragged_prefill_reference)
        backends = {"reference": get_backend("reference"), "kernel": kernel_backend,
                    "full_backend": full}
    except Exception as e:  # the other kernel family's module may not import yet
        log(f"get_backend({kernel_name}) failed: {e}")
        backends = {"reference": get_backend("reference"),
                    "kernel": AttentionBackend("k", decode=kernel,
                                               prefill=reference.ragged_prefill_reference)}

    def slots_for(pos):  # pos: [S] token positions
        return jnp.asarray(bt[np.arange(batch), pos // page] * page + pos % page, jnp.int32)

    step = jax.jit(forward, static_argnames=("cfg", "backend"), donate_argnums=(4,))

    def run(backend):
        cache = allocate_kv_cache(cfg, batch * max_blocks, page)
        prompts = [rng_prompt(i, n) for i, n in enumerate(prompt_lens)]
        ids = np.concatenate(prompts)
        pos = np.concatenate([np.arange(n) for n in prompt_lens])
        seq = np.repeat(np.arange(batch), prompt_lens)
        slots = jnp.asarray(bt[seq, pos // page] * page + pos % page, jnp.int32)
        qsl = jnp.asarray(np.concatenate([[0], np.cumsum(prompt_lens)]), jnp.int32)
        md = AttentionMetadata(slots, qsl, jnp.asarray(prompt_lens, jnp.int32),
                               jnp.asarray(bt, jnp.int32), num_decodes=0)
        last = jnp.asarray(np.cumsum(prompt_lens) - 1, jnp.int32)
        logits, cache = step(params, cfg, jnp.asarray(ids, jnp.int32), jnp.asarray(pos, jnp.int32),
                             cache, md, backend=get_backend("reference"), logits_indices=last)
        tok = jnp.argmax(logits, -1).astype(jnp.int32)
        out, lens = [np.asarray(tok)], prompt_lens.copy()
        logit_trace = []
        for _ in range(steps):
            md = AttentionMetadata(slots_for(lens), jnp.arange(batch + 1, dtype=jnp.int32),
                                   jnp.asarray(lens + 1, jnp.int32), jnp.asarray(bt, jnp.int32),
                                   num_decodes=batch)
            logits, cache = step(params, cfg, tok, jnp.asarray(lens, jnp.int32), cache, md,
                                 backend=backend)
            logit_trace.append(np.asarray(logits))
            tok = jnp.argmax(logits, -1).astype(jnp.int32)
            out.append(np.asarray(tok))
            lens = lens + 1
        return np.stack(out, 1), logit_trace

    def rng_prompt(i, n):
        return np.random.default_rng(100 + i).integers(0, cfg.vocab_size, n)

    ref_tokens, ref_logits = run(backends["reference"])
    res = {}
    for name, be in backends.items():
        if name == "reference":
            continue
        try:
            toks, logits = run(be)
            diff = max(float(np.abs(a - b).max()) for a, b in zip(logits, ref_logits))
            res[name] = {"tokens_equal": bool((toks == ref_tokens).all()),
                         "max_logit_diff": diff, "tokens": toks[:, :8].tolist()}
        except Exception as e:
            res[name] = {"error": f"{type(e).__name__}: {str(e)[:800]}"}
        log(f"greedy {name}: {res[name]}")
    res["reference_tokens"] = ref_tokens[:, :8].tolist()
    return res


def main():
    log = lambda s: print(s, flush=True)
    result = {"device": str(jax.devices()[0])}
    for name, fn in [("correctness", check_correctness), ("write_kv", time_write_kv),
                     ("greedy", greedy_model_check)]:
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
