"""The Mosaic split-combine kernel (`split_combine_mosaic`) against the XLA merge of the same parts
(`split_combine_mosaic.combine_parts_xla`), in GPU interpret mode on CPU, and its CUDA lowering.

What interpret mode cannot check: programmatic dependent launch (`griddepcontrol.wait`, and the
decode kernel's early `launch_dependents`) is left out there; `tests/gpu/test_paged_decode_gpu.py`
runs the kernel with it on the H200."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.attention.paged_decode_common import NEG_INF, DecodeShape
from pallas_kernels.attention.split_combine_mosaic import DecodeLaunch, combine_parts_xla
from pallas_kernels.attention.split_combine_mosaic import combine_split_parts


def make_parts(seed, *, seqs, hq, hkv, d, splits):
    """Random normalised parts and log2 log-sum-exps, with an empty part (NEG_INF) in one item
    and every part of another row empty (that row must come out as 0, as the decode kernel's
    parts of an empty sequence are 0)."""
    rng = np.random.default_rng(seed)
    o = rng.standard_normal((splits, seqs * hq, d)).astype(np.float32)
    lse = (3 * rng.standard_normal((splits, seqs * hkv, 64))).astype(np.float32)
    lse[0, 0, :] = NEG_INF
    lse[:, -1, :] = NEG_INF
    o[:, -(hq // hkv):, :] = 0.0  # the last item's rows: all parts empty
    return jnp.asarray(o), jnp.asarray(lse)


# (seqs, hq, hkv, d, splits, q_padded): the benchmark shape (GQA 4, d 128, 16 splits, q read
# unpadded: rows at r0 = base % 8 of their item's lse tile), odd row counts at d 64 (a padding row,
# q padded: r0 = 0), d 192 and d 256. The paged decode tests run the kernel behind the decode kernel
# too (GQA 1 and 8, d 64 and 128).
CASES = [
    (1, 32, 8, 128, 16, False),
    (1, 3, 1, 64, 2, True),
    (1, 6, 2, 192, 3, True),   # 2 rows per CTA at d 192, 3 values per thread (4-byte accesses)
    (1, 4, 1, 256, 2, False),  # 8-byte accesses
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "s{}_hq{}_hkv{}_d{}_c{}_pad{}".format(*c))
def test_combine_kernel_matches_the_xla_merge(case):
    seqs, hq, hkv, d, splits, q_padded = case
    o, lse = make_parts(sum(case[:5]), seqs=seqs, hq=hq, hkv=hkv, d=d, splits=splits)
    launch = DecodeLaunch(DecodeShape(seqs, hq, hkv, d, 16, 1), splits, q_padded)
    ref = np.asarray(combine_parts_xla(o, lse, launch))
    out = np.asarray(combine_split_parts(o, lse, group=hq // hkv, q_padded=q_padded,
                                         dtype=jnp.float32, interpret=True))
    assert out.shape == ref.shape == (seqs * hq, d)
    assert np.isfinite(out).all()
    assert (out[-(hq // hkv):] == 0).all(), "rows whose parts are all empty must be exactly 0"
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)


def test_combine_kernel_lowers_for_cuda_with_pdl():
    o, lse = make_parts(0, seqs=1, hq=32, hkv=8, d=128, splits=16)
    fn = lambda o, lse: combine_split_parts(o, lse, group=4, q_padded=False, dtype=jnp.bfloat16)
    text = jax.jit(fn).trace(o, lse).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text
