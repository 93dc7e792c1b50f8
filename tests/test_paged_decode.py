"""Paged decode kernels against the float32 jnp oracle, on CPU in Pallas interpret mode.

Interpret mode starts every output and every shared-memory buffer as NaN ("poisoned"), so an output
element the kernel forgets to write, or a page it reads before its copy landed, shows up as NaN.

What runs here and what does not:
- `paged_decode_triton`: the whole kernel (`pallas_call(interpret=True)`).
- `paged_decode_mosaic`: the whole kernel under `plgpu.kernel(interpret=InterpretGPUParams())` —
  persistent item loop, producer/consumer barriers, the producer's q tile copies, block-table TMA
  page copies, masking, both wgmmas, the in-kernel merge of the two consumer warpgroups, the final
  output store (one split) and the fp32 parts + log-sum-exp merged by the combine kernel
  (several splits; `tests/test_split_combine.py` tests it alone) — except one
  detail GPU interpret mode cannot simulate in jax 0.11.2: the P @ V wgmma with P in registers
  (and `run_state` accumulators). In interpret mode P goes through shared memory instead
  (`mgpu_common.accumulate_pv`). The register path, Mosaic's compilation and real-size shapes are
  checked on the H200 by `tests/gpu/test_paged_decode_gpu.py`.
"""

from __future__ import annotations

import numpy as np
import pytest

import jax.numpy as jnp

from pallas_kernels.attention.paged_decode import (MosaicDecodeConfig, paged_decode_mosaic,
                                                   paged_decode_triton_configured)
from pallas_kernels.attention.paged_decode_common import DecodeShape, plan_splits
from pallas_kernels.attention.kv_quant import quantize

from kernel_references import paged_decode_reference


def make_case(seed, *, batch, hq, hkv, d, page, max_blocks, dtype=jnp.bfloat16):
    """Random q/K/V, a shuffled block table over a pool with spare blocks, and lengths that cover
    empty sequences, one token, exact page multiples, partial last pages and the full table."""
    rng = np.random.default_rng(seed)
    num_blocks = batch * max_blocks + 3
    q = jnp.asarray(rng.standard_normal((batch, hq, d)), dtype)
    k = jnp.asarray(rng.standard_normal((hkv, num_blocks, page, d)), dtype)
    v = jnp.asarray(rng.standard_normal((hkv, num_blocks, page, d)), dtype)
    bt = rng.permutation(num_blocks)[: batch * max_blocks].reshape(batch, max_blocks)
    cap = max_blocks * page
    special = [0, 1, page, cap, page + 1, cap - 1]
    lens = np.array([special[i] if i < len(special) else rng.integers(0, cap + 1)
                     for i in range(batch)])
    rng.shuffle(lens)
    # Block-table entries past a sequence's last block are 0, as the engine pads them.
    used = -(-lens // page)
    bt = np.where(np.arange(max_blocks)[None, :] < used[:, None], bt, 0)
    return q, k, v, jnp.asarray(bt, jnp.int32), jnp.asarray(lens, jnp.int32)


def check(out, q, k, v, bt, lens, *, scale, softcap, tol=(2e-2, 1e-2)):
    ref = paged_decode_reference(q.astype(jnp.float32), k.astype(jnp.float32),
                                 v.astype(jnp.float32), bt, lens, scale=scale, softcap=softcap)
    out = np.asarray(out.astype(jnp.float32))
    ref = np.asarray(ref)
    assert out.shape == ref.shape
    assert np.isfinite(out).all(), "unwritten (NaN-poisoned) or non-finite output"
    assert (out[np.asarray(lens) == 0] == 0).all(), "seq_lens == 0 rows must be exactly zero"
    # bf16 inputs, fp32 accumulation, bf16 output: error is the output's rounding (2^-9 relative).
    np.testing.assert_allclose(out, ref, atol=tol[0], rtol=tol[0])
    rel = np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30)
    assert rel < tol[1], rel


# (seed, batch, hq, hkv, d, page, max_blocks, softcap): GQA 1/4/8, d 64/128, page 16/32, batch 1..33.
CASES = [
    (0, 1, 2, 2, 64, 16, 3, None),
    (1, 6, 8, 2, 64, 32, 3, None),
    (2, 33, 8, 1, 64, 16, 2, None),
    (3, 4, 16, 2, 128, 16, 4, 30.0),
    (4, 7, 4, 1, 128, 32, 2, None),
    # Several 64-token steps per sequence, so the Mosaic kernel's plan has several splits (its
    # fp32-part + log-sum-exp path); S * Hq a multiple of 8 (q read unpadded, G = 1/4/8 heads at
    # row r0 = base % 8 of their tile) or not (q padded).
    (5, 3, 8, 2, 128, 16, 12, None),
    (6, 2, 16, 2, 64, 32, 6, 20.0),
    (7, 3, 4, 4, 64, 16, 9, None),
    (8, 2, 8, 8, 64, 16, 9, None),
]


# The Mosaic kernel's paths, each once on a random ragged case (interpreted calls cost ~6 s each):
# one split (the kernel's own output store) with soft-cap at d 128 and G = 8, one split with q
# padded (G = 4, 32-token pages), several splits (fp32 parts + log-sum-exp, the combine kernel) with
# soft-cap at d 64 and 32-token pages, several splits with q padded and G = 1; the block-id
# lookahead and forced-split test below adds G = 4 split cases merged by the kernel and by XLA.
MOSAIC_CASES = [CASES[3], CASES[4], CASES[6], CASES[7]]
# The Triton kernel (one page per step: several splits wherever a sequence spans pages): GQA 1/4/8,
# d 64/128, page 16/32, batch 33, soft-cap.
TRITON_CASES = [CASES[0], CASES[2], CASES[3], CASES[6]]


def mosaic_splits(case) -> int:
    """Context splits for the Mosaic test: 2 where a sequence spans several 64-token steps (the
    fp32-part + log-sum-exp path), else 1 (the kernel writes the final output)."""
    *_, page, max_blocks, _ = case
    return 2 if max_blocks * page > 64 else 1


def run_case(case, kernel, cache_dtype=None, tol=(2e-2, 1e-2)):
    """A CASES row's inputs through `kernel(q, k, v, bt, lens, scale=, softcap=, workers=,
    splits=)`, checked against the oracle; workers (programs to aim for) = 3 x sequences x kv
    heads, splits = `mosaic_splits(case)`. `cache_dtype` fp8: K/V quantized (the oracle reads the
    same fp8 values)."""
    seed, batch, hq, hkv, d, page, max_blocks, softcap = case
    q, k, v, bt, lens = make_case(seed, batch=batch, hq=hq, hkv=hkv, d=d, page=page,
                                  max_blocks=max_blocks)
    if cache_dtype is not None:
        k, v = quantize(k, 0.5, cache_dtype), quantize(v, 0.5, cache_dtype)
    scale = d ** -0.5
    out = kernel(q, k, v, bt, lens, scale=scale, softcap=softcap, workers=3 * batch * hkv,
                 splits=mosaic_splits(case))
    check(out, q, k, v, bt, lens, scale=scale, softcap=softcap, tol=tol)


@pytest.mark.parametrize("case", TRITON_CASES,
                         ids=lambda c: "s{}_b{}_hq{}_hkv{}_d{}_p{}".format(*c[:6]))
def test_triton_interpret_matches_reference(case):
    # One page per step and few programs, so several steps and several splits per sequence run.
    def kernel(*args, workers, splits, **kwargs):
        return paged_decode_triton_configured(*args, **kwargs, pages_per_step=1, workers=workers,
                                              interpret=True)
    run_case(case, kernel)


@pytest.mark.parametrize("case", MOSAIC_CASES,
                         ids=lambda c: "s{}_b{}_hq{}_hkv{}_d{}_p{}".format(*c[:6]))
def test_mosaic_interpret_matches_reference(case):
    # Two persistent CTAs over several items each, 64-token steps: items change mid-ring, both
    # consumer warpgroups get steps, pages past a sequence's end get masked.
    def kernel(*args, workers, splits, **kwargs):
        cfg = MosaicDecodeConfig(tokens_per_step=64, stages=2, num_ctas=2, num_splits=splits)
        return paged_decode_mosaic(*args, **kwargs, config=cfg, interpret=True)
    run_case(case, kernel)


# d 128 one split + soft-cap, d 64 split with G = 1 and q padded, and 32-token pages at d 128 with
# splits (4 pages per 128-token fp8 step; ragged lengths end mid-page and mid-step)
FP8_CASES = [CASES[3], CASES[7], (9, 3, 8, 2, 128, 32, 7, None)]


# The Mosaic kernel's fp8 read paths (mgpu_fp8.py): K read as fp8 by the QK^T wgmmas against q
# split into two e4m3 tiles, V widened to float16. "mosaic" is the production config (128-token
# steps, V in 64-token chunks, the hand-over tile over the V staging tiles); the others change
# MosaicDecodeConfig fields over it: 64-token steps with a whole-step V (the earlier default), QK^T
# against q_hi alone. Every case runs the production config; the variants run the case that covers
# splits, 32-token pages and lengths ending mid-page and mid-step; the Triton kernel (whose fp8
# path is one cast) the one-split and the 32-token-page cases.
FP8_PATHS = {
    "mosaic": {},
    "mosaic_t64": dict(fp8_tokens_per_step=64, fp8_pv_tokens=None, fp8_shared_scratch=False),
    "mosaic_q1": dict(fp8_q_split=False),
}
FP8_RUNS = ([(c, "mosaic") for c in FP8_CASES] + [(FP8_CASES[i], "triton") for i in (0, 2)]
            + [(FP8_CASES[2], k) for k in FP8_PATHS if k != "mosaic"])


@pytest.mark.parametrize("case,kernel", FP8_RUNS, ids=lambda v: (
    v if isinstance(v, str) else "s{}_b{}_hq{}_hkv{}_d{}_p{}".format(*v[:6])))
def test_kernels_over_an_fp8_cache_match_reference(case, kernel):
    def fn(*args, workers, splits, **kwargs):
        if kernel == "triton":
            return paged_decode_triton_configured(*args, **kwargs, pages_per_step=1,
                                                  workers=workers, interpret=True)
        cfg = MosaicDecodeConfig(**{**dict(tokens_per_step=64, stages=2, num_ctas=2,
                                           num_splits=splits), **FP8_PATHS[kernel]})
        return paged_decode_mosaic(*args, **kwargs, config=cfg, interpret=True)
    # q1: q rounded to e4m3 alone (3 mantissa bits) moves the logits by up to 2^-4 of |q| |k|:
    # ~2e-2 relative error (norm) against ~1e-3 with q_hi + q_lo (per element, tolerance, rel).
    run_case(case, fn, jnp.float8_e4m3fn, tol=(0.3, 4e-2) if kernel.endswith("q1") else (2e-2, 1e-2))


@pytest.mark.parametrize("d,splits,kernel", [
    (64, 3, "mosaic"), (128, 1, "mosaic_t64"), (128, 1, "mosaic_q1")])
def test_mosaic_fp8_decode_lowers_for_cuda(d, splits, kernel):
    """The fp8 paths' Mosaic GPU pieces (8-bit swizzled tiles, fp8 wgmmas, WGMMA_8BIT loads, the
    paired e4m3 -> f16 conversion, the f16 staging tiles) lower for CUDA at the benchmark shape
    with the variants' configs. (The production config at d 128, one split and several, is held to
    its lowered module's digest by tests/test_kernel_ir.py.)"""
    import functools
    import jax
    q = jax.ShapeDtypeStruct((64, 32, d), jnp.bfloat16)
    cache = jax.ShapeDtypeStruct((8, 4096, 16, d), jnp.float8_e4m3fn)
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
    fn = functools.partial(paged_decode_mosaic, scale=0.1,
                           config=MosaicDecodeConfig(num_ctas=132, num_splits=splits,
                                                     **FP8_PATHS[kernel]))
    text = jax.jit(fn).trace(q, cache, cache, i32(64, 256), i32(64)).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text and "cvt.rn.f16x2.e4m3x2" in text


def test_cases_cover_the_mosaic_kernels_one_and_several_split_paths():
    # The Mosaic kernel writes the final output itself with one split per sequence and fp32 parts
    # for the combine kernel with several: MOSAIC_CASES must run both, q padded or not in each.
    def q_padded(case):
        _, batch, hq, hkv = case[:4]
        g = hq // hkv
        return not ((8 % g == 0 or g % 8 == 0) and (batch * hq) % 8 == 0)
    assert {(mosaic_splits(c), q_padded(c)) for c in MOSAIC_CASES} == {
        (1, False), (1, True), (2, False), (2, True)}


def test_split_plan_covers_the_block_table_and_fills_the_workers():
    # (seqs, kv heads, block-table width, pages per step, workers) -> allowed split counts
    for s, hkv, m, pps, workers, allowed in [
            (1, 8, 2048, 4, 132, range(9, 17)),  # batch 1 x 32k: split until ~132 items
            (64, 8, 256, 4, 132, [1]),  # batch 64 x 4k: 512 items already fill 132 CTAs
            (8, 8, 256, 4, 132, [2]),  # 64 items: 2 splits give 128 items, one wave
            (3, 2, 50, 2, 100, [13]),  # 25 steps per sequence: 13 splits of 2 steps, one wave
            (1, 1, 1, 8, 1000, [1])]:
        shape = DecodeShape(s, hkv * 4, hkv, 128, 16, m)
        plan = plan_splits(shape, pages_per_step=pps, workers=workers)
        assert plan.pages_per_split % pps == 0
        assert plan.padded_blocks >= m > plan.padded_blocks - plan.pages_per_split
        assert plan.num_splits in allowed, (s, hkv, m, plan)


def test_bad_inputs_name_the_field():
    q, k, v, bt, lens = make_case(0, batch=2, hq=4, hkv=2, d=64, page=16, max_blocks=2)
    with pytest.raises(ValueError, match="num_q_heads"):
        paged_decode_triton_configured(q[:, :3], k, v, bt, lens, scale=1.0, interpret=True)
    with pytest.raises(ValueError, match="seq_lens"):
        paged_decode_triton_configured(q, k, v, bt, lens[:1], scale=1.0, interpret=True)
    with pytest.raises(ValueError, match="head_dim"):
        paged_decode_mosaic(q[..., :32], k, v, bt, lens, scale=1.0, interpret=True)


def test_mosaic_decode_config_rejects_bad_values():
    with pytest.raises(ValueError, match="stages"):
        MosaicDecodeConfig(stages=3)
    with pytest.raises(ValueError, match="tokens_per_step"):
        MosaicDecodeConfig(tokens_per_step=96)
    with pytest.raises(ValueError, match="num_splits"):
        MosaicDecodeConfig(num_splits=0)
    with pytest.raises(ValueError, match="bt_lookahead"):
        MosaicDecodeConfig(bt_lookahead=-1)
    with pytest.raises(ValueError, match="fp8_tokens_per_step"):
        MosaicDecodeConfig(fp8_tokens_per_step=96)
    with pytest.raises(ValueError, match="fp8_pv_tokens"):  # must divide the fp8 step
        MosaicDecodeConfig(fp8_tokens_per_step=128, fp8_pv_tokens=256)


def test_public_functions_have_the_backend_signature():
    import inspect
    from pallas_kernels.attention.paged_decode import paged_decode_mosaic, paged_decode_triton
    from pallas_kernels.attention.reference import paged_decode_reference as ref
    # `chunk` only the reference takes: a backend whose kernels lack it (chunked_local false)
    # runs chunked layers on the reference (backend.py)
    backend = list(name for name in inspect.signature(ref).parameters
                   if name != "chunk")
    for fn in (paged_decode_mosaic, paged_decode_triton):
        params = inspect.signature(fn).parameters
        assert list(params)[:len(backend)] == backend
        # Anything beyond the backend's signature (the Mosaic kernel's config, interpret) is a
        # keyword with a default, so the backend's calls get the production kernel.
        extra = [params[name] for name in list(params)[len(backend):]]
        assert all(p.kind is p.KEYWORD_ONLY and p.default is not p.empty for p in extra), extra


@pytest.mark.parametrize("case,combine_kernel", [(CASES[1], True), (CASES[5], False)],
                         ids=lambda c: "s{}_b{}_hq{}_hkv{}_d{}_p{}".format(*c[:6])
                         if isinstance(c, tuple) else f"combine_kernel={c}")
def test_mosaic_interpret_block_id_lookahead_and_forced_splits(case, combine_kernel):
    # The producer reading block ids 3 steps ahead (past the end of short items, where it reads
    # the table's padding or its last column) and a forced split count (some splits empty or partial), merged
    # by the combine kernel or by XLA (`combine_parts_xla`).
    def kernel(*args, workers, splits, **kwargs):
        del workers, splits
        cfg = MosaicDecodeConfig(tokens_per_step=64, stages=2, num_ctas=2, num_splits=3,
                                 bt_lookahead=3, pdl=True, combine_kernel=combine_kernel)
        return paged_decode_mosaic(*args, **kwargs, config=cfg, interpret=True)
    run_case(case, kernel)


def test_split_plan_charges_the_combine():
    # A context that one wave of unsplit items covers in a few steps is not split (the combine's
    # launch would cost more than the split saves); a long one is.
    shape = DecodeShape(8, 32, 8, 128, 16, 32)  # batch 8 x 512 tokens, 8 steps per sequence
    assert plan_splits(shape, pages_per_step=4, workers=132).num_splits == 1
    assert plan_splits(shape, pages_per_step=4, workers=132, combine_cost_steps=0).num_splits == 2
    assert plan_splits(shape, pages_per_step=4, workers=132, num_splits=4).num_splits == 4
