"""Mosaic GPU pieces both Pallas kernels (paged decode, flash prefill) use: the PV product with
its interpret-mode stand-in, the producer's last look at the K/V ring before the kernel ends, and
named profiler ranges."""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu


def accumulate_pv(acc, p16, v_tile, p_smem=None, during: Callable[[], None] | None = None):
    """acc + P @ V, running `during()` (e.g. a barrier wait) while the product is in flight.

    On the GPU (`p_smem` None) P stays in registers (wgmma's A operand may live there) and
    `during` runs inside the wgmma scope, overlapping the matmul. GPU interpret mode (CPU tests)
    supports neither register operands, nor `run_state`, nor barrier waits inside a wgmma scope,
    so there P goes through `p_smem`, the product is added to acc afterwards and `during` follows
    it: same math and barrier order, other plumbing."""
    if p_smem is None:
        def pv_fn(acc_ref):
            plgpu.wgmma(acc_ref, p16, v_tile)
            if during is not None:
                during()

        return pl.run_state(pv_fn)(plgpu.ACC.init(acc))
    p_smem[...] = p16
    plgpu.commit_smem()

    def pv_scoped(acc_ref):
        plgpu.wgmma(acc_ref, p_smem, v_tile)
        return acc_ref[...]

    acc = acc + pl.run_scoped(pv_scoped, plgpu.ACC(acc.shape, jnp.float32))
    if during is not None:
        during()
    return acc


def observe_last_releases(total_steps, stages: int, *free_barriers) -> None:
    """The producer's end: wait for the consumers' last release of every ring slot it filled
    (slot i was filled if total_steps > i; earlier releases it already waited on before reusing
    the slot), so no barrier phase is left unobserved when the kernel ends -- GPU interpret mode
    checks this -- and the ring is idle at exit."""
    for i in range(stages):
        @pl.when(total_steps > i)
        def _():
            for free in free_barriers:
                plgpu.barrier_wait(free.at[i])


def scoped(name: str):
    """Decorator: the function is traced inside `jax.named_scope(name)`, a range in the
    per-warpgroup timeline that Mosaic GPU's profiler records when `MosaicDecodeConfig.profile_dir`
    is set (free otherwise)."""
    def decorate(fn):
        @functools.wraps(fn)
        def wrapped(*args, **kwargs):
            with jax.named_scope(name):
                return fn(*args, **kwargs)
        return wrapped
    return decorate
