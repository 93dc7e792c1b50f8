"""The FP8 weight-only GEMV (pallas_kernels/fp8_gemv.py) in Pallas' interpreter against its
float32 oracle on ragged shapes (N and K not multiples of the blocks, 1-16 rows, FMA and tensor-core
paths, with and without split-K), its Triton lowering for an H200 (which the interpreter skips),
its tiling table, and `quantized_matmul`'s "gemv" impl: the dispatch rule and a model forward
through it against XLA's weight-only dot."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.model.quant import ops
from pallas_kernels import fp8_gemv as g

C = g.GemvConfig


def _inputs(m, n, k, seed=0):
    key = jax.random.key(seed)
    x = (jax.random.normal(key, (m, k)) * 3).astype(jnp.bfloat16)
    # Channels of very different magnitudes, as per-channel scales are for.
    w = jax.random.normal(jax.random.fold_in(key, 1), (n, k)) * jnp.exp(
        jax.random.uniform(jax.random.fold_in(key, 2), (n, 1), minval=-3, maxval=1))
    q, s = ops.quantize(w, "fp8")
    return x, q, s


@pytest.mark.parametrize("m, n, k, cfg", [
    (1, 77, 130, C(16, 32)),                        # ragged N and K, one row
    (1, 64, 256, C(16, 64)),                        # exact tiling: no masks
    (1, 100, 200, C(32, 64, split_k=3)),            # a last split past K
    (3, 100, 200, C(32, 64, split_k=2)),            # FMAs over three rows
    (3, 96, 160, C(16, 32, dot=True)),              # rows padded to 16 for the MMA
    (8, 48, 96, C(32, 32, dot=True)),
    (8, 130, 300, C(64, 128, split_k=2, dot=True)),
    (16, 33, 300, C(16, 128, split_k=3, dot=True)),  # every row of the MMA tile
    (16, 40, 72, C(8, 16)),                          # the most rows through FMAs
])
def test_kernel_matches_the_reference_on_ragged_shapes(m, n, k, cfg):
    x, q, s = _inputs(m, n, k, seed=m * 1000 + n)
    got = g.fp8_gemv_configured(x, q, s, cfg=cfg, out_dtype=jnp.float32, interpret=True)
    want = g.fp8_gemv_reference(x, q, s, jnp.float32)
    assert got.shape == (m, n) and got.dtype == jnp.float32
    # bf16 x times e4m3 w is exact in float32: only the summation order differs.
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5,
                               atol=1e-5 * float(jnp.abs(want).max()))


def test_leading_dims_and_the_activation_dtype_out():
    x, q, s = _inputs(6, 24, 40, seed=7)
    got = g.fp8_gemv(x.reshape(2, 3, 40), q, s, interpret=True)
    want = g.fp8_gemv_reference(x, q, s).reshape(2, 3, 24)
    assert got.dtype == jnp.bfloat16 and got.shape == (2, 3, 24)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               rtol=1e-2, atol=1e-2 * float(jnp.abs(want.astype(jnp.float32)).max()))


def test_bad_inputs_are_refused():
    x, q, s = _inputs(2, 16, 32)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        g.fp8_gemv_configured(x, q.astype(jnp.bfloat16), s, cfg=C(16, 32), interpret=True)
    with pytest.raises(ValueError, match="rows"):
        g.fp8_gemv_configured(jnp.zeros((g.MAX_ROWS + 1, 32), jnp.bfloat16), q, s, cfg=C(16, 32),
                              interpret=True)
    with pytest.raises(ValueError, match="power of two"):
        g.fp8_gemv_configured(x, q, s, cfg=C(24, 32), interpret=True)
    with pytest.raises(ValueError, match=">= 16 with dot"):
        g.fp8_gemv_configured(x, q, s, cfg=C(8, 32, dot=True), interpret=True)
    with pytest.raises(ValueError, match="scale"):
        g.fp8_gemv_configured(x, q, s[:8], cfg=C(16, 32), interpret=True)


def test_tilings_are_valid_and_fill_the_gpu():
    for (rows, n, k), cfg in g.TUNED.items():
        assert rows in (1, 8) and cfg.dot == (rows > 1), (rows, n, k)
        for v in (cfg.block_n, cfg.block_k):
            assert v & (v - 1) == 0 and v >= 16
    assert g.config_for(1, 28672, 4096) is g.TUNED[(1, 28672, 4096)]
    assert g.config_for(5, 28672, 4096) is g.TUNED[(8, 28672, 4096)]
    h = g.heuristic_config(1, 1024, 4096)
    assert not h.dot and h.split_k * -(-1024 // h.block_n) >= 2 * 132
    assert g.heuristic_config(1, 48, 40) == C(16, 64, 4, 1, 1, False)  # blocks cut to the shape
    assert g.heuristic_config(8, 100000, 4096).split_k == 1 and g.heuristic_config(8, 1, 1).dot


@pytest.mark.parametrize("m, n, k, cfg", [(1, 100, 200, C(32, 64)), (1, 4096, 14336, C(16, 512, split_k=2)),
                                          (3, 100, 200, C(32, 64, 4, 3, 2, True)),
                                          (8, 6144, 4096, C(64, 256, 4, 3, 1, True))])
def test_kernel_lowers_to_triton_for_an_h200(monkeypatch, m, n, k, cfg):
    """The Triton lowering (masked-load fills, the e4m3 widening, the MMA, split stores) runs on a
    CPU machine against an H200's description; compiling the Triton IR needs the GPU."""
    from jax._src.pallas.triton import pallas_call_registration
    from jax.experimental.pallas import triton as plgpu_triton
    h200 = plgpu_triton.get_gpu_info_from_version(plgpu_triton.GpuVersion.H200)
    monkeypatch.setattr(pallas_call_registration.gpu_info_lib, "get_gpu_info", lambda: h200)
    args = (jax.ShapeDtypeStruct((m, k), jnp.bfloat16),
            jax.ShapeDtypeStruct((n, k), jnp.float8_e4m3fn), jax.ShapeDtypeStruct((n,), jnp.float32))
    text = jax.jit(lambda x, w, s: g.fp8_gemv_configured(x, w, s, cfg=cfg)).trace(*args).lower(
        lowering_platforms=("cuda",)).as_text()
    assert plgpu_triton.CUSTOM_CALL_TARGET_NAME in text


def test_dispatch_sends_decode_rows_on_one_gpu_to_the_kernel(monkeypatch):
    rule = ops.pick_impl
    assert rule(1, gpu=True, fp8_gemm=True) == "gemv"
    assert rule(ops.GEMV_MAX_ROWS, gpu=True, fp8_gemm=True) == "gemv"
    assert rule(ops.GEMV_MAX_ROWS + 1, gpu=True, fp8_gemm=True) == "dequant"
    assert rule(ops.FP8_GEMM_MIN_ROWS, gpu=True, fp8_gemm=True) == "fp8"
    assert rule(8, gpu=True, fp8_gemm=False) == "dequant"  # no e4m3 conversion before sm_89
    assert rule(8, gpu=True, fp8_gemm=True, single_device=False) == "dequant"  # tensor parallel
    assert rule(8, gpu=False, fp8_gemm=False) == "fp8"  # the CPU default is unchanged
    assert ops.choose_impl(8, ops.FP8) == "fp8"
    monkeypatch.setenv("JAXINFER_QUANT_IMPL", "gemv")
    assert ops.choose_impl(8, ops.FP8) == "gemv"
    assert ops.choose_impl(ops.GEMV_MAX_ROWS + 1, ops.FP8) == "fp8"  # too many rows: automatic
    assert ops.choose_impl(8, jnp.int8) == "dequant"


def test_model_forward_through_the_kernel_matches_the_weight_only_dot(monkeypatch):
    """A tiny FP8 Llama's forward with every projection through the kernel (interpreted) equals
    XLA's weight-only dot: exactly up to the summation order at one row (FMAs on the float32
    activations), within bf16 rounding of the activations at six rows (the MMA path)."""
    from jaxinfer.model.quant import loading
    from jaxinfer.model.transformer import param_shapes, train_forward
    from jaxinfer.model.weights import _flat_paths, _set
    from test_engine_support import tiny_model

    cfg, params = tiny_model()
    qcfg = dataclasses.replace(cfg, quantization="fp8")
    flat = {k: jnp.array(v) for k, v in _flat_paths(params).items()}
    fp8: dict = {}
    for key, leaf in loading.quantize_unquantized(
            flat, _flat_paths(param_shapes(qcfg, jnp.float32)), "fp8", {}).items():
        _set(fp8, key, leaf)
    tokens = jnp.asarray(np.random.default_rng(0).integers(1, cfg.vocab_size, (1, 6)), jnp.int32)
    for length, rtol in ((1, 1e-5), (6, 2e-2)):
        logits = {}
        for impl in ("dequant", "gemv"):
            monkeypatch.setenv("JAXINFER_QUANT_IMPL", impl)
            logits[impl] = np.asarray(jax.jit(lambda t: train_forward(fp8, qcfg, t))(
                tokens[:, :length]))
        want, got = logits["dequant"], logits["gemv"]
        assert np.linalg.norm(got - want) <= rtol * np.linalg.norm(want), length
