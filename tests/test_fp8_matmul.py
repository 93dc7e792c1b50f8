"""The FP8 weight-streaming matmul (pallas_kernels/matmul/fp8_matmul_mosaic.py): CPU tests.

What runs where:
  - The kernel runs in Mosaic GPU's interpreter against `quantized_matmul`'s "fp8" (W8A8) path on
    ragged row counts (1, 3, 8, 17, 64) and small N / K, with K splits and persistent grids of 2-3
    CTAs (units loop, the ring and the output stores carry across units); e4m3 products summed in
    float32 are exact in either order up to float32 rounding, so the two agree to bf16 rounding.
  - It is lowered for CUDA (Pallas -> Mosaic GPU MLIR: layouts, tiling, TMA boxes) at Llama-3-8B's
    projection shapes, with the split counts `choose_splits` picks.
  - `quantized_matmul`'s dispatch to it ($JAXINFER_QUANT_IMPL=mosaic, `pick_impl`).
Real sizes and speed: benchmarks/bench_fp8_matmul.py on the H200.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.model.quant import ops
from pallas_kernels.matmul.fp8_matmul_mosaic import Fp8Config, choose_splits, fp8_matmul

LLAMA3_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
             "down": (4096, 14336)}


def _operands(rng, m, n, k):
    x = jnp.asarray(rng.standard_normal((m, k)) * rng.uniform(0.1, 10, (m, 1)), jnp.bfloat16)
    w, ws = ops.quantize(jnp.asarray(rng.standard_normal((n, k)) * k ** -0.5, jnp.float32), "fp8")
    return x, w, ws


def _assert_close(got, want):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    # Both round the same float32 value to bf16; the kernel's K splits sum in another order.
    np.testing.assert_allclose(got, want, rtol=2 ** -7, atol=1e-3 * np.abs(want).max())


CASES = [  # m, n, k, config
    (1, 256, 256, Fp8Config(128, 128, 2, splits=1, num_ctas=2)),
    (3, 256, 512, Fp8Config(128, 128, 3, splits=2, num_ctas=3)),
    (8, 384, 512, Fp8Config(128, 128, 2, splits=4, num_ctas=3)),   # 12 units on 3 CTAs
    (17, 512, 1024, Fp8Config(256, 256, 2, splits=2, num_ctas=2)),
    (64, 256, 256, Fp8Config(128, 128, 2, splits=0, num_ctas=2)),  # splits from the shape
    # The real shapes shrunk by 32 along N (and K by 8): the splits `choose_splits` gives them.
    (1, 896, 512, Fp8Config(128, 128, 4, splits=0, num_ctas=3)),
    (8, 128, 1792, Fp8Config(128, 128, 4, splits=0, num_ctas=3)),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"m{c[0]}-{c[1]}x{c[2]}-s{c[3].splits}")
def test_interpreted_matches_the_fp8_reference(case):
    m, n, k, cfg = case
    x, w, ws = _operands(np.random.default_rng(m * n + k), m, n, k)
    xq, xs = ops.quantize_tokens(x)
    got = fp8_matmul(xq, xs[:, 0], w, ws, config=cfg, interpret=True)
    assert got.shape == (m, n) and got.dtype == jnp.bfloat16
    _assert_close(got, ops.quantized_matmul(x, w, ws, impl="fp8"))


def test_quantized_matmul_dispatches_to_the_kernel(monkeypatch):
    rng = np.random.default_rng(5)
    x, w, ws = _operands(rng, 6, 256, 256)
    x = x.reshape(2, 3, 256)  # leading batch dims are flattened into rows
    monkeypatch.setenv("JAXINFER_QUANT_IMPL", "mosaic")
    assert ops.choose_impl(6, ops.FP8, w.shape) == "mosaic"
    got = ops.quantized_matmul(x, w, ws)  # on the CPU: the interpreter
    assert got.shape == (2, 3, 256)
    _assert_close(got, ops.quantized_matmul(x, w, ws, impl="fp8"))
    # Where the kernel does not take the step the override leaves the usual choice (CPU: fp8).
    assert ops.choose_impl(65, ops.FP8, w.shape) == "fp8"
    assert ops.choose_impl(6, ops.FP8, (200, 256)) == "fp8"
    assert ops.choose_impl(6, jnp.int8, w.shape) == "dequant"


def test_pick_impl_keeps_the_kernel_off_until_switched_on():
    shape_fits, hopper, ada = True, (9, 0), (8, 9)
    assert ops.pick_impl(8, hopper, shape_fits, mosaic=False) == "dequant"
    assert ops.pick_impl(8, hopper, shape_fits, mosaic=True) == "mosaic"
    assert ops.pick_impl(8, hopper, False, mosaic=True) == "dequant"
    assert ops.pick_impl(8, ada, shape_fits, mosaic=True) == "dequant"  # fp8 wgmma is Hopper's
    assert ops.pick_impl(ops.FP8_GEMM_MIN_ROWS, hopper, shape_fits, mosaic=True) == "fp8"
    assert not ops.MOSAIC_DEFAULT


def _lower_for_cuda(fn, *avals):
    return jax.jit(fn).trace(*avals).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("rows", [1, 8, 64])
def test_lowers_for_cuda_at_llama3_8b_shapes(rows):
    s = jax.ShapeDtypeStruct
    for name, (n, k) in LLAMA3_8B.items():
        for cfg in (Fp8Config(), Fp8Config(256, 128, 4)):
            def f(xq, xs, w, ws, cfg=cfg):
                return fp8_matmul(xq, xs, w, ws, config=cfg)

            text = _lower_for_cuda(f, s((rows, k), ops.FP8), s((rows,), jnp.float32),
                                   s((n, k), ops.FP8), s((n,), jnp.float32))
            assert "stablehlo.custom_call @mosaic_gpu" in text, (name, cfg)


def test_split_choice_and_checks():
    cfg = Fp8Config()
    # Every SM streams: o and down (32 blocks of 128 rows) split 4 ways, gate_up (224) not at all.
    assert choose_splits(*LLAMA3_8B["gate_up"], cfg, 132) == 1
    assert choose_splits(*LLAMA3_8B["o"], cfg, 132) == 4
    assert choose_splits(*LLAMA3_8B["down"], cfg, 132) == 4
    assert choose_splits(*LLAMA3_8B["qkv"], cfg, 132) == 2
    with pytest.raises(ValueError, match="block_n"):
        Fp8Config(block_n=64)
    with pytest.raises(ValueError, match="block_k"):
        Fp8Config(block_k=64)
    xq = jnp.zeros((4, 256), ops.FP8)
    w = jnp.zeros((256, 256), ops.FP8)
    one = jnp.ones((4,), jnp.float32)
    with pytest.raises(ValueError, match="shared memory"):
        fp8_matmul(xq, one, w, jnp.ones(256), config=Fp8Config(256, 256, 4), interpret=True)
    with pytest.raises(ValueError, match="multiples"):
        fp8_matmul(xq, one, w[:200], jnp.ones(200), interpret=True)
    with pytest.raises(ValueError, match="dtype|must be"):
        fp8_matmul(xq.astype(jnp.bfloat16), one, w, jnp.ones(256), interpret=True)
    with pytest.raises(ValueError, match="rows"):
        fp8_matmul(jnp.zeros((65, 256), ops.FP8), jnp.ones(65), w, jnp.ones(256), interpret=True)
    with pytest.raises(ValueError, match="splits"):
        fp8_matmul(xq, one, w, jnp.ones(256), config=Fp8Config(splits=3), interpret=True)
