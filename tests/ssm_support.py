"""What the recurrent-layer kernel tests (test_ssm_*.py) share: random inputs, splitting a ragged
batch into two chunks of prefill, the untouched-slots check, and lowering a Triton kernel for CUDA
here."""

from __future__ import annotations

from unittest import mock

import jax
import numpy as np
from jax._src.pallas.triton import gpu_info


def normal(rng: np.random.Generator, shape, dtype=np.float32) -> jax.Array:
    """Standard normal float32 values drawn on the host, as `dtype` (jax.random compiles a
    program per shape: most of these tests' time, eagerly)."""
    return jax.numpy.asarray(rng.standard_normal(shape, np.float32).astype(dtype))


def split_batch(cu_seqlens, cuts) -> tuple:
    """Cut each sequence s after cuts[s] of its tokens. Returns (idx1, cu1, idx2, cu2): the packed
    rows of the first parts and their offsets, then those of the rest."""
    cu = np.asarray(cu_seqlens)
    first = [np.arange(cu[s], cu[s] + c) for s, c in enumerate(cuts)]
    rest = [np.arange(cu[s] + c, cu[s + 1]) for s, c in enumerate(cuts)]

    def packed(parts):
        lens = [len(p) for p in parts]
        return (np.concatenate(parts).astype(np.int32),
                np.concatenate([[0], np.cumsum(lens)]).astype(np.int32))

    return (*packed(first), *packed(rest))


def used_slots(slots) -> np.ndarray:
    return np.asarray(slots)[np.asarray(slots) >= 0]


def assert_other_slots_untouched(before, after, slots):
    """Every slot no live sequence names keeps its exact bits."""
    others = np.setdiff1d(np.arange(before.shape[0]), used_slots(slots))
    np.testing.assert_array_equal(np.asarray(after)[others], np.asarray(before)[others])


def assert_close(got, want, tol):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * max(1.0, float(np.abs(want).max())))


def lower_for_cuda(fn, *avals) -> str:
    """The Triton lowering of fn for an H100, run on this CPU-only machine (Pallas asks the device
    for its compute capability; it is named here instead): catches ops Triton cannot lower."""
    h100 = gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H100)
    with mock.patch.object(gpu_info, "get_gpu_info", return_value=h100):
        return jax.jit(fn).trace(*avals).lower(lowering_platforms=("cuda",)).as_text()
