"""The same-run ceilings every benchmark divides by: the best plain HBM read rate and the best bf16
matmul rate this device reaches now, each the best of several kernels, with the winner named.

A roofline is only as honest as its anchor. One 4 GiB sum timed alone read 3.73 TB/s on an H200
where a queued chain of reads reaches ~4.6 TB/s; a single timed 8192^3 product gave 213 TF/s where
a queued chain reaches ~600. So every kernel here is timed queued back to back (launch and
dispatch overlap the device's work), on random data (no constant folding), after the clocks are up.

    rates = anchors.measure()          # {"read_tbps", "read_kernel", "read_tbps_by_kernel", ...}
    floor_s = weight_bytes / (rates["read_tbps"] * 1e12)
"""
from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np


def warm_up(seconds: float = 1.5) -> None:
    """Run matmuls for a while so the clocks are up before anything is timed."""
    a = jax.random.normal(jax.random.key(9), (4096, 4096), jnp.bfloat16)
    f = jax.jit(lambda a: (a @ a) * 1e-3)
    t = time.perf_counter()
    while time.perf_counter() - t < seconds:
        a = f(a)
        jax.block_until_ready(a)


def queued_time(call, state, *, min_seconds: float = 0.03, reps: int = 5) -> float:
    """Seconds per `call(state) -> state`, calls queued without host synchronisation, enough of
    them to keep the device busy >= min_seconds; median over `reps` such runs."""
    for _ in range(2):
        state = jax.block_until_ready(call(state))
    t = time.perf_counter()
    state = jax.block_until_ready(call(state))
    n = max(1, int(min_seconds / max(time.perf_counter() - t, 1e-6)))
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(n):
            state = call(state)
        jax.block_until_ready(state)
        ts.append((time.perf_counter() - t) / n)
    return float(np.median(ts))


def _read_kernels() -> dict:
    """Plain reads of a bf16 buffer, each reducing to a few bytes so the writes do not count. XLA
    emits a different reduction for each shape, and which streams fastest differs by GPU."""
    return {
        "sum_f32": lambda x: jnp.sum(x, dtype=jnp.float32),
        "rows_sum_f32": lambda x: jnp.sum(x.reshape(-1, 8192), axis=0, dtype=jnp.float32),
        "cols_max": lambda x: jnp.max(x.reshape(-1, 8192), axis=1).max(),
        "u32_xor": lambda x: jax.lax.reduce(
            jax.lax.bitcast_convert_type(x.reshape(-1, 2), jnp.uint32), np.uint32(0),
            jax.lax.bitwise_xor, (0,)),
    }


# Inputs are rotated over copies spanning at least this many bytes, so a buffer that fits in L2
# (the H200's is 60 MB) is read from HBM each time, not from the previous call's L2 lines.
ROTATE_BYTES = 256 << 20


def rotation(nbytes: int) -> int:
    """How many copies of an `nbytes` input a timed call reads in turn (1 past ROTATE_BYTES)."""
    return max(1, -(-ROTATE_BYTES // max(nbytes, 1)))


def read_rates(nbytes: int) -> dict[str, float]:
    """Bytes per second of each plain read kernel over `nbytes` of bf16. Small inputs: one jitted
    call reads each of `rotation(nbytes)` copies in turn on a GPU (out of L2, and the host's
    dispatch spread over as many reads)."""
    # (a CPU run checks the code path, its rates mean nothing: one copy, not 256 MB of random
    # bf16 that took it seconds to draw)
    copies = 1 if jax.default_backend() == "cpu" else rotation(nbytes)
    xs = tuple(jax.random.normal(jax.random.key(i), (nbytes // 2,), jnp.bfloat16)
               for i in range(copies))
    out = {}
    for name, fn in _read_kernels().items():
        f = jax.jit(lambda xs, fn=fn: [fn(x) for x in xs])
        out[name] = nbytes * len(xs) / queued_time(lambda _, f=f, xs=xs: f(xs), None,
                                                   min_seconds=0.05)
    del xs
    return out


def matmul_rates(shapes=((8192, 8192, 8192), (4096, 14336, 4096), (16384, 4096, 4096))) -> dict:
    """FLOP/s of bf16 products of each (m, k, n), queued back to back."""
    out = {}
    for m, k, n in shapes:
        ka, kb = jax.random.split(jax.random.key(m + k + n))
        a = jax.random.normal(ka, (m, k), jnp.bfloat16)
        b = jax.random.normal(kb, (k, n), jnp.bfloat16)
        f = jax.jit(jnp.matmul)  # the whole product is written: a slice of it could be folded
        out[f"{m}x{k}x{n}"] = 2 * m * k * n / queued_time(lambda _, f=f, a=a, b=b: f(a, b), None)
        del a, b
    return out


def measure(read_bytes: int | None = None, tiny: bool | None = None) -> dict:
    """The best read and matmul rates and which kernel gave each, for a record's metrics."""
    if tiny is None:
        tiny = jax.default_backend() == "cpu"
    if not tiny:
        warm_up()
    reads = read_rates(read_bytes or ((64 << 20) if tiny else (8 << 30)))
    mms = matmul_rates(((512, 512, 512),) if tiny else matmul_rates.__defaults__[0])
    read_kernel = max(reads, key=reads.get)
    mm_shape = max(mms, key=mms.get)
    return dict(read_tbps=round(reads[read_kernel] / 1e12, 4), read_kernel=read_kernel,
                read_tbps_by_kernel={k: round(v / 1e12, 4) for k, v in reads.items()},
                matmul_tflops=round(mms[mm_shape] / 1e12, 2), matmul_shape=mm_shape,
                matmul_tflops_by_shape={k: round(v / 1e12, 2) for k, v in mms.items()})
