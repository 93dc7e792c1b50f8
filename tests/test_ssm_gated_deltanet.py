"""Gated DeltaNet (pallas_kernels/ssm/gated_deltanet.py): the kernels in Pallas' interpreter against
the jnp references on random ragged batches (padding tokens, padding sequences, zero-length and
one-token sequences, GQA, fresh and continued states), the chunked reference against the
token-by-token recurrence, state carried across prefill chunks and into decode, the slots no
sequence names left bit-identical, and the kernels lowered for CUDA."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.common.testing import random_ragged_batch
from pallas_kernels.ssm import gated_deltanet as gdn
from pallas_kernels.ssm.batch import chunk_table, first_chunks, live_tokens
from pallas_kernels.ssm.reference import gdn_gating
from ssm_support import (assert_close, assert_other_slots_untouched, lower_for_cuda, normal,
                         split_batch)

import kernel_references as reference

pytestmark = pytest.mark.slow  # ~1 min on the loaded 2-core CI machine: its xdist group first

CHUNK = 16
NUM_SLOTS = 8


@functools.partial(jax.jit, static_argnames=("use_qk_l2norm", "block_v", "chunk", "ut_solve"))
def prefill(q, k, v, g, beta, pool, cu, slots, init, src_slots=None, use_qk_l2norm=True,
            block_v=16, chunk=CHUNK, ut_solve="rows"):
    return gdn.gdn_prefill(q, k, v, g, beta, pool, cu, slots, init, src_slots=src_slots,
                           use_qk_l2norm=use_qk_l2norm, chunk_size=chunk, block_v=block_v,
                           ut_solve=ut_solve, interpret=True)


@functools.partial(jax.jit, static_argnames=("block_v",))
def decode(q, k, v, g, beta, pool, slots, src_slots=None, block_v=16):
    return gdn.gdn_decode(q, k, v, g, beta, pool, slots, src_slots=src_slots, block_v=block_v,
                          interpret=True)


def inputs(seed, t, *, hk=2, hv=4, kd=16, vd=32, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    q = normal(rng, (t, hk, kd), dtype)
    k = normal(rng, (t, hk, kd), dtype)
    v = normal(rng, (t, hv, vd), dtype)
    # HF's gating with A in [1, 8]: per-token decays from ~0.9 down to strong forgetting.
    g, beta = jax.jit(gdn_gating)(normal(rng, (t, hv)), normal(rng, (t, hv)),
                                  np.log(np.linspace(1.0, 8.0, hv, dtype=np.float32)),
                                  np.ones((hv,), np.float32))
    pool = normal(rng, (NUM_SLOTS, hv, kd, vd))
    return q, k, v, g, beta, pool


def batch(seed, lens, *, extra=3, dead=1):
    return random_ragged_batch(np.random.default_rng(seed), lens, NUM_SLOTS, extra_tokens=extra,
                               dead=dead)


LENS = [37, 0, 1, 16, 9, 5]  # several chunks, empty, decode-sized, one exact chunk, a dead row


@pytest.mark.parametrize("l2", [True, False])
def test_chunked_reference_is_the_recurrence(l2):
    t, cu, slots, init = batch(0, LENS)
    args = (*inputs(0, t), cu, slots, init)
    o1, p1 = reference.gdn_recurrent_reference(*args, use_qk_l2norm=l2)
    o2, p2 = reference.gdn_chunked_reference(*args, use_qk_l2norm=l2, chunk_size=CHUNK)
    assert_close(o2, o1, 1e-5)
    assert_close(p2, p1, 1e-5)
    live = int(cu[-1])
    assert not np.asarray(o1[live:]).any(), "padding tokens must come out zero"


@pytest.mark.parametrize("seed, hk, hv, vd, block_v, l2", [
    (1, 2, 4, 32, 16, True),   # GQA 2, two V blocks
    (2, 4, 4, 16, 16, False),  # no GQA, no L2 norm
    (3, 1, 2, 32, 32, True),   # one V block
])
def test_prefill_matches_reference(seed, hk, hv, vd, block_v, l2):
    t, cu, slots, init = batch(seed, LENS)
    q, k, v, g, beta, pool = inputs(seed, t, hk=hk, hv=hv, vd=vd)
    o, new = prefill(q, k, v, g, beta, pool, cu, slots, init, use_qk_l2norm=l2, block_v=block_v)
    o_ref, p_ref = reference.gdn_recurrent_reference(q, k, v, g, beta, pool, cu, slots, init,
                                                     use_qk_l2norm=l2)
    assert_close(o, o_ref, 2e-5)
    assert_close(new, p_ref, 2e-5)
    assert_other_slots_untouched(pool, new, slots)
    assert not np.asarray(o[int(cu[-1]):]).any()


@pytest.mark.parametrize("seed, lens, chunk, ut_solve", [
    (11, [150, 0, 1, 64, 40], 64, "rows"),  # four 16-row blocks of the UT transform
    (12, [70, 33, 1], 32, "rows"),  # the default chunk
    (13, [150, 0, 1, 64, 40], 64, "doubling"),  # the diagonal blocks inverted by dots
    (14, [70, 33, 1], 32, "doubling"),
])
def test_prefill_long_chunks_match_reference(seed, lens, chunk, ut_solve):
    t, cu, slots, init = batch(seed, lens)
    q, k, v, g, beta, pool = inputs(seed, t)
    o, new = prefill(q, k, v, g, beta, pool, cu, slots, init, chunk=chunk, ut_solve=ut_solve)
    o_ref, p_ref = reference.gdn_recurrent_reference(q, k, v, g, beta, pool, cu, slots, init)
    assert_close(o, o_ref, 2e-5)
    assert_close(new, p_ref, 2e-5)
    assert_other_slots_untouched(pool, new, slots)


def test_prefill_bf16_inputs():
    t, cu, slots, init = batch(4, [40, 3, 18])
    q, k, v, g, beta, pool = inputs(4, t, dtype=jnp.bfloat16)
    o, new = prefill(q, k, v, g, beta, pool, cu, slots, init)
    o_ref, p_ref = reference.gdn_recurrent_reference(q, k, v, g, beta, pool, cu, slots, init)
    assert o.dtype == jnp.bfloat16
    assert_close(o, o_ref, 3e-2)  # matmul operands in bf16, as fla's
    assert_close(new, p_ref, 3e-2)


def test_prefill_in_two_chunks_equals_one():
    lens = [37, 20, 1, 9]
    t, cu, slots, init = batch(5, lens, extra=0, dead=0)
    q, k, v, g, beta, pool = inputs(5, t)
    o_all, p_all = prefill(q, k, v, g, beta, pool, cu, slots, init)
    idx1, cu1, idx2, cu2 = split_batch(cu, [19, 16, 0, 4])  # mid-chunk, on a chunk, empty first
    parts = lambda idx: [x[idx] for x in (q, k, v, g, beta)]
    o1, p1 = prefill(*parts(idx1), pool, jnp.asarray(cu1), slots, init)
    o2, p2 = prefill(*parts(idx2), p1, jnp.asarray(cu2), slots, jnp.ones_like(init))
    assert_close(o1, o_all[idx1], 2e-5)
    assert_close(o2, o_all[idx2], 2e-5)
    assert_close(p2, p_all, 2e-5)


def test_prefill_then_decode_steps_equals_whole_prefill():
    lens, steps = [21, 4, 3], 3
    t, cu, slots, init = batch(6, lens, extra=0, dead=0)
    q, k, v, g, beta, pool = inputs(6, t)
    o_all, p_all = prefill(q, k, v, g, beta, pool, cu, slots, init)
    idx1, cu1, _, _ = split_batch(cu, [n - steps for n in lens])
    o1, state = prefill(*[x[idx1] for x in (q, k, v, g, beta)], pool, jnp.asarray(cu1), slots,
                        init)
    assert_close(o1, o_all[idx1], 2e-5)
    for i in range(steps):
        rows = np.asarray(cu[1:]) - steps + i
        o, state = decode(*[x[rows] for x in (q, k, v, g, beta)], state, slots)
        assert_close(o, o_all[rows], 2e-5)
    assert_close(state, p_all, 2e-5)


def test_decode_matches_reference_and_leaves_other_slots():
    s = 5
    q, k, v, g, beta, pool = inputs(7, s, hk=1, hv=2)
    slots = jnp.asarray([6, 2, -1, 0, 3], jnp.int32)
    o, new = decode(q, k, v, g, beta, pool, slots)
    o_ref, p_ref = reference.gdn_decode_reference(q, k, v, g, beta, pool, slots)
    assert_close(o, o_ref, 1e-5)
    assert_close(new, p_ref, 1e-5)
    assert_other_slots_untouched(pool, new, slots)
    assert not np.asarray(o[2]).any(), "a padding row (slot -1) comes out zero"


def test_mixed_step_decode_rows_as_length_one_sequences():
    """A step mixing prefill and decode runs as one prefill batch whose decode rows have one
    token each; those rows match the decode kernel on the same slots."""
    lens = [1, 25, 1, 1]
    t, cu, slots, _ = batch(8, lens, extra=0, dead=0)
    init = jnp.asarray([True, False, True, True])
    q, k, v, g, beta, pool = inputs(8, t)
    o_mixed, p_mixed = prefill(q, k, v, g, beta, pool, cu, slots, init)
    rows = np.asarray(cu[:-1])[[0, 2, 3]]
    dec_slots = slots[jnp.asarray([0, 2, 3])]
    o_dec, p_dec = decode(*[x[rows] for x in (q, k, v, g, beta)], pool, dec_slots)
    assert_close(o_mixed[rows], o_dec, 2e-5)
    assert_close(p_mixed[dec_slots], p_dec[dec_slots], 2e-5)


def test_states_move_from_source_to_destination_slots():
    """A state cache keeping each block's state in its own page reads one slot and writes
    another: the results are the in-place ones, moved; the sources keep their bits."""
    t, cu, src, init = batch(10, [23, 1, 7], extra=0, dead=0)
    q, k, v, g, beta, pool = inputs(10, t)
    dst = jnp.asarray(np.setdiff1d(np.arange(NUM_SLOTS), np.asarray(src))[:3], jnp.int32)
    o, new = prefill(q, k, v, g, beta, pool, cu, dst, init, src_slots=src)
    o_in_place, p_in_place = prefill(q, k, v, g, beta, pool, cu, src, init)
    np.testing.assert_array_equal(np.asarray(o), np.asarray(o_in_place))
    np.testing.assert_array_equal(np.asarray(new)[np.asarray(dst)],
                                  np.asarray(p_in_place)[np.asarray(src)])
    assert_other_slots_untouched(pool, new, dst)
    o_ref, p_ref = reference.gdn_recurrent_reference(q, k, v, g, beta, pool, cu, dst, init,
                                                     src_slots=src)
    assert_close(o, o_ref, 2e-5)
    assert_close(new, p_ref, 2e-5)
    rows = np.asarray(cu[:-1])
    o, moved = decode(*[x[rows] for x in (q, k, v, g, beta)], pool, dst, src_slots=src)
    o_ref, p_ref = reference.gdn_decode_reference(*[x[rows] for x in (q, k, v, g, beta)], pool,
                                                  dst, src_slots=src)
    assert_close(o, o_ref, 1e-5)
    assert_close(moved, p_ref, 1e-5)
    assert_other_slots_untouched(pool, moved, dst)


@pytest.mark.parametrize("seed", range(3))
def test_chunk_table_covers_every_live_token_once(seed):
    rng = np.random.default_rng(seed)
    lens = list(rng.integers(0, 60, int(rng.integers(1, 6))))
    t, cu, slots, _ = random_ragged_batch(rng, lens, NUM_SLOTS, extra_tokens=5,
                                          dead=int(rng.integers(0, 2)))
    table = np.asarray(jax.jit(chunk_table, static_argnums=(2, 3))(cu, slots, t, CHUNK))
    firsts = np.asarray(first_chunks(cu, slots, CHUNK))
    for s in np.flatnonzero((np.asarray(slots) >= 0) & (np.diff(np.asarray(cu)) > 0)):
        assert tuple(table[firsts[s]]) == (int(cu[s]), min(CHUNK, int(cu[s + 1] - cu[s])))
    owner = np.zeros(t, int)
    for row0, n in table:
        assert 0 <= n <= CHUNK
        owner[row0:row0 + n] += 1
        if n:  # one sequence's rows, starting a whole number of chunks into it
            s = int(np.searchsorted(np.asarray(cu[1:]), row0, side="right"))
            assert row0 + n <= cu[s + 1] and (row0 - cu[s]) % CHUNK == 0
    live = np.asarray(live_tokens(cu, slots, t))
    np.testing.assert_array_equal(owner, live.astype(int))


def test_unit_lower_inverse_is_the_inverse():
    rng = np.random.default_rng(9)
    lower = np.tril(rng.normal(size=(16, 16)), -1).astype(np.float32) * 0.3
    inv = jax.jit(gdn.unit_lower_inverse)(jnp.asarray(lower))
    np.testing.assert_allclose(np.asarray(inv) @ (np.eye(16) + lower), np.eye(16), atol=1e-5)
    other = np.tril(rng.normal(size=(16, 16)), -1).astype(np.float32) * 0.3
    both = jax.jit(gdn.unit_lower_inverse)(jnp.asarray(lower), jnp.asarray(other))
    for m, inv in zip((lower, other), both):  # one shared loop, each its own inverse
        np.testing.assert_allclose(np.asarray(inv) @ (np.eye(16) + m), np.eye(16), atol=1e-5)
    # By doubling, at float32's precision: random blocks, and correlated keys' (A near 1 below
    # the diagonal: powers in the thousands that cancel to an inverse of entries <= 1).
    correlated = np.tril(np.full((16, 16), 0.99, np.float32), -1)
    for m, atol in ((lower, 1e-5), (other, 1e-5), (correlated, 1e-3)):
        inv = jax.jit(gdn.unit_lower_inverse_by_doubling)(jnp.asarray(m))
        np.testing.assert_allclose(np.asarray(inv), np.linalg.inv(np.eye(16) + m), atol=atol)


def test_flops_count_real_rows():
    one = gdn.gdn_prefill_flops([64], 1, 128, 128)
    assert one == 6 * 64 ** 2 * 128 + 4 * 64 ** 2 * 128 + 6 * 64 * 128 * 128 + 64 ** 3 / 3
    assert gdn.gdn_prefill_flops([100, 0], 2, 128, 128) == 2 * (
        one + gdn.gdn_prefill_flops([36], 1, 128, 128))


def test_bad_shapes_are_named():
    t, cu, slots, init = batch(0, [4])
    q, k, v, g, beta, pool = inputs(0, t)
    with pytest.raises(ValueError, match="g"):
        gdn.gdn_prefill(q, k, v, g[:, :1], beta, pool, cu, slots, init, interpret=True)
    with pytest.raises(ValueError, match="state_pool"):
        gdn.gdn_prefill(q, k, v, g, beta, pool.astype(jnp.bfloat16), cu, slots, init,
                        interpret=True)
    with pytest.raises(ValueError, match="cu_seqlens"):
        gdn.gdn_prefill(q, k, v, g, beta, pool, cu[:1], slots, init, interpret=True)
    with pytest.raises(ValueError, match="chunk_size"):
        gdn.gdn_prefill(q, k, v, g, beta, pool, cu, slots, init, chunk_size=24, interpret=True)
    with pytest.raises(ValueError, match="ut_solve='lu'"):
        gdn.gdn_prefill(q, k, v, g, beta, pool, cu, slots, init, ut_solve="lu", interpret=True)


def test_kernels_lower_for_cuda():
    """Qwen3-Next-80B's shapes: 16 key heads, 32 value heads, 128 x 128 state per head."""
    sd = jax.ShapeDtypeStruct
    t, s, n, hk, hv, d = 256, 4, 8, 16, 32, 128
    bf, f32, i32 = jnp.bfloat16, jnp.float32, jnp.int32
    args = (sd((t, hk, d), bf), sd((t, hk, d), bf), sd((t, hv, d), bf), sd((t, hv), f32),
            sd((t, hv), f32), sd((n, hv, d, d), f32), sd((s + 1,), i32), sd((s,), i32),
            sd((s,), bool))
    for ut_solve in gdn.UT_SOLVES:  # (doubling: 3xTF32 dots, which only the GPU lowers)
        text = lower_for_cuda(functools.partial(gdn.gdn_prefill, ut_solve=ut_solve), *args)
        assert all(name in text for name in ("gdn_prefill_wy", "gdn_prefill_h", "gdn_prefill_o"))
    text = lower_for_cuda(gdn.gdn_decode, sd((s, hk, d), bf), sd((s, hk, d), bf),
                          sd((s, hv, d), bf), sd((s, hv), f32), sd((s, hv), f32),
                          sd((n, hv, d, d), f32), sd((s,), i32))
    assert "gdn_decode" in text
