"""The weight-only 8-bit matmul kernel (pallas_kernels/weight_only_matmul.py) in the interpreter
against its jnp reference, on ragged shapes (N and K not multiples of the blocks, rows not a power
of two) with and without split-K, for e4m3 and int8 weights."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.model.quant.ops import quantize
from pallas_kernels import weight_only_matmul as wo


@pytest.mark.parametrize("mode", ["fp8", "int8"])
@pytest.mark.parametrize("m, n, k, block_n, block_k, split_k", [
    (1, 77, 130, 16, 32, None),   # planned splits, ragged N and K
    (3, 100, 200, 32, 64, 3),     # a last split shorter than the others
    (17, 48, 96, 32, 32, 1),      # rows past one 16-row dot tile, one split
    (64, 33, 300, 16, 128, 2),    # the most rows the kernel takes
])
def test_kernel_matches_reference_on_ragged_shapes(mode, m, n, k, block_n, block_k, split_k):
    key = jax.random.key(m * 1000 + n)
    x = (jax.random.normal(key, (m, k)) * 3).astype(jnp.bfloat16)
    q, s = quantize(jax.random.normal(jax.random.fold_in(key, 1), (n, k)) * 0.05, mode)
    got = wo.weight_only_matmul_configured(x, q, s, block_n=block_n, block_k=block_k,
                                           split_k=split_k, out_dtype=jnp.float32, interpret=True)
    want = wo.weight_only_matmul_reference(x, q, s, out_dtype=jnp.float32)
    assert got.shape == (m, n)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5,
                               atol=1e-5 * float(jnp.abs(want).max()))


@pytest.mark.parametrize("m, n, k, split_k", [(1, 130, 72, None), (9, 40, 200, 2)])
def test_16_bit_weights_in_dense_layout_without_scales(m, n, k, split_k):
    """The LM head's case: a bf16 Flax kernel [K, N], no scales."""
    key = jax.random.key(m + n)
    x = jax.random.normal(key, (m, k), jnp.bfloat16)
    w = (jax.random.normal(jax.random.fold_in(key, 1), (k, n)) * 0.1).astype(jnp.bfloat16)
    got = wo.weight_only_matmul_configured(x, w, None, w_kn=True, block_n=32, block_k=32,
                                           split_k=split_k, out_dtype=jnp.float32, interpret=True)
    want = wo.weight_only_matmul_reference(x, w, None, out_dtype=jnp.float32, w_kn=True)
    assert got.shape == (m, n)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5,
                               atol=1e-5 * float(jnp.abs(want).max()))


def test_leading_dims_and_bf16_output():
    key = jax.random.key(7)
    x = jax.random.normal(key, (2, 3, 40), jnp.bfloat16)
    q, s = quantize(jax.random.normal(key, (24, 40)), "fp8")
    got = wo.weight_only_matmul(x, q, s, interpret=True)
    want = wo.weight_only_matmul_reference(x.reshape(6, 40), q, s).reshape(2, 3, 24)
    assert got.dtype == jnp.bfloat16 and got.shape == (2, 3, 24)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               rtol=1e-2, atol=1e-2)


def test_plan_fills_the_gpu_without_empty_splits():
    assert wo.plan_split_k(n=28672, k=4096, block_n=64, block_k=256, programs=264) == 1
    assert wo.plan_split_k(n=4096, k=14336, block_n=64, block_k=256, programs=264) == 5
    assert wo.plan_split_k(n=64, k=64, block_n=64, block_k=256, programs=264) == 1


def test_bad_inputs_are_refused():
    x = jnp.zeros((2, 32), jnp.bfloat16)
    q = jnp.zeros((16, 32), jnp.float8_e4m3fn)
    s = jnp.ones((16,), jnp.float32)
    with pytest.raises(ValueError, match="8- or 16-bit"):
        wo.weight_only_matmul_configured(x, q.astype(jnp.float32), s, interpret=True)
    with pytest.raises(ValueError, match="power of two"):
        wo.weight_only_matmul_configured(x, q, s, block_n=48, interpret=True)
    with pytest.raises(ValueError, match="rows"):
        wo.weight_only_matmul_configured(jnp.zeros((wo.MAX_ROWS + 1, 32), jnp.bfloat16), q, s,
                                         interpret=True)
    with pytest.raises(ValueError, match="scale"):
        wo.weight_only_matmul_configured(x, q, s[:8], interpret=True)


@pytest.mark.parametrize("dtype, w_kn", [(jnp.float8_e4m3fn, False), (jnp.int8, False),
                                         (jnp.bfloat16, True)])
def test_kernel_lowers_to_triton_for_an_h200(monkeypatch, dtype, w_kn):
    """The Triton lowering (which the interpreter skips: masked-load fills, the 8-bit widening,
    split-K stores) runs on a CPU machine against an H200's description."""
    from jax._src.pallas.triton import pallas_call_registration
    from jax.experimental.pallas import triton as plgpu_triton
    h200 = plgpu_triton.get_gpu_info_from_version(plgpu_triton.GpuVersion.H200)
    monkeypatch.setattr(pallas_call_registration.gpu_info_lib, "get_gpu_info", lambda: h200)
    args = (jax.ShapeDtypeStruct((3, 200), jnp.bfloat16),
            jax.ShapeDtypeStruct((200, 100) if w_kn else (100, 200), dtype),
            jax.ShapeDtypeStruct((100,), jnp.float32))
    fn = lambda x, w, s: wo.weight_only_matmul_configured(x, w, None if w_kn else s, w_kn=w_kn,
                                                          block_n=32, block_k=64)
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert plgpu_triton.CUSTOM_CALL_TARGET_NAME in text
