"""The Mosaic GPU latent decode kernel (pallas_kernels/attention/latent_decode_mosaic.py) against
the jnp latent reference, in Mosaic GPU's interpreter on CPU: ragged lengths (0, 1, a partial last
page, a full table) over shuffled pages of a bf16 cache, 16 and 128 query heads (two head
blocks), one split and several (the combine kernel), both ring geometries (64-token slots with
the 128-byte swizzle, 32-token slots with the 64-byte one). The production shapes (576-wide
latent) are lowered for the GPU too, which interpret mode does not exercise (wgmma tiling,
TMA boxes, register layouts)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.attention.latent_decode_mosaic import (LatentDecodeConfig,
                                                           MosaicLatentDecode,
                                                           latent_decode_mosaic, unsupported)
from pallas_kernels.attention.latent_reference import paged_latent_decode

BLOCK = 16
ROPE = 64


def _case(heads: int, lens, pages: int, value: int, seed: int):
    rng = np.random.default_rng(seed)
    width = value + ROPE
    s = len(lens)
    cache = jnp.asarray(rng.normal(size=(1, s * pages + 3, BLOCK, width)), jnp.bfloat16)
    tables = jnp.asarray(rng.permutation(s * pages + 3)[:s * pages].reshape(s, pages), jnp.int32)
    q = jnp.asarray(rng.normal(size=(s, heads, width)), jnp.bfloat16)
    return q, cache, tables, jnp.asarray(lens, jnp.int32)


@pytest.mark.parametrize("heads, lens, config", [
    # heads-minor (the default at 16 heads), one split: a partial page, the full table
    (16, [17, 80], LatentDecodeConfig(num_splits=1)),
    # heads-minor (forced: 2 splits default to heads-major), two splits (both empty for the
    # empty row): parts merged in XLA
    (16, [0, 80], LatentDecodeConfig(num_splits=2, heads_minor=True)),
    # heads-major, 32-token slots (64-byte swizzle), two splits: the combine kernel
    (16, [1, 71], LatentDecodeConfig(num_splits=2, pages_per_step=2, swizzle=64)),
    # heads-major, two head blocks of 64, one split
    (128, [33], LatentDecodeConfig(num_splits=1)),
])
def test_kernel_matches_the_latent_reference(heads, lens, config):
    value, pages = 128, 5
    q, cache, tables, seq_lens = _case(heads, lens, pages, value, seed=heads + len(lens))
    got = latent_decode_mosaic(q, cache, cache, tables, seq_lens, scale=0.12, value_width=value,
                               config=config, interpret=True)
    want = paged_latent_decode(q.astype(jnp.float32), cache.astype(jnp.float32),
                               cache.astype(jnp.float32), tables, seq_lens, scale=0.12)
    assert got.shape == q.shape and got.dtype == q.dtype
    got = np.asarray(got, np.float32)
    np.testing.assert_allclose(got[..., :value], np.asarray(want)[..., :value], atol=2e-2,
                               rtol=2e-2)
    assert not got[..., value:].any()  # the rope columns: zeros
    assert not got[np.asarray(lens) == 0].any()  # no context: zeros


def _lower(heads: int, seqs: int, pages: int, config: LatentDecodeConfig) -> str:
    q = jax.ShapeDtypeStruct((seqs, heads, 576), jnp.bfloat16)
    cache = jax.ShapeDtypeStruct((1, seqs * pages, BLOCK, 576), jnp.bfloat16)
    tables = jax.ShapeDtypeStruct((seqs, pages), jnp.int32)
    lens = jax.ShapeDtypeStruct((seqs,), jnp.int32)
    fn = jax.jit(lambda q, c, t, s: latent_decode_mosaic(q, c, c, t, s, scale=0.1,
                                                         value_width=512, config=config))
    return fn.trace(q, cache, tables, lens).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("heads, seqs, config, qk, pv", [
    (16, 64, LatentDecodeConfig(), "m64n16k16", "m64n16k16"),  # 2 splits: heads-minor
    (16, 1, LatentDecodeConfig(), "m64n16k16", "m64n16k16"),  # 128 splits
    (16, 8, LatentDecodeConfig(pages_per_step=2, swizzle=64), "m64n32k16", "m64n256k16"),
    (128, 2, LatentDecodeConfig(num_splits=1), "m64n64k16", "m64n256k16"),
])
def test_production_shapes_lower_for_the_gpu(heads, seqs, config, qk, pv):
    text = _lower(heads, seqs, 256, config)
    assert f"wgmma.mma_async.sync.aligned.{qk}" in text  # S = Q K^T (or S^T) over one slot
    assert f"wgmma.mma_async.sync.aligned.{pv}" in text  # O_w += P V_w, half of 512 columns


def test_orientation_is_heads_minor_where_it_fits():
    from pallas_kernels.attention.latent_decode_mosaic import heads_minor
    auto = LatentDecodeConfig()
    assert heads_minor(16, 64, auto) and heads_minor(32, 64, auto)
    assert not heads_minor(64, 64, auto)  # more heads than the accumulator holds
    assert not heads_minor(16, 32, auto)  # 32-token slots: T is wgmma's M
    assert not heads_minor(16, 64, LatentDecodeConfig(heads_minor=False))


def test_unsupported_shapes_fall_back_to_the_reference():
    assert unsupported((1, 16, 576), (1, 8, 16, 576), jnp.bfloat16, 512) is None
    assert "multiple of 64" in unsupported((1, 16, 40), (1, 8, 16, 40), jnp.bfloat16, 32)
    assert "query heads" in unsupported((1, 96, 576), (1, 8, 16, 576), jnp.bfloat16, 512)
    assert "dtype" in unsupported((1, 16, 576), (1, 8, 16, 576), jnp.float32, 512)
    rng = np.random.default_rng(0)
    cache = jnp.asarray(rng.normal(size=(1, 4, 4, 40)), jnp.float32)
    q = jnp.asarray(rng.normal(size=(2, 4, 40)), jnp.float32)
    tables, lens = jnp.asarray([[0, 1], [2, 3]], jnp.int32), jnp.asarray([5, 8], jnp.int32)
    got = MosaicLatentDecode(32)(q, cache, cache, tables, lens, scale=0.3)
    want = paged_latent_decode(q, cache, cache, tables, lens, scale=0.3)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_mla_on_the_mosaic_backend_decodes_with_the_kernel():
    from jaxinfer.model.kernel_table import Platform, resolve_kernels
    from jaxinfer.model.mla import latent_backend
    from pallas_kernels.attention.latent_reference import LATENT_REFERENCE
    hopper, ampere = Platform("gpu", (9, 0)), Platform("gpu", (8, 0))

    def latent(platform, name):
        kernels = resolve_kernels(platform, attention=name)
        return latent_backend(kernels.attention, kernels.latent_decode, 512)
    backend = latent(hopper, "mosaic")
    assert backend.decode == MosaicLatentDecode(512)  # by value: one trace per step shape
    assert backend.prefill is LATENT_REFERENCE.prefill
    assert latent(ampere, "triton") is LATENT_REFERENCE
    assert latent(hopper, "triton") is LATENT_REFERENCE
    assert latent(hopper, "reference") is LATENT_REFERENCE
