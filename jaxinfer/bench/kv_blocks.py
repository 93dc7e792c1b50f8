"""The disaggregated hand-over's block gather and scatter (jaxinfer/disagg/transfer.py) on one
device, against a plain copy of as many bytes: the scatter runs on the decode GPU between decode
steps, so its time is added to one inter-token gap of every running stream (issue 27's ITL p99).

    jaxinfer bench kernels --only kv-blocks --save [DIR]
    JAX_PLATFORMS=cpu jaxinfer bench kernels --only kv-blocks -- --tiny

Llama-3-8B's cache shape (32 layers, 8 KV heads, head_dim 128, 16-token blocks, bf16), one prompt of
`--blocks` blocks (256 = 4096 tokens, 512 MiB of K and V). Variants of the scatter (all donate the
cache): `transfer` the engine's; `flat` the same on the cache viewed as [heads, blocks, 16 * 128]
(each block one contiguous row per head); `sorted` destinations sorted, the buffer permuted to
match, `indices_are_sorted`. Each is checked against the engine's result. Record kv_blocks_<gpu>.
Measured on one H200 (kv_blocks_h200.json, 256 blocks): gather 1.84 ms, scatter 1.14 ms (`flat`
1.36, `sorted` 1.27: the engine's stays), a plain read + write of 512 MiB 0.61 ms.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.bench import results_io
from jaxinfer.disagg import transfer as transfer_module

ROOT = Path(__file__).resolve().parent.parent


def scatter_flat(kv_cache, blocks, ids):
    h, nb, bs, d = kv_cache[0][0].shape
    dst = jnp.where(ids < 0, nb + jnp.arange(ids.shape[0]), ids)
    out = []
    for i, (k, v) in enumerate(kv_cache):
        rows = blocks[i].reshape(2, h, -1, bs * d)
        out.append(tuple(c.reshape(h, nb, bs * d).at[:, dst].set(
            rows[j], mode="drop", unique_indices=True).reshape(h, nb, bs, d)
            for j, c in enumerate((k, v))))
    return tuple(out)


def scatter_sorted(kv_cache, blocks, ids):
    nb = kv_cache[0][0].shape[1]
    dst = jnp.where(ids < 0, nb + jnp.arange(ids.shape[0]), ids)
    order = jnp.argsort(dst)
    dst = dst[order]
    return tuple((k.at[:, dst].set(blocks[i, 0][:, order], mode="drop", unique_indices=True,
                                   indices_are_sorted=True),
                  v.at[:, dst].set(blocks[i, 1][:, order], mode="drop", unique_indices=True,
                                   indices_are_sorted=True))
                 for i, (k, v) in enumerate(kv_cache))


VARIANTS = {"transfer": transfer_module._scatter, "flat": scatter_flat, "sorted": scatter_sorted}


def timed(fn, reps: int) -> float:
    """Median ms of `fn()` (which blocks), after one untimed call."""
    fn()
    runs = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - t0)
    return round(1e3 * float(np.median(runs)), 3)


def run(tiny: bool, n_blocks: int, reps: int) -> dict:
    layers, heads, bs, d, num_blocks = (2, 2, 4, 8, 64) if tiny else (32, 8, 16, 128, 4096)
    n_blocks = min(n_blocks, num_blocks // 4)
    key = jax.random.key(0)
    shape = (heads, num_blocks, bs, d)

    def cache(seed):
        return tuple((jax.random.normal(jax.random.fold_in(key, 2 * i + seed), shape, jnp.bfloat16),
                      jax.random.normal(jax.random.fold_in(key, 2 * i + 1 + seed), shape,
                                        jnp.bfloat16)) for i in range(layers))
    src, dst = cache(0), cache(1000)
    rng = np.random.default_rng(0)
    src_ids = np.sort(rng.choice(num_blocks, n_blocks, replace=False)).astype(np.int32)
    dst_ids = rng.permutation(num_blocks)[:n_blocks].astype(np.int32)  # an allocator's order
    gather = jax.jit(transfer_module._gather)
    buffer = jax.block_until_ready(gather(src, src_ids))
    m = {"layers": layers, "blocks": n_blocks, "buffer_bytes": int(buffer.nbytes)}
    m["gather_ms"] = timed(lambda: jax.block_until_ready(gather(src, src_ids)), reps)
    plain = jnp.ones((buffer.nbytes // 2,), jnp.bfloat16)
    m["copy_anchor_ms"] = timed(lambda: jax.block_until_ready(plain + 1), reps)  # read + write
    reference = None
    for name, fn in VARIANTS.items():
        scatter = jax.jit(fn, donate_argnums=0)
        state = {"cache": dst}
        dst = None  # donated below

        def once():
            state["cache"] = jax.block_until_ready(scatter(state["cache"], buffer, dst_ids))
        m[f"scatter_{name}_ms"] = timed(once, reps)
        got = np.asarray(state["cache"][layers - 1][1][:, dst_ids].astype(jnp.float32))
        want = np.asarray(buffer[layers - 1, 1].astype(jnp.float32))
        m[f"scatter_{name}_ok"] = bool(np.array_equal(got, want))
        if reference is None:
            reference = np.asarray(state["cache"][0][0].astype(jnp.float32))
        else:
            m[f"scatter_{name}_ok"] &= bool(np.array_equal(
                np.asarray(state["cache"][0][0].astype(jnp.float32)), reference))
        dst = state["cache"]
    gb = buffer.nbytes / 1e9
    for k in [k for k in m if k.endswith("_ms")]:
        m[k.replace("_ms", "_gbps")] = round(gb / (m[k] / 1e3), 1)
    return m


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--blocks", type=int, default=256)
    ap.add_argument("--reps", type=int, default=10)
    results_io.add_save_arg(ap, "kv_blocks_<gpu>")
    a = ap.parse_args(argv)
    m = run(a.tiny, a.blocks, a.reps)
    if a.save:
        results_io.save(a.save, a.name or f"kv_blocks_{results_io.device_slug()}",
                        config=dict(blocks=a.blocks, reps=a.reps, tiny=a.tiny), metrics=m)
    print(json.dumps(m))
    print("\n".join(f"{k:24} {m[k]:9.3f} ms  {m[k.replace('_ms', '_gbps')]:8.1f} GB/s"
                    for k in m if k.endswith("_ms")))


if __name__ == "__main__":
    main()
