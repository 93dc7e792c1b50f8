"""When a pinned-host -> device copy lands while compute is queued, and what a device -> host copy
of a not-yet-computed array costs its caller (the host KV tier's two copies; core/kv_loads.py).

    python -m tools.probe_h2d_order [--pinned-growth]   # one GPU, ~1 min; three runs per case

Each case dispatches some work, then a 150 MiB pinned-host -> device copy, and prints the copy's
time to done, the queued work's, and how long dispatching both took (a blocking call shows there).
On the H200 (jax 0.11.2) the copy lands with the queued work, never before it, and a device ->
host copy of an array still being computed may block its caller until the queue has run.
`--pinned-growth`: 300 device -> host copies of 18 MiB into fresh pinned memory, again after
freeing them, and again past them (H200: 19 ms mean with single copies up to 3-6 s while the
pinned pool grows, 0.7 ms reusing it).
"""

from __future__ import annotations

import sys
import time

import jax
import jax.numpy as jnp


@jax.jit
def matmuls(a):
    for _ in range(4):
        a = (a @ a) * 0.001
    return a


@jax.jit
def step(kv, a):
    """A stand-in engine step: writes the cache, computes."""
    return kv + matmuls(a)[0, 0], matmuls(a)


@jax.jit
def gather(kv, ids):
    return kv[ids]


def pinned_growth() -> None:
    host = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
    x = jnp.ones((9, 1 << 20), jnp.bfloat16)  # an 18 MiB piece
    jax.block_until_ready(jax.device_put(x, host))

    def copies(label: str, keep: list) -> None:
        times = []
        for _ in range(300):
            t0 = time.perf_counter()
            keep.append(jax.device_put(x, host))
            keep[-1].block_until_ready()
            times.append(time.perf_counter() - t0)
        print(f"{label}: mean {1e3 * sum(times) / len(times):.2f} ms, max "
              f"{1e3 * max(times):.1f} ms, total {sum(times):.2f} s")

    first: list = []
    copies("fresh pinned memory", first)
    del first[:]
    again: list = []
    copies("after freeing it", again)
    copies("growing past it", again)


def main() -> None:
    if "--pinned-growth" in sys.argv:
        pinned_growth()
        return
    dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    host = dev.with_memory_kind("pinned_host")
    x_host = jax.device_put(jnp.ones(150 * (1 << 20) // 2, jnp.bfloat16), host)
    a = jnp.ones((8192, 8192), jnp.bfloat16)
    state = {"kv": jnp.ones((1024, 1 << 20), jnp.bfloat16)}  # 1,024 blocks of 2 MiB
    ids = jnp.arange(72)
    jax.block_until_ready((matmuls(a), step(state["kv"], a), gather(state["kv"], ids)))
    t0 = time.perf_counter()
    jax.block_until_ready(matmuls(a))
    print(f"one queued unit: {1e3 * (time.perf_counter() - t0):.1f} ms")

    def queued():
        out = a
        for _ in range(10):
            out = matmuls(out)
        return out

    def steps_then_d2h():
        out = a
        for _ in range(10):
            state["kv"], out = step(state["kv"], out)
        return out, jax.device_put(gather(state["kv"], ids), host)

    def steps_each_d2h():
        out, copies = a, []
        for i in range(10):
            state["kv"], out = step(state["kv"], out)
            copies.append(jax.device_put(gather(state["kv"], ids[:8] + i), host))
        return out, copies

    cases = (("idle", lambda: None), ("10 units queued", queued),
             ("10 steps, gather + d2h", steps_then_d2h), ("10 steps each + d2h", steps_each_d2h))
    for label, work in cases:
        runs = []
        for _ in range(3):
            jax.block_until_ready(state["kv"])
            t0 = time.perf_counter()
            done = work()
            y = jax.device_put(x_host, dev)
            t1 = time.perf_counter()
            y.block_until_ready()
            t_copy = time.perf_counter() - t0
            jax.block_until_ready(done)
            t_work = time.perf_counter() - t0
            runs.append(f"h2d {1e3 * t_copy:.1f} / work {1e3 * t_work:.1f} / "
                        f"dispatch {1e3 * (t1 - t0):.1f} ms")
        print(f"{label}: " + "; ".join(runs))


if __name__ == "__main__":
    main()
