"""The causal depthwise conv1d (pallas_kernels/ssm/conv1d.py): the kernels in Pallas' interpreter
against the jnp references on random ragged batches (sequences shorter than the kernel width,
padding tokens and sequences, fresh and continued conv states, widths 2-4, with and without bias
and SiLU, channel counts off the block), the windowed reference against the token-by-token
definition, the conv state carried across prefill chunks and into decode, other slots left
bit-identical, CUDA lowering."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.common.testing import random_ragged_batch
from pallas_kernels.ssm import conv1d
from ssm_support import (assert_close, assert_other_slots_untouched, lower_for_cuda, normal,
                         split_batch)

import kernel_references as reference

pytestmark = pytest.mark.slow  # ~1 min on the loaded 2-core CI machine: its xdist group first

NUM_SLOTS = 8
CHANNELS = 64
LENS = [37, 0, 1, 2, 16, 9, 5]  # blocks of 16, empty, shorter than the width, a dead row


@functools.partial(jax.jit, static_argnames=("activation",))
def prefill(x, w, b, state, cu, slots, init, src_slots=None, activation="silu"):
    return conv1d.causal_conv1d(x, w, b, state, cu, slots, init, src_slots=src_slots,
                                activation=activation, block_t=16, block_c=32, interpret=True)


@jax.jit
def update(x, w, b, state, slots, src_slots=None):
    return conv1d.causal_conv1d_update(x, w, b, state, slots, src_slots=src_slots, block_c=32,
                                       interpret=True)


def inputs(seed, t, width=4, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    return (normal(rng, (t, CHANNELS), dtype), normal(rng, (width, CHANNELS), dtype),
            normal(rng, (CHANNELS,), dtype), normal(rng, (NUM_SLOTS, width - 1, CHANNELS), dtype))


def batch(seed, lens, *, extra=3, dead=1):
    return random_ragged_batch(np.random.default_rng(seed), lens, NUM_SLOTS, extra_tokens=extra,
                               dead=dead)


@pytest.mark.parametrize("width", [2, 4])
def test_windowed_reference_is_the_recurrence(width):
    t, cu, slots, init = batch(width, LENS)
    x, w, b, state = inputs(width, t, width)
    y1, s1 = reference.causal_conv1d_recurrent_reference(x, w, b, state, cu, slots, init)
    y2, s2 = reference.causal_conv1d_reference(x, w, b, state, cu, slots, init)
    assert_close(y2, y1, 1e-6)
    np.testing.assert_array_equal(np.asarray(s2), np.asarray(s1))  # the state is copied inputs
    assert not np.asarray(y1[int(cu[-1]):]).any()


@pytest.mark.parametrize("seed, width, bias, activation", [
    (1, 4, True, "silu"), (2, 3, False, "silu"), (3, 2, True, None)])
def test_prefill_matches_reference(seed, width, bias, activation):
    t, cu, slots, init = batch(seed, LENS)
    x, w, b, state = inputs(seed, t, width)
    b = b if bias else None
    y, new = prefill(x, w, b, state, cu, slots, init, activation=activation)
    y_ref, s_ref = reference.causal_conv1d_reference(x, w, b, state, cu, slots, init,
                                                     activation=activation)
    assert_close(y, y_ref, 1e-5)
    np.testing.assert_array_equal(np.asarray(new), np.asarray(s_ref))
    assert_other_slots_untouched(state, new, slots)
    assert not np.asarray(y[int(cu[-1]):]).any()


def test_prefill_bf16():
    t, cu, slots, init = batch(4, [20, 2, 7])
    x, w, b, state = inputs(4, t, dtype=jnp.bfloat16)
    y, new = prefill(x, w, b, state, cu, slots, init)
    y_ref, s_ref = reference.causal_conv1d_reference(x, w, b, state, cu, slots, init)
    assert y.dtype == new.dtype == jnp.bfloat16
    assert_close(y, y_ref, 1e-2)
    np.testing.assert_array_equal(np.asarray(new, np.float32), np.asarray(s_ref, np.float32))


def test_prefill_in_two_chunks_equals_one():
    lens = [37, 20, 2, 9]
    t, cu, slots, init = batch(5, lens, extra=0, dead=0)
    x, w, b, state = inputs(5, t)
    y_all, s_all = prefill(x, w, b, state, cu, slots, init)
    # Row 1's first part is one token: the state it leaves mixes that input with older ones.
    idx1, cu1, idx2, cu2 = split_batch(cu, [19, 1, 0, 7])
    y1, s1 = prefill(x[idx1], w, b, state, jnp.asarray(cu1), slots, init)
    y2, s2 = prefill(x[idx2], w, b, s1, jnp.asarray(cu2), slots, jnp.ones_like(init))
    assert_close(y1, y_all[idx1], 1e-5)
    assert_close(y2, y_all[idx2], 1e-5)
    np.testing.assert_array_equal(np.asarray(s2), np.asarray(s_all))


def test_prefill_then_updates_equal_whole_prefill():
    lens, steps = [21, 4, 3], 3
    t, cu, slots, init = batch(6, lens, extra=0, dead=0)
    x, w, b, state = inputs(6, t)
    y_all, s_all = prefill(x, w, b, state, cu, slots, init)
    idx1, cu1, _, _ = split_batch(cu, [n - steps for n in lens])
    _, state = prefill(x[idx1], w, b, state, jnp.asarray(cu1), slots, init)
    for i in range(steps):
        rows = np.asarray(cu[1:]) - steps + i
        y, state = update(x[rows], w, b, state, slots)
        assert_close(y, y_all[rows], 1e-5)
    np.testing.assert_array_equal(np.asarray(state), np.asarray(s_all))


def test_update_matches_reference_and_leaves_other_slots():
    x, w, b, state = inputs(7, 5)
    slots = jnp.asarray([6, 2, -1, 0, 3], jnp.int32)
    y, new = update(x, w, b, state, slots)
    y_ref, s_ref = reference.causal_conv1d_update_reference(x, w, b, state, slots)
    assert_close(y, y_ref, 1e-5)
    np.testing.assert_array_equal(np.asarray(new), np.asarray(s_ref))
    assert_other_slots_untouched(state, new, slots)
    assert not np.asarray(y[2]).any()


def test_states_move_from_source_to_destination_slots():
    t, cu, src, init = batch(10, [23, 1, 7], extra=0, dead=0)
    x, w, b, state = inputs(10, t)
    dst = jnp.asarray(np.setdiff1d(np.arange(NUM_SLOTS), np.asarray(src))[:3], jnp.int32)
    y, new = prefill(x, w, b, state, cu, dst, init, src_slots=src)
    y_in_place, s_in_place = prefill(x, w, b, state, cu, src, init)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(y_in_place))
    np.testing.assert_array_equal(np.asarray(new)[np.asarray(dst)],
                                  np.asarray(s_in_place)[np.asarray(src)])
    assert_other_slots_untouched(state, new, dst)
    rows = np.asarray(cu[:-1])
    y, moved = update(x[rows], w, b, state, dst, src_slots=src)
    y_ref, s_ref = reference.causal_conv1d_update_reference(x[rows], w, b, state, dst,
                                                            src_slots=src)
    assert_close(y, y_ref, 1e-5)
    np.testing.assert_array_equal(np.asarray(moved), np.asarray(s_ref))
    assert_other_slots_untouched(state, moved, dst)


def test_bad_arguments_are_named():
    t, cu, slots, init = batch(0, [4])
    x, w, b, state = inputs(0, t)
    with pytest.raises(ValueError, match="conv_state"):
        conv1d.causal_conv1d(x, w, b, state[:, :2], cu, slots, init, interpret=True)
    with pytest.raises(ValueError, match="activation"):
        conv1d.causal_conv1d_update(x[:1], w, b, state, slots, activation="gelu", interpret=True)


def test_kernels_lower_for_cuda():
    """Qwen3-Next-80B's conv: 2 * 16 * 128 + 32 * 128 = 8192 channels, width 4."""
    sd = jax.ShapeDtypeStruct
    t, s, n, c, width = 256, 4, 8, 8192, 4
    bf, i32 = jnp.bfloat16, jnp.int32
    text = lower_for_cuda(conv1d.causal_conv1d, sd((t, c), bf), sd((width, c), bf), None,
                          sd((n, width - 1, c), bf), sd((s + 1,), i32), sd((s,), i32),
                          sd((s,), bool))
    assert "causal_conv1d" in text
    text = lower_for_cuda(conv1d.causal_conv1d_update, sd((s, c), bf), sd((width, c), bf),
                          sd((c,), bf), sd((n, width - 1, c), bf), sd((s,), i32))
    assert "causal_conv1d_update" in text


def test_channels_off_the_block_take_a_smaller_block():
    """48 channels (a device's share of a conv whose channels split over tensor-parallel devices
    need not be a multiple of the block): the block drops to 16, the largest power of two
    dividing them, and prefill and decode give the references'."""
    t, cu, slots, init = batch(7, [9, 1])
    x, w, b, state = (a[..., :48] for a in inputs(7, t))
    y, new = prefill(x, w, b, state, cu, slots, init)
    y_ref, s_ref = reference.causal_conv1d_reference(x, w, b, state, cu, slots, init)
    assert_close(y, y_ref, 1e-5)
    np.testing.assert_array_equal(np.asarray(new), np.asarray(s_ref))
    one = x[:2]
    decode_slots = jnp.array([0, 3], jnp.int32)
    y, new = update(one, w, b, state, decode_slots)
    y_ref, s_ref = reference.causal_conv1d_update_reference(one, w, b, state, decode_slots)
    assert_close(y, y_ref, 1e-5)
    np.testing.assert_array_equal(np.asarray(new), np.asarray(s_ref))
