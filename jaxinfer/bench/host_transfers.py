"""Host-to-device costs of the research loop: placing weights from host numpy, and host arguments
that make a dispatch wait for the device.

    jaxinfer bench kernels --only host-transfers [--save [DIR]]
    JAX_PLATFORMS=cpu jaxinfer bench kernels --only host-transfers -- --tiny   # CPU check

weights   bf16 host numpy of Llama-3-8B shapes (the embedding and the first --layers layers) onto
          the device: `weight_update.place_like` (one thread per leaf) as the process's first
          host transfer, then one `jax.device_put` call over the whole list (the old path), then
          `place_like` again with 1 and with the default threads, then float32 leaves cast to the
          model's bf16 on the device. The first transfer of a process pays a one-time cost (the
          runtime's pinned staging memory), so the order is part of the measurement.
dispatch  how long a jitted call takes to *return* while the device is busy with a long matmul
          chain: with a host numpy argument of 4 KiB .. 8 MiB, and the full sampler variant
          (top-p, 256 rows) with its [256, 2048] penalty history from the host against the
          device-resident one `SamplingTable.no_history` provides. A call that returns only once
          the device is idle ends the overlap of host and device work in the engine's step loop.
`--save` writes host_transfers_<gpu>.json.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jaxinfer.bench import results_io
from jaxinfer.bench.presets import LLAMA3_8B
from jaxinfer.engine.weight_update import place_like
from jaxinfer.model.config import load_config
from jaxinfer.model.transformer import param_shapes
from jaxinfer.sampling_params import MAX_STOP_TOKEN_IDS
from jaxinfer.worker.step_programs import sample_step
from jaxinfer.worker.sampler import FULL_SAMPLER, SamplingTensors


def timed(fn) -> float:
    """Seconds until fn()'s arrays are ready; they are deleted after."""
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn())
    s = time.perf_counter() - t0
    for a in jax.tree.leaves(out):
        a.delete()
    return s


def weights_section(cfg, layers: int) -> dict:
    shapes = jax.tree_util.tree_flatten_with_path(param_shapes(cfg, jnp.bfloat16))[0]
    keep = [s for path, s in shapes if "embed" in jax.tree_util.keystr(path)
            or any(f"layers_{i}'" in jax.tree_util.keystr(path) for i in range(layers))]
    host = [np.full(s.shape, 1, ml_dtypes.bfloat16) for s in keep]
    gb = sum(h.nbytes for h in host) / 1e9
    sharding = jax.sharding.NamedSharding(jax.make_mesh((1,), ("x",)), jax.sharding.PartitionSpec())
    # The engine's weights stand-in, made on the device: the first host transfer is place_like's.
    ref = jax.block_until_ready([jnp.zeros(s.shape, s.dtype, device=sharding) for s in keep])
    out = {"gb": round(gb, 3), "leaves": len(host)}
    runs = [("place_like_first_transfer_s", lambda: place_like(host, ref)),
            ("one_device_put_call_s", lambda: jax.device_put(host, [sharding] * len(host))),
            ("place_like_1_thread_s", lambda: place_like(host, ref, threads=1)),
            ("place_like_s", lambda: place_like(host, ref))]
    for key, fn in runs:
        out[key] = round(timed(fn), 3)
        out[key.removesuffix("_s") + "_gb_s"] = round(gb / out[key], 2)
        print(key, out[key], "s", flush=True)
    f32 = [h.astype(np.float32) for h in host]
    out["place_like_f32_cast_on_device_s"] = round(timed(lambda: place_like(f32, ref)), 3)
    out["f32_host_gb"] = round(sum(h.nbytes for h in f32) / 1e9, 3)
    return out


def dispatch_section(busy_n: int, vocab: int) -> dict:
    x = jax.random.normal(jax.random.key(1), (busy_n, busy_n), jnp.bfloat16)
    busy = jax.jit(lambda x: jax.lax.fori_loop(0, 60, lambda i, y: (y @ x) * 1e-3, x))
    jax.block_until_ready(busy(x))
    out = {"busy_ms": round(1e3 * timed(lambda: busy(x)), 2)}

    def while_busy_ms(call) -> float:
        b = busy(x)
        t0 = time.perf_counter()
        res = call()
        s = time.perf_counter() - t0
        jax.block_until_ready((b, res))
        return round(1e3 * s, 3)

    probe = jax.jit(lambda a: a[:1] + 1)
    sweep = {}
    for kib in (4, 64, 256, 1024, 2048, 8192):
        a = np.ones(kib * 256, np.int32)
        jax.block_until_ready(probe(a))
        sweep[f"{kib}KiB"] = while_busy_ms(lambda: probe(a))
    out["jit_call_numpy_arg_while_busy_ms"] = sweep
    print("numpy argument sweep", sweep, flush=True)

    s, length = 256, 2048
    logits = jax.random.normal(jax.random.key(0), (s, vocab), jnp.float32)
    emit = np.arange(s, dtype=np.int32)
    on_device = jax.device_put(np.full((s, length), -1, np.int32))
    step = jax.jit(sample_step, static_argnames=("variant",), donate_argnums=(1,))
    state = {"last": jnp.zeros(s, jnp.int32)}

    def sample(history):
        t = SamplingTensors(
            np.ones(s, np.float32), np.zeros(s, np.int32), np.full(s, 0.9, np.float32),
            np.zeros(s, np.float32), np.arange(s, dtype=np.uint32), np.full(s, 5, np.int32),
            np.zeros(s, np.int32), np.full((s, MAX_STOP_TOKEN_IDS), -1, np.int32),
            np.zeros(s, np.int32), np.ones(s, np.float32), np.zeros(s, np.float32),
            np.zeros(s, np.float32), history, np.full(s, 128, np.int32))
        state["last"], res = step(logits, state["last"], t, emit, variant=FULL_SAMPLER)
        return res

    for name, history in (("host", lambda: np.full((s, length), -1, np.int32)),
                          ("device", lambda: on_device)):
        jax.block_until_ready(sample(history()))
        t0 = time.perf_counter()
        for _ in range(10):
            res = sample(history())
        jax.block_until_ready(res)
        out[f"full_sampler_{name}_history_ms_per_call"] = round(
            1e3 * (time.perf_counter() - t0) / 10, 3)
        out[f"full_sampler_{name}_history_while_busy_ms"] = while_busy_ms(
            lambda: sample(history()))
        print(name, "history", out[f"full_sampler_{name}_history_ms_per_call"], "ms/call,",
              out[f"full_sampler_{name}_history_while_busy_ms"], "ms to return while busy",
              flush=True)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="the demo model's shapes (CPU check)")
    ap.add_argument("--layers", type=int, default=6, help="layers placed besides the embedding")
    results_io.add_save_arg(ap, "host_transfers_<gpu>")
    args = ap.parse_args(argv)
    if args.tiny:
        cfg, busy_n, vocab = load_config("checkpoints/demo-target"), 512, 512
    else:
        model_dir = Path(tempfile.mkdtemp())
        (model_dir / "config.json").write_text(json.dumps(LLAMA3_8B))
        cfg, busy_n, vocab = load_config(model_dir), 8192, 32768
    metrics = {"weights": weights_section(cfg, args.layers)}
    metrics["dispatch"] = dispatch_section(busy_n, vocab)
    if args.save:
        name = args.name or ("host_transfers_" + ("tiny_" if args.tiny else "")
                             + results_io.device_slug())
        results_io.save(args.save, name, metrics=metrics,
                        config=dict(tiny=args.tiny, layers=args.layers, busy_matmul=busy_n,
                                    sampler_vocab=vocab))


if __name__ == "__main__":
    main()
