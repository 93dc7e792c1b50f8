"""Mamba-2's SSD scan (pallas_kernels/ssm/mamba2.py): the kernels in Pallas' interpreter against the
jnp references on random ragged batches (padding tokens and sequences, zero-length and one-token
sequences, grouped B/C, with and without the D skip), the chunked reference against the
token-by-token recurrence, state carried across prefill chunks and into decode, the slots no
sequence names left bit-identical, and the kernels lowered for CUDA."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.common.testing import random_ragged_batch
from pallas_kernels.ssm import mamba2
from pallas_kernels.ssm.reference import mamba2_dt
from ssm_support import (assert_close, assert_other_slots_untouched, lower_for_cuda, normal,
                         split_batch)

import kernel_references as reference

pytestmark = pytest.mark.slow  # ~1 min on the loaded 2-core CI machine: its xdist group first

CHUNK = 16
NUM_SLOTS = 8
LENS = [37, 0, 1, 16, 9, 5]  # several chunks, empty, decode-sized, one exact chunk, a dead row


@functools.partial(jax.jit, static_argnames=("block_p", "chunk"))
def prefill(x, dt, a, b, c, pool, cu, slots, init, d, src_slots=None, block_p=16, chunk=CHUNK):
    return mamba2.ssd_prefill(x, dt, a, b, c, pool, cu, slots, init, d=d, src_slots=src_slots,
                              chunk_size=chunk, block_p=block_p, interpret=True)


@jax.jit
def decode(x, dt, a, b, c, pool, slots, d, src_slots=None):
    return mamba2.ssd_decode(x, dt, a, b, c, pool, slots, d=d, src_slots=src_slots, block_p=16,
                             interpret=True)


def inputs(seed, t, *, h=4, g=2, p=32, n=16, dtype=jnp.float32):
    """Per-token tensors (x, dt, b, c), the per-head a and d, and a random state pool."""
    rng = np.random.default_rng(seed)
    x = normal(rng, (t, h, p), dtype)
    dt = jax.jit(mamba2_dt, static_argnums=2)(normal(rng, (t, h)) - 1.0,
                                              np.zeros((h,), np.float32), (0.0, 4.0))
    b = normal(rng, (t, g, n), dtype)
    c = normal(rng, (t, g, n), dtype)
    a = -jnp.linspace(0.5, 6.0, h)
    d = jnp.linspace(0.0, 1.0, h)
    pool = normal(rng, (NUM_SLOTS, h, p, n))
    return (x, dt, b, c), a, d, pool


def batch(seed, lens, *, extra=3, dead=1):
    return random_ragged_batch(np.random.default_rng(seed), lens, NUM_SLOTS, extra_tokens=extra,
                               dead=dead)


def run(fn, tokens, a, pool, *rest, **kwargs):
    x, dt, b, c = tokens
    return fn(x, dt, a, b, c, pool, *rest, **kwargs)


def rows_of(tokens, idx):
    return tuple(t[idx] for t in tokens)


@pytest.mark.parametrize("with_d", [True, False])
def test_chunked_reference_is_the_recurrence(with_d):
    t, cu, slots, init = batch(0, LENS)
    tokens, a, d, pool = inputs(0, t)
    d = d if with_d else None
    y1, p1 = run(reference.ssd_recurrent_reference, tokens, a, pool, cu, slots, init, d=d)
    y2, p2 = run(functools.partial(reference.ssd_chunked_reference, chunk_size=CHUNK), tokens, a,
                 pool, cu, slots, init, d=d)
    assert_close(y2, y1, 1e-5)
    assert_close(p2, p1, 1e-5)
    assert not np.asarray(y1[int(cu[-1]):]).any(), "padding tokens must come out zero"


@pytest.mark.parametrize("seed, h, g, p, block_p, lens, chunk", [
    (1, 4, 2, 32, 16, LENS, CHUNK),  # two groups, two P blocks
    (2, 4, 1, 16, 16, LENS, CHUNK),  # one group shared by every head
    (3, 2, 2, 32, 32, LENS, CHUNK),  # a group per head, one P block
    (4, 4, 2, 32, 16, [150, 0, 1, 64, 40], 64),  # the serving chunk
])
def test_prefill_matches_reference(seed, h, g, p, block_p, lens, chunk):
    t, cu, slots, init = batch(seed, lens)
    tokens, a, d, pool = inputs(seed, t, h=h, g=g, p=p)
    y, new = run(functools.partial(prefill, block_p=block_p, chunk=chunk),
                 tokens, a, pool, cu, slots, init, d=d)
    y_ref, p_ref = run(reference.ssd_recurrent_reference, tokens, a, pool, cu, slots, init, d=d)
    assert_close(y, y_ref, 2e-5)
    assert_close(new, p_ref, 2e-5)
    assert_other_slots_untouched(pool, new, slots)
    assert not np.asarray(y[int(cu[-1]):]).any()


def test_prefill_bf16_inputs():
    t, cu, slots, init = batch(4, [40, 3, 18])
    tokens, a, d, pool = inputs(4, t, dtype=jnp.bfloat16)
    y, new = run(prefill, tokens, a, pool, cu, slots, init, d=d)
    y_ref, p_ref = run(reference.ssd_recurrent_reference, tokens, a, pool, cu, slots, init, d=d)
    assert y.dtype == jnp.bfloat16
    assert_close(y, y_ref, 3e-2)
    assert_close(new, p_ref, 3e-2)


def test_prefill_in_two_chunks_equals_one():
    lens = [37, 20, 1, 9]
    t, cu, slots, init = batch(5, lens, extra=0, dead=0)
    tokens, a, d, pool = inputs(5, t)
    fn = prefill
    y_all, p_all = run(fn, tokens, a, pool, cu, slots, init, d=d)
    idx1, cu1, idx2, cu2 = split_batch(cu, [19, 16, 0, 4])
    y1, p1 = run(fn, rows_of(tokens, idx1), a, pool, jnp.asarray(cu1), slots, init, d=d)
    y2, p2 = run(fn, rows_of(tokens, idx2), a, p1, jnp.asarray(cu2), slots,
                 jnp.ones_like(init), d=d)
    assert_close(y1, y_all[idx1], 2e-5)
    assert_close(y2, y_all[idx2], 2e-5)
    assert_close(p2, p_all, 2e-5)


def test_prefill_then_decode_steps_equals_whole_prefill():
    lens, steps = [21, 4, 3], 3
    t, cu, slots, init = batch(6, lens, extra=0, dead=0)
    tokens, a, d, pool = inputs(6, t)
    y_all, p_all = run(prefill, tokens, a, pool, cu, slots, init, d=d)
    idx1, cu1, _, _ = split_batch(cu, [n - steps for n in lens])
    y1, state = run(prefill, rows_of(tokens, idx1), a, pool, jnp.asarray(cu1), slots, init, d=d)
    assert_close(y1, y_all[idx1], 2e-5)
    for i in range(steps):
        rows = np.asarray(cu[1:]) - steps + i
        y, state = run(decode, rows_of(tokens, rows), a, state, slots, d=d)
        assert_close(y, y_all[rows], 2e-5)
    assert_close(state, p_all, 2e-5)


def test_decode_matches_reference_and_leaves_other_slots():
    tokens, a, d, pool = inputs(7, 5)
    slots = jnp.asarray([6, 2, -1, 0, 3], jnp.int32)
    y, new = run(decode, tokens, a, pool, slots, d=d)
    y_ref, p_ref = run(reference.ssd_decode_reference, tokens, a, pool, slots, d=d)
    assert_close(y, y_ref, 1e-5)
    assert_close(new, p_ref, 1e-5)
    assert_other_slots_untouched(pool, new, slots)
    assert not np.asarray(y[2]).any(), "a padding row (slot -1) comes out zero"


def test_mixed_step_decode_rows_as_length_one_sequences():
    lens = [1, 25, 1, 1]
    t, cu, slots, _ = batch(8, lens, extra=0, dead=0)
    init = jnp.asarray([True, False, True, True])
    tokens, a, d, pool = inputs(8, t)
    y_mixed, p_mixed = run(prefill, tokens, a, pool, cu, slots, init, d=d)
    rows = np.asarray(cu[:-1])[[0, 2, 3]]
    dec_slots = slots[jnp.asarray([0, 2, 3])]
    y_dec, p_dec = run(decode, rows_of(tokens, rows), a, pool, dec_slots, d=d)
    assert_close(y_mixed[rows], y_dec, 2e-5)
    assert_close(p_mixed[dec_slots], p_dec[dec_slots], 2e-5)


def test_states_move_from_source_to_destination_slots():
    """A state cache keeping each block's state in its own page reads one slot and writes
    another: the results are the in-place ones, moved; the sources keep their bits."""
    t, cu, src, init = batch(10, [23, 1, 7], extra=0, dead=0)
    tokens, a, d, pool = inputs(10, t)
    dst = jnp.asarray(np.setdiff1d(np.arange(NUM_SLOTS), np.asarray(src))[:3], jnp.int32)
    y, new = run(prefill, tokens, a, pool, cu, dst, init, d=d, src_slots=src)
    y_in_place, p_in_place = run(prefill, tokens, a, pool, cu, src, init, d=d)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(y_in_place))
    np.testing.assert_array_equal(np.asarray(new)[np.asarray(dst)],
                                  np.asarray(p_in_place)[np.asarray(src)])
    assert_other_slots_untouched(pool, new, dst)
    rows = np.asarray(cu[:-1])
    y, moved = run(decode, rows_of(tokens, rows), a, pool, dst, d=d, src_slots=src)
    y_ref, p_ref = run(reference.ssd_decode_reference, rows_of(tokens, rows), a, pool, dst, d=d,
                       src_slots=src)
    assert_close(y, y_ref, 1e-5)
    assert_close(moved, p_ref, 1e-5)
    assert_other_slots_untouched(pool, moved, dst)


def test_flops_count_real_rows():
    one = mamba2.ssd_prefill_flops([64], 1, 64, 128)
    assert one == 2 * 64 ** 2 * (128 + 64) + 4 * 64 * 64 * 128
    assert mamba2.ssd_prefill_flops([100], 3, 64, 128) == 3 * (
        one + mamba2.ssd_prefill_flops([36], 1, 64, 128))


def test_bad_shapes_are_named():
    t, cu, slots, init = batch(0, [4])
    (x, dt, b, c), a, d, pool = inputs(0, t)
    with pytest.raises(ValueError, match="dt"):
        mamba2.ssd_prefill(x, dt[:, :1], a, b, c, pool, cu, slots, init, interpret=True)
    with pytest.raises(ValueError, match="b "):
        mamba2.ssd_prefill(x, dt, a, b[:, :, :8], c, pool, cu, slots, init, interpret=True)
    with pytest.raises(ValueError, match="state_pool"):
        mamba2.ssd_decode(x[:1], dt[:1], a, b[:1], c[:1], pool[:, :, :, :8], slots,
                          interpret=True)


def test_kernels_lower_for_cuda():
    """Nemotron-H / Granite 4.0-H-like shapes: head_dim 64, d_state 128, 8 groups."""
    sd = jax.ShapeDtypeStruct
    t, s, n, h, g, p, ds = 256, 4, 8, 64, 8, 64, 128
    bf, f32, i32 = jnp.bfloat16, jnp.float32, jnp.int32
    args = (sd((t, h, p), bf), sd((t, h), f32), sd((h,), f32), sd((t, g, ds), bf),
            sd((t, g, ds), bf), sd((n, h, p, ds), f32), sd((s + 1,), i32), sd((s,), i32),
            sd((s,), bool))
    text = lower_for_cuda(functools.partial(mamba2.ssd_prefill, d=jnp.ones((h,))), *args)
    assert "ssd_prefill" in text
    text = lower_for_cuda(mamba2.ssd_decode, sd((s, h, p), bf), sd((s, h), f32), sd((h,), f32),
                          sd((s, g, ds), bf), sd((s, g, ds), bf), sd((n, h, p, ds), f32),
                          sd((s,), i32))
    assert "ssd_decode" in text
