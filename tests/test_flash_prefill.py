"""Flash prefill attention: CPU tests.

What runs where:
  - The tile table (how a ragged batch is cut into query tiles) is checked against a brute-force
    enumeration here.
  - The Triton-lowered kernel (`flash_prefill_triton`) runs in the Pallas interpreter here, on random
    ragged batches against the float32 reference: lengths 1 .. a few blocks and not multiples of the
    block size, prefixes already in the cache, GQA 1/4/8, head_dim 64/128, pages of 16 and 32,
    soft-cap, padding tokens (must come out zero). It shares the tile table with the Mosaic kernel.
  - The Mosaic GPU kernel (`flash_prefill_mosaic`, `flash_attention`) runs in Mosaic GPU's
    interpreter on small ragged and dense batches, with persistent grids of 2-3 CTAs so the K/V ring
    and barrier phases carry across items; the interpreter checks every barrier's phase accounting
    (a skipped phase is an error, not a silent race or a GPU hang). Three parts of the kernel differ
    there (P through shared memory, the next-K wait after PV, no `inline_mgpu`; see
    `flash_mgpu.mosaic_attention`), so the kernel is also *lowered* for CUDA here (Pallas -> Mosaic
    GPU MLIR: layout, tiling and TMA-alignment errors) for every supported dtype / head_dim / page
    size and for the configurations in use. The GPU-only parts and real sizes are checked on the
    H200 by `tests/gpu/test_flash_prefill_gpu.py`.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.attention import flash_prefill as fp
from pallas_kernels.attention.flash_config import TILE_Q, KernelConfig
from pallas_kernels.attention.kv_quant import quantize
from pallas_kernels.common.testing import random_paged_batch

import kernel_references as reference

pytestmark = pytest.mark.slow  # minutes on the CI machine: xdist starts its group first (conftest.py)


def _paged_batch(rng, *, extra=0, **kwargs):
    return random_paged_batch(rng, extra_tokens=extra, spare_blocks=3, **kwargs)


def _rel(out, ref):
    out = np.asarray(out, np.float32)
    ref = np.asarray(ref, np.float32)
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


# ------------------------------------------------------------------------------------ tile table
@pytest.mark.parametrize("seed", range(4))
def test_tile_table_covers_every_token_once(seed):
    rng = np.random.default_rng(seed)
    s = int(rng.integers(1, 7))
    q_lens = rng.integers(0, 300, s)
    prefixes = rng.integers(0, 500, s)
    pad = int(rng.integers(0, 20))
    starts = np.concatenate([[0], np.cumsum(q_lens)[:-1]])
    t = int(q_lens.sum()) + pad
    # jitted as the kernel's wrapper runs it (eagerly, each op compiles apart: ~1 s a case)
    table = np.asarray(jax.jit(fp.tile_table, static_argnums=4, static_argnames="causal")(
        jnp.asarray(starts), jnp.asarray(q_lens), jnp.asarray(q_lens + prefixes), jnp.arange(s), t,
        causal=True))
    owner = np.full(t, -1)
    for row8, lead, n, q_pos0, ctx, kv in table:
        if n == 0:
            continue
        row0 = row8 * 8
        assert 0 <= lead < 8 and lead + n <= TILE_Q
        rows = np.arange(row0 + lead, row0 + lead + n)
        assert (owner[rows] == -1).all(), "a token is covered twice"
        owner[rows] = kv if ctx > 0 else s  # the padding pseudo-sequence has no keys
        if ctx > 0:
            # context position of row0 + lead is that token's position
            seq_start, seq_len = starts[kv], q_lens[kv]
            assert q_pos0 + lead == ctx - seq_len + (row0 + lead - seq_start)
    expected = np.repeat(np.arange(s), q_lens)
    assert (owner[: len(expected)] == expected).all()
    assert (owner[len(expected):] == s).all()
    # Longest-first order: the causal work per tile never increases along the table.
    used = table[table[:, 2] > 0]
    work = np.minimum(used[:, 4], used[:, 3] + TILE_Q)
    assert (np.diff(work) <= 0).all()


# --------------------------------------------------------------------- Triton kernel, interpreted
TRITON_CASES = [  # hq, hkv, d, block_size, q_lens, prefixes, padding tokens, softcap
    (4, 4, 64, 16, [1, 37, 130], [0, 20, 45], 6, None),     # GQA 1
    (8, 2, 128, 32, [200, 5], [0, 300], 0, None),           # GQA 4, d 128
    (8, 1, 64, 16, [65, 1, 17], [127, 3, 0], 3, 30.0),      # GQA 8, soft-cap
]


@pytest.mark.parametrize("case", TRITON_CASES)
def test_triton_prefill_matches_reference(case):
    hq, hkv, d, bs, q_lens, prefixes, extra, cap = case
    args = _paged_batch(np.random.default_rng(hq * d + bs), hq=hq, hkv=hkv, d=d, block_size=bs,
                        q_lens=q_lens, prefixes=prefixes, extra=extra)
    out = fp.flash_prefill_triton(*args, scale=d ** -0.5, softcap=cap, interpret=True)
    ref = reference.ragged_prefill_reference(*args, scale=d ** -0.5, softcap=cap)
    used = sum(q_lens)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert _rel(out[:used], ref[:used]) < 1e-2  # bf16 operands
    assert not np.asarray(out[used:]).any(), "padding tokens must give zeros"


def test_triton_prefill_float16_is_tight():
    args = _paged_batch(np.random.default_rng(5), hq=4, hkv=2, d=64, block_size=32, q_lens=[40, 9],
                        prefixes=[70, 0], dtype=jnp.float16)
    out = fp.flash_prefill_triton(*args, scale=0.125, interpret=True)
    ref = reference.ragged_prefill_reference(*args, scale=0.125)
    assert _rel(out, ref) < 2e-3


# --------------------------------------------------------------- Mosaic GPU kernel, interpreted
# Few CTAs in a persistent grid, so each runs several (tile, head) items and the K/V ring and every
# barrier's phases carry across items, as in the engine (hundreds of items on 132 SMs). Prefixes at
# context positions that are not multiples of 128 give tiles where warpgroup 0 needs fewer K/V steps
# than warpgroup 1 and drains the rest -- the path that once skipped barrier phases and hung the
# engine on the H200; the interpreter rejects any phase a waiting thread does not observe.
# Each case costs ~6 s of the interpreter's compiles whatever its size, so each covers several
# things: the 3-stage ring runs in the 2-CTA case, where the K/V step count carries across 6 items
# and every slot is reused; GQA 1 and a grid of one item per CTA (a single round) run in the
# non-causal dense test below. The d 128 case reads an fp8 cache (the consumers widen the pages
# into their f16 staging tiles; the reference reads the same fp8 values): the other cases and the
# dense test read bf16 pages, and d 128 over bf16 pages lowers for CUDA below.
MOSAIC_INTERPRET_CASES = [  # (hq, hkv, d, block, q_lens, prefixes, extra, softcap, config, fp8)
    (2, 1, 64, 16, [130, 0, 9, 200], [140, 50, 75, 20], 3, None, KernelConfig(num_ctas=2), False),
    (4, 1, 128, 32, [65, 1, 3], [63, 0, 300], 0, 30.0, KernelConfig(num_ctas=3), True),
    (4, 2, 64, 16, [100, 7], [0, 200], 2, None,
     KernelConfig(num_ctas=2, block_kv=192, stages=3, rescale_threshold=2.0), False),
]


def _interpret_case_batch(case):
    """A MOSAIC_INTERPRET_CASES row's paged batch, its K/V pages quantized to fp8 where it says."""
    hq, hkv, d, bs, q_lens, prefixes, extra, *_, fp8 = case
    q, k, v, *rest = _paged_batch(np.random.default_rng(hq + d), hq=hq, hkv=hkv, d=d,
                                  block_size=bs, q_lens=q_lens, prefixes=prefixes, extra=extra)
    if fp8:
        k, v = quantize(k, 0.25), quantize(v, 0.25)
    return (q, k, v, *rest)


@pytest.mark.parametrize("case", MOSAIC_INTERPRET_CASES,
                         ids=lambda c: f"Hq{c[0]}_Hkv{c[1]}_d{c[2]}" + ("_fp8" if c[-1] else ""))
def test_mosaic_prefill_interpreted_matches_reference(case):
    hq, hkv, d, bs, q_lens, prefixes, extra, cap, config, fp8 = case
    args = _interpret_case_batch(case)
    q = jnp.full_like(args[0], jnp.nan)  # poison: rows past the batch must come out as zeros
    q = q.at[:sum(q_lens)].set(args[0][:sum(q_lens)])
    out = fp.flash_prefill_mosaic(q, *args[1:], scale=d ** -0.5, softcap=cap, config=config,
                                  interpret=True)
    ref = reference.ragged_prefill_reference(*args, scale=d ** -0.5, softcap=cap)
    t = sum(q_lens)
    assert out.dtype == q.dtype
    assert _rel(out[:t], ref[:t]) < 1e-2
    assert not np.asarray(out[t:]).any()


@pytest.mark.parametrize("causal", [True, False])
def test_mosaic_dense_attention_interpreted_matches_reference(causal):
    # Batch item 1 has gain 12: logits with std ~12, so row maxima jump past the lazy-rescale
    # threshold mid-item. Causal: 2 CTAs, several items each; non-causal: GQA 1 and the default
    # grid (one CTA per item, a single round).
    ks = jax.random.split(jax.random.key(3), 3)
    gain = jnp.array([1.0, 12.0])[:, None, None, None]
    q = (gain * jax.random.normal(ks[0], (2, 140, 2, 64), jnp.float32)).astype(jnp.bfloat16)
    hkv = 1 if causal else 2
    k, v = (jax.random.normal(kk, (2, 140, hkv, 64), jnp.float32).astype(jnp.bfloat16)
            for kk in ks[1:])
    config = KernelConfig(num_ctas=2) if causal else KernelConfig()
    out = fp.flash_attention(q, k, v, causal=causal, config=config, interpret=True)
    ref = reference.causal_attention_reference(q, k, v, scale=64 ** -0.5, causal=causal)
    for b in range(2):
        assert _rel(out[b], ref[b]) < 1e-2, b


def test_triton_prefill_over_an_fp8_cache_matches_reference():
    # The kernel widens the fp8 pages; the reference reads the same fp8 values. (The Mosaic
    # kernel's fp8 read runs in the interpreted d 128 case above, on this batch.)
    case = MOSAIC_INTERPRET_CASES[1]
    assert case[-1]  # the fp8 case
    d, q_lens, cap = case[2], case[4], case[7]
    q, k, v, *rest = _interpret_case_batch(case)
    out = fp.flash_prefill_triton(q, k, v, *rest, scale=d ** -0.5, softcap=cap, interpret=True)
    ref = reference.ragged_prefill_reference(q, k, v, *rest, scale=d ** -0.5, softcap=cap)
    t = sum(q_lens)
    assert out.dtype == q.dtype
    assert _rel(out[:t], ref[:t]) < 1e-2
    assert not np.asarray(out[t:]).any()


# ------------------------------------------------------------------ Mosaic GPU kernel, lowering
def _lower_for_cuda(fn, *avals):
    return jax.jit(fn).trace(*avals).lower(lowering_platforms=("cuda",)).as_text()


# Every supported dtype / head_dim / page size, each case with one of the kernel configs in use
# (a lowering costs ~5 s, whatever its shape: the configs ride on the dtype cases).
@pytest.mark.parametrize("dtype,cache_dtype,d,block_size,softcap,config", [
    (jnp.bfloat16, jnp.bfloat16, 128, 16, None, KernelConfig()),
    (jnp.float16, jnp.float16, 64, 32, 50.0, KernelConfig(block_kv=192)),
    (jnp.bfloat16, jnp.float8_e4m3fn, 128, 16, None,
     KernelConfig(rescale_threshold=2.0, consumer_registers=232, producer_registers=40)),
    (jnp.bfloat16, jnp.float8_e4m3fn, 64, 32, None, KernelConfig(stages=3))],
    ids=["bf16-d128-p16", "f16-d64-p32-softcap-block_kv192", "fp8-d128-p16-rescale-registers",
         "fp8-d64-p32-stages3"])
def test_mosaic_paged_prefill_lowers_for_cuda(dtype, cache_dtype, d, block_size, softcap, config):
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
    cache = jax.ShapeDtypeStruct((2, 40, block_size, d), cache_dtype)
    text = _lower_for_cuda(
        functools.partial(fp.flash_prefill_mosaic, scale=0.1, softcap=softcap, config=config),
        jax.ShapeDtypeStruct((300, 8, d), dtype), cache, cache, i32(4), i32(3), i32(3, 9))
    assert "mosaic_gpu" in text
    # The tile table's search is one fused compare: no while loop (on the GPU, possibly a
    # device -> host round trip per iteration) in any prefill call.
    assert "stablehlo.while" not in text


@pytest.mark.parametrize("causal", [True, False])
def test_mosaic_dense_attention_lowers_for_cuda(causal):
    q = jax.ShapeDtypeStruct((2, 300, 8, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, 300, 2, 128), jnp.bfloat16)
    text = _lower_for_cuda(functools.partial(fp.flash_attention, causal=causal), q, kv, kv)
    assert "mosaic_gpu" in text
    # Dense shapes are static: the tile table is a constant, no device op builds it.
    for op in ("stablehlo.sort", "stablehlo.while", "stablehlo.gather", "stablehlo.iota"):
        assert op not in text, op


def test_kernel_config_rejects_bad_values():
    with pytest.raises(ValueError, match="block_kv"):
        KernelConfig(block_kv=100)
    with pytest.raises(ValueError, match="stages"):
        KernelConfig(stages=1)
    with pytest.raises(ValueError, match="rescale_threshold"):  # the stale-max step keeps a max
        KernelConfig(rescale_threshold=0.0)
    with pytest.raises(ValueError, match="num_ctas"):
        KernelConfig(num_ctas=0)
    with pytest.raises(ValueError, match="registers"):
        KernelConfig(consumer_registers=256, producer_registers=40)
    with pytest.raises(ValueError, match="shared memory"):  # 4 stages of 192 keys do not fit
        q = jax.ShapeDtypeStruct((1, 256, 4, 128), jnp.bfloat16)
        kv = jax.ShapeDtypeStruct((1, 256, 4, 128), jnp.bfloat16)
        jax.jit(functools.partial(fp.flash_attention, config=KernelConfig(block_kv=192, stages=4))
                ).trace(q, kv, kv)
    with pytest.raises(ValueError, match="block_size"):  # paged: pages must tile a K/V block
        cache = jnp.zeros((1, 4, 128, 64), jnp.bfloat16)
        fp.flash_prefill_mosaic(jnp.zeros((8, 1, 64), jnp.bfloat16), cache, cache,
                                jnp.array([0, 8]), jnp.array([8]), jnp.zeros((1, 4), jnp.int32),
                                scale=1.0, config=KernelConfig(block_kv=192))


# ------------------------------------------------------------------------------- bad input
def test_bad_inputs_name_the_field():
    args = list(_paged_batch(np.random.default_rng(0), hq=4, hkv=2, d=64, block_size=16,
                             q_lens=[3], prefixes=[0]))
    with pytest.raises(ValueError, match="dtype"):
        fp.flash_prefill_mosaic(args[0].astype(jnp.float32), *args[1:], scale=1.0)
    with pytest.raises(ValueError, match="head_dim"):
        q = jnp.zeros((3, 4, 96), jnp.bfloat16)
        fp.flash_attention(q[None], jnp.zeros((1, 3, 2, 96), jnp.bfloat16),
                           jnp.zeros((1, 3, 2, 96), jnp.bfloat16))
    with pytest.raises(ValueError, match="num_kv_heads"):
        fp.flash_prefill_triton(jnp.zeros((3, 3, 64), jnp.bfloat16), *args[1:], scale=1.0)
    with pytest.raises(ValueError, match="block_size"):
        cache = jnp.zeros((2, 4, 24, 64), jnp.bfloat16)
        fp.flash_prefill_mosaic(args[0], cache, cache, *args[3:], scale=1.0)
    with pytest.raises(ValueError, match="softcap"):
        fp.flash_prefill_mosaic(*args, scale=1.0, softcap=-1.0)
