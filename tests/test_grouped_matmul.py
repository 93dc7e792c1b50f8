"""Grouped matmul for routed experts: CPU tests.

What runs where:
  - The tile table (how rows sorted by expert are cut into tiles) is checked against the rows it
    must cover, on random group sizes with empty groups, one hot group and unused trailing rows.
  - The Mosaic GPU kernel runs in Mosaic GPU's interpreter against the float32 jnp reference, plain
    and with the fused SwiGLU, on persistent grids of 2-3 CTAs (so units loop and the TMA ring and
    output stores carry across units), and is *lowered* for CUDA (Pallas -> Mosaic GPU MLIR:
    layout, tiling and TMA-alignment errors) at model shapes with the tilings `moe_experts` picks.
  - `moe_experts` is checked against the reference for every implementation.
Real sizes and speed are checked on the H200 by `jaxinfer/bench/suites/moe.py`.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.moe import grouped_matmul as gm
from pallas_kernels.moe.grouped_matmul_mosaic import (GmmConfig, grouped_matmul_mosaic, num_tiles,
                                                      tile_table)
from pallas_kernels.moe.grouped_matmul_ws import WsConfig
from pallas_kernels.common.testing import ragged_group_sizes


def _rel(out, ref) -> float:
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


# ------------------------------------------------------------------------------------ tile table
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("block_m", [64, 128])
def test_tile_table_covers_every_row_once(seed, block_m):
    rng = np.random.default_rng(seed)
    groups = int(rng.integers(1, 40))
    rows = 8 * int(rng.integers(block_m // 8, 120))
    sizes = ragged_group_sizes(rng, groups, int(rng.integers(0, rows + 1)),
                               "hot" if seed == 0 else "random")
    used = int(sizes.sum())
    # jitted as the kernel's wrapper runs it (eagerly, each op compiles apart: ~1 s a case)
    table = np.asarray(jax.jit(tile_table, static_argnums=(1, 2))(jnp.asarray(sizes, jnp.int32),
                                                                  rows, block_m))
    assert table.shape == (num_tiles(rows, groups, block_m), 4)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    owner = np.full(rows, -1)
    tiles_of = np.zeros(groups, int)
    for group, row0, load8, n in table:
        if n == 0:
            continue
        load0 = load8 * 8
        assert 0 < n <= block_m
        assert 0 <= load0 <= row0 and row0 + n <= load0 + block_m <= rows  # window holds the tile
        assert starts[group] <= row0 and row0 + n <= starts[group] + sizes[group]
        assert (owner[row0:row0 + n] == -1).all(), "a row is covered twice"
        owner[row0:row0 + n] = group
        tiles_of[group] += 1
    assert (owner[:used] == np.repeat(np.arange(groups), sizes)).all()
    assert (owner[used:] == -1).all()
    # A group that fits one window from its 8-row boundary is one tile: its weights stream once.
    fits = (sizes > 0) & (sizes + starts % 8 <= block_m)
    assert (tiles_of[fits] == 1).all()


# ------------------------------------------------------------------ Mosaic GPU kernel, interpreted
INTERPRET_CASES = [  # rows, K, N, groups, rows to split, kind, config, fused
    # The one-warpgroup kernel: SwiGLU over several CTAs, and one stack with rows < block_m.
    (203, 128, 128, 6, 190, "random", GmmConfig(64, 128, 32, 3, num_ctas=2), True),
    (40, 128, 64, 7, 37, "random", GmmConfig(64, 64, 64, 2, num_ctas=2), False),
    # The warp-specialised kernel: consumers split by M (a group's rows may fall in one consumer's
    # half only) and by N (one hot group).
    (301, 128, 128, 6, 290, "random", WsConfig(128, 128, 64, 3, "m", num_ctas=3), True),
    (40, 128, 192, 5, 37, "random", WsConfig(128, 192, 64, 2, "m", num_ctas=2), False),
    (136, 128, 256, 4, 136, "hot", WsConfig(64, 256, 32, 3, "n", num_ctas=2), True),
    # CTAs with several units, one unit and none.
    (300, 128, 128, 6, 297, "random", WsConfig(128, 128, 64, 2, "m", num_ctas=2), False),
    (200, 256, 256, 5, 197, "random", WsConfig(64, 256, 32, 4, "n", num_ctas=3), True),
]


@pytest.mark.parametrize("case", INTERPRET_CASES, ids=lambda c: f"{c[0]}x{c[1]}x{c[2]}g{c[3]}"
                         f"{c[5]}{'-swiglu' if c[7] else ''}")
def test_mosaic_interpreted_matches_reference(case):
    rows, k, n, groups, split, kind, config, fused = case
    rng = np.random.default_rng(rows + n)
    sizes = jnp.asarray(ragged_group_sizes(rng, groups, split, kind), jnp.int32)
    used = int(sizes.sum())
    x = jnp.asarray(rng.standard_normal((rows, k)), jnp.bfloat16)
    ws = tuple(jnp.asarray(rng.standard_normal((groups, k, n)) * k ** -0.5, jnp.bfloat16)
               for _ in range(2 if fused else 1))
    out = gm.gmm(x, ws, sizes, config, interpret=True)
    ref = gm.gmm_reference(x, ws, sizes)
    assert out.shape == (rows, n) and out.dtype == jnp.bfloat16
    assert _rel(out[:used], ref[:used]) < 1e-2


def test_moe_experts_every_impl_matches_reference():
    """Every path, with gate and up as two stacks or as one [E, H, 2F]; 8-bit stacks fused with
    their scales concatenated (the kernel hands those to XLA) give the two-stack result."""
    rng = np.random.default_rng(7)
    tokens, top_k, groups, h, f = 24, 2, 8, 128, 64
    rows = tokens * top_k
    sizes = jnp.asarray(ragged_group_sizes(rng, groups, rows, "random"), jnp.int32)
    used = int(sizes.sum())  # rows past the groups are undefined
    x = jnp.asarray(rng.standard_normal((rows, h)), jnp.bfloat16)
    ws = tuple(jnp.asarray(rng.standard_normal(s) * s[1] ** -0.5, jnp.bfloat16)
               for s in [(groups, h, f), (groups, h, f), (groups, f, h)])
    fused = (jnp.concatenate(ws[:2], axis=-1), ws[2])
    ref = gm.moe_experts_reference(x, ws, sizes)
    np.testing.assert_array_equal(np.asarray(gm.moe_experts_reference(x, fused, sizes)),
                                  np.asarray(ref))
    for impl in gm.IMPLS:
        for w in (ws, fused):
            out = gm.moe_experts(x, w, sizes, max_group_size=tokens, impl=impl,
                                 interpret=impl == "mosaic")
            assert _rel(out[:used], ref[:used]) < 1e-2, (impl, len(w))
    q = tuple(w.astype(gm.FP8) for w in ws)
    scales = tuple(jnp.asarray(rng.uniform(0.5, 2, (groups, w.shape[2])), jnp.float32) for w in q)
    two = gm.moe_experts(x, q, sizes, impl="ragged", scales=scales)
    one = gm.moe_experts(x, (jnp.concatenate(q[:2], axis=-1), q[2]), sizes, impl="mosaic",
                         gpu=True, hopper=True,
                         scales=(jnp.concatenate(scales[:2], axis=-1), scales[2]))
    assert _rel(one[:used], two[:used]) < 1e-2


def test_gpt_oss_experts_every_impl_matches_a_float32_oracle():
    """Biases and the clamped SwiGLU (gpt-oss) on every path, with gate and up as two stacks or
    fused as one [E, H, 2F] (the layout one GPU serves); the kernel runs them as plain grouped
    matmuls then. The oracle: each row's expert in float32, one at a time."""
    rng = np.random.default_rng(8)
    tokens, top_k, groups, h, f = 24, 2, 8, 128, 64
    rows = tokens * top_k
    sizes = jnp.asarray(ragged_group_sizes(rng, groups, rows, "random"), jnp.int32)
    used = int(sizes.sum())
    x = jnp.asarray(rng.standard_normal((rows, h)), jnp.bfloat16)
    ws = tuple(jnp.asarray(rng.standard_normal(s) * 3 * s[1] ** -0.5, jnp.bfloat16)
               for s in [(groups, h, f), (groups, h, f), (groups, f, h)])
    biases = tuple(jnp.asarray(rng.standard_normal((groups, f)), jnp.bfloat16) for _ in range(2))
    glu = gm.ClampedSwiGLU(alpha=1.702, limit=1.5)  # small limit: the clamps act
    gid = np.repeat(np.arange(groups), np.asarray(sizes))
    xf, wf = np.asarray(x, np.float32), [np.asarray(w, np.float32) for w in ws]
    bf = [np.asarray(b, np.float32) for b in biases]
    gate = np.einsum("rh,rhf->rf", xf[:used], wf[0][gid]) + bf[0][gid]
    up = np.einsum("rh,rhf->rf", xf[:used], wf[1][gid]) + bf[1][gid]
    gate, up = np.minimum(gate, 1.5), np.clip(up, -1.5, 1.5)
    act = (up + 1) * gate / (1 + np.exp(-1.702 * gate))
    ref = np.einsum("rf,rfh->rh", act, wf[2][gid])
    fused = (jnp.concatenate(ws[:2], axis=-1), ws[2]), (jnp.concatenate(biases, axis=-1),)
    for impl in gm.IMPLS:
        for w, b in ((ws, biases), fused):
            out = gm.moe_experts(x, w, sizes, max_group_size=tokens, impl=impl,
                                 interpret=impl == "mosaic", glu=glu, biases=b)
            assert _rel(out[:used], ref) < 2e-2, (impl, len(w))


def test_dispatch_choice_and_config():
    shape = (128, 2048, 768)
    assert gm.choose_impl(512, shape, 64, jnp.bfloat16) == "ragged"  # CPU: XLA's exact path
    assert gm.choose_impl(512, shape, 64, jnp.bfloat16, impl="padded") == "padded"
    assert gm.choose_impl(512, shape, 64, jnp.bfloat16, impl="xla") == "ragged"
    with pytest.raises(ValueError, match="moe_impl 'fast'"):
        gm.choose_impl(512, shape, 64, jnp.bfloat16, impl="fast")
    # Measured choices (the MoE suite, H200): Qwen3-MoE decode and prefill and Mixtral prefill on the
    # kernel, Mixtral decode (8 experts, 16 rows each) on the padded einsum; without the kernel the
    # padded einsum (E / k = 16x the rows: it beat ragged_dot at both phases), ragged_dot past that.
    pick = functools.partial(gm.pick_impl, gpu=True)
    assert pick(512, 128, 64, kernel=True) == "mosaic"
    assert pick(16384, 128, 2048, kernel=True) == "mosaic"
    assert pick(128, 8, 64, kernel=True) == "padded"
    assert pick(4096, 8, 2048, kernel=True) == "mosaic"
    assert pick(512, 128, 64, kernel=False) == "padded"
    assert pick(16384, 128, 2048, kernel=False) == "padded"
    assert pick(8192, 256, 2048, kernel=False) == "ragged"  # 256 experts, top-4: 64x
    assert gm.pick_impl(512, 128, 64, gpu=False, kernel=False) == "ragged"
    # Decode (consumers split N) and prefill (split M) tilings of the warp-specialised kernel; an N
    # a block does not divide narrows it or falls back to the one-warpgroup kernel's 64 columns.
    decode, prefill = gm.mosaic_configs(512, 128), gm.mosaic_configs(16384, 128)
    assert [c.split for c in decode + prefill] == ["n", "n", "m", "m"]
    assert gm._fit(WsConfig(64, 256, 64, 4, "n"), 768 + 128).block_n == 128
    assert gm._fit(WsConfig(128, 128, 64, 4, "m"), 768 + 64) == GmmConfig(128, 64, 64, 4)
    # gpt-oss's N = 2880 at decode: the consumers split 128-row windows of 192 columns (plain
    # calls); a fused SwiGLU's two accumulators would not fit those registers.
    assert gm._fit(WsConfig(64, 128, 64, 4, "n"), 2880) == WsConfig(128, 192, 64, 4, "m")
    assert gm._fit(WsConfig(64, 128, 64, 4, "n"), 2880, stacks=2) == GmmConfig(64, 64, 64, 4)
    assert gm.mosaic_supports(2048, 768, jnp.bfloat16)
    assert not gm.mosaic_supports(2048, 768, jnp.float32)
    assert not gm.mosaic_supports(2048, 100, jnp.bfloat16)


# ------------------------------------------------------------------ Mosaic GPU kernel, lowering
def _lower_for_cuda(fn, *avals):
    return jax.jit(fn).trace(*avals).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("shape", [(64, 128, 2048, 768, 8), (2048, 128, 2048, 768, 8),
                                   (2048, 8, 4096, 14336, 2)],
                         ids=["qwen3-decode", "qwen3-prefill", "mixtral-prefill"])
def test_mosaic_lowers_for_cuda_once_per_shape(shape):
    tokens, experts, h, f, top_k = shape
    s = jax.ShapeDtypeStruct
    weights = (s((experts, h, f), jnp.bfloat16),) * 2 + (s((experts, f, h), jnp.bfloat16),)

    def layers(x, ws, sizes):  # three layers' expert MLPs: the kernels must lower once each
        for _ in range(3):
            x = gm.moe_experts(x, ws, sizes, max_group_size=tokens, impl="mosaic")
        return x

    text = _lower_for_cuda(layers, s((tokens * top_k, h), jnp.bfloat16), weights,
                           s((experts,), jnp.int32))
    # Two kernels (fused gate/up, down), each lowered once however many layers call it.
    assert text.count("stablehlo.custom_call @mosaic_gpu") == 2


def test_config_and_inputs_are_checked():
    with pytest.raises(ValueError, match="block_m"):
        GmmConfig(block_m=32)
    with pytest.raises(ValueError, match="block_n"):
        GmmConfig(block_n=96)
    with pytest.raises(ValueError, match="shared memory"):
        GmmConfig(64, 128, 64, 6).check(2)
    with pytest.raises(ValueError, match="registers"):
        GmmConfig(128, 128, 64, 2).check(2)
    with pytest.raises(ValueError, match="split"):
        WsConfig(split="k")
    with pytest.raises(ValueError, match="block_m"):
        WsConfig(64, 128, 64, 2, "m")
    with pytest.raises(ValueError, match="block_n"):
        WsConfig(64, 192, 64, 2, "n")
    with pytest.raises(ValueError, match="shared memory"):
        WsConfig(64, 256, 64, 4, "n").check(2)
    with pytest.raises(ValueError, match="registers"):
        WsConfig(128, 256, 64, 2, "m").check(2)
    x = jnp.zeros((64, 128), jnp.bfloat16)
    w = jnp.zeros((4, 128, 128), jnp.bfloat16)
    with pytest.raises(ValueError, match="group_sizes"):
        grouped_matmul_mosaic(x, (w,), jnp.zeros(3, jnp.int32), interpret=True)
    with pytest.raises(ValueError, match="weights"):
        grouped_matmul_mosaic(x, (w.astype(jnp.float16),), jnp.zeros(4, jnp.int32), interpret=True)
    with pytest.raises(ValueError, match="impl"):
        gm.moe_experts(x, (w, w, w), jnp.zeros(4, jnp.int32), impl="dense")


@pytest.mark.parametrize("block_m,split", [(128, "m"), (64, "n")])
def test_bench_counts_the_rows_the_kernel_computes(block_m, split):
    """jaxinfer.bench.suites.moe_kernels.computed_rows (the record's `real_row_frac`) against a count per
    group of the windows it takes (8-row-aligned start, block_m rows, the last clamped inside x)
    and, split "m", of the halves holding its rows; ragged sizes with empty groups, one giant
    group and sizes off the tile size."""
    from jaxinfer.bench.suites.moe_kernels import computed_rows
    from pallas_kernels.moe.grouped_matmul_mosaic import padded_rows
    rng = np.random.default_rng(block_m)
    for sizes in (ragged_group_sizes(rng, 9, 517, "random"), ragged_group_sizes(rng, 5, 300, "hot"),
                  np.array([0, 131, 0, 64, 7, 250, 1])):
        rows = int(sizes.sum())
        padded, want = padded_rows(rows, block_m), 0
        for start, size in zip(np.cumsum(sizes) - sizes, sizes):
            for w in range(start // 8 * 8, start + size, block_m) if size else ():
                load0 = min(w, padded - block_m)
                lo, hi = max(start, w) - load0, min(start + size, w + block_m) - load0
                if split == "n":
                    want += block_m
                else:
                    want += block_m // 2 * (int(lo < block_m // 2) + int(hi > block_m // 2))
        config = WsConfig(block_m, 128, 64, 3, split)
        assert computed_rows(jnp.asarray(sizes, jnp.int32), rows, config) == want


@pytest.mark.parametrize("fused", [False, True])
def test_gpt_oss_decode_lowers_for_cuda_on_the_wide_tiling(fused):
    """gpt-oss-20b at batch 1 (N = 2880, not a multiple of 128), lowered for an H100: gate, up
    and down as plain calls on `_fit`'s 192-column warp-specialised tiling, or gate and up as one
    call on their fused stack (N = 5760, a multiple of 128: the decode tiling) then down."""
    tokens, experts, h, f, top_k = 1, 32, 2880, 2880, 4
    s = jax.ShapeDtypeStruct
    weights = (s((experts, h, f), jnp.bfloat16),) * 2 + (s((experts, f, h), jnp.bfloat16),)
    biases = (s((experts, f), jnp.bfloat16),) * 2
    if fused:
        weights = (s((experts, h, 2 * f), jnp.bfloat16), weights[2])
        biases = (s((experts, 2 * f), jnp.bfloat16),)

    def layer(x, ws, sizes, biases):
        return gm.moe_experts(x, ws, sizes, max_group_size=tokens, impl="mosaic",
                              glu=gm.ClampedSwiGLU(), biases=biases)

    text = _lower_for_cuda(layer, s((tokens * top_k, h), jnp.bfloat16), weights,
                           s((experts,), jnp.int32), biases)
    assert "grouped_matmul_ws" in text and "stablehlo.custom_call @mosaic_gpu" in text
