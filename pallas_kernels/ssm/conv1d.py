"""The causal depthwise conv1d before Gated DeltaNet and Mamba-2 (HF's nn.Conv1d(groups=C,
padding=W-1)[:L] + SiLU; causal_conv1d_fn / causal_conv1d_update) as Triton-lowered Pallas
kernels, carrying each sequence's last W-1 inputs in a conv state pool.

    causal_conv1d(x, weight, bias, conv_state, cu_seqlens, slots, has_initial_state=None, *,
                  src_slots=None, activation="silu", block_t=32, block_c=128)
        -> (y [T, C], conv_state)
    causal_conv1d_update(x, weight, bias, conv_state, slots, *, src_slots=None,
                         activation="silu", block_c=128) -> (y [S, C], conv_state)

x [T, C] packed tokens (the ragged batch of `batch.py`), weight [W, C] (HF's conv1d.weight
[C, 1, W] transposed), bias [C] or None, conv_state [num_slots, W-1, C] (the inputs before a
sequence's first token, oldest first; has_initial_state False reads them as zeros), activation
"silu" or None. y[t] = act(bias + sum_i weight[i] x[t - (W-1) + i]), inputs before the sequence's
first token taken from its conv state; the sequence's last W-1 inputs (its state's tail when it
has fewer tokens) go back to its slot in place. The references are
`reference.causal_conv1d_reference` / `causal_conv1d_update_reference`.

Prefill: grid (row blocks, C / block_c), every block_t-row block of every sequence at once
(`batch.chunk_table`), each tap's rows one shifted load of x, masked outside the sequence's rows
(`_padded`: the interpreter's copy of x has zero rows around it instead); a sequence's first
block adds the history's terms and writes its conv state.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.ssm.batch import (check_ragged, check_sources, chunk_table, sequence_table,
                                      slot_table)


def _activate(y, activation):
    return y * jax.nn.sigmoid(y) if activation == "silu" else y


def _prefill_kernel(table_ref, info_ref, x_ref, w_ref, b_ref, st_ref, _zeros_ref, y_ref,
                    st_out_ref, *, block_t: int, activation, front: int):
    """One (block of rows of one sequence, channel block). The block whose first row is its
    sequence's first adds the history's terms and writes the sequence's final inputs to its
    slot: the only program that reads the source slot also writes the destination, so no
    other block can see a half-written state. x's row r is packed row r - front (front: the
    zero rows in front of x, `_padded`)."""
    blk = pl.program_id(0)
    row0, n, s, writer = (table_ref[blk, 0], table_ref[blk, 1], table_ref[blk, 2],
                          table_ref[blk, 3])
    start, length, slot, init = info_ref[s, 0], info_ref[s, 1], info_ref[s, 2], info_ref[s, 3]
    src = info_ref[s, 4]
    width = w_ref.shape[0]
    rows = lax.broadcasted_iota(jnp.int32, (block_t,), 0)
    first = row0 == start
    hist = [jnp.where(init > 0, st_ref[src, m, :].astype(jnp.float32), 0.0)
            for m in range(width - 1)]

    @pl.when(n > 0)
    def _():
        ok = rows < n
        acc = jnp.zeros((block_t, b_ref.shape[0]), jnp.float32) + b_ref[...].astype(jnp.float32)
        for i in range(width):  # tap i reads position row - (W-1) + i
            wi = w_ref[i, :].astype(jnp.float32)
            seen = ok & ((row0 - start) + rows - (width - 1) + i >= 0)
            xi = pltriton.load(x_ref.at[pl.ds(row0 + i - (width - 1) + front, block_t), :],
                               mask=seen[:, None], other=0)
            acc = acc + wi[None, :] * xi.astype(jnp.float32)
            for m in range(i, width - 1):  # before the sequence: history row m = row + i
                at = (rows == m - i) & ok & first
                acc = acc + jnp.where(at[:, None], (wi * hist[m])[None, :], 0.0)
        pltriton.store(y_ref.at[pl.ds(row0, block_t), :],
                       _activate(acc, activation).astype(y_ref.dtype), mask=ok[:, None])

    @pl.when((writer > 0) & (slot >= 0))
    def _():
        for m in range(width - 1):  # position length - (W-1) + m of the history-extended input
            # (a row before the sequence is not used: the clamp only keeps the read in x)
            at = jnp.maximum(start + length + m - (width - 1) + front, 0)
            x_row = x_ref[at, :].astype(jnp.float32)
            old = sum(jnp.where(length + m == mm, hist[mm], 0.0) for mm in range(width - 1))
            new = jnp.where(length + m >= width - 1, x_row, old)
            st_out_ref[slot, m, :] = new.astype(st_out_ref.dtype)


def _block_table(cu, slots, num_tokens: int, block_t: int) -> jax.Array:
    """i32[NC + S, 4] rows (first packed row, rows, sequence, writes the state): the row blocks
    of `chunk_table`, then one row-less program per sequence that writes the state of a live
    sequence with no tokens (its history, moved to its slot)."""
    s = slots.shape[0]
    chunks = chunk_table(cu, slots, num_tokens, block_t)
    seq = jnp.minimum(jnp.searchsorted(cu[1:], chunks[:, 0], side="right",
                                       method="compare_all"), s - 1).astype(jnp.int32)
    first = (chunks[:, 1] > 0) & (chunks[:, 0] == cu[seq])
    empty = (cu[1:] == cu[:-1]) & (slots >= 0)
    blocks = jnp.stack([chunks[:, 0], chunks[:, 1], seq, first.astype(jnp.int32)], axis=1)
    idle = jnp.stack([cu[:-1], jnp.zeros((s,), jnp.int32), jnp.arange(s, dtype=jnp.int32),
                      empty.astype(jnp.int32)], axis=1)
    return jnp.concatenate([blocks, idle]).astype(jnp.int32)


def _check_conv(x, weight, bias, conv_state, block_c):
    c = x.shape[1]
    w = weight.shape[0]
    if x.ndim != 2 or weight.shape != (w, c) or w < 2:
        raise ValueError(f"x {x.shape} must be [T, C] and weight {weight.shape} [W >= 2, C]")
    if bias is not None and bias.shape != (c,):
        raise ValueError(f"bias {bias.shape} must be [C={c}]")
    if conv_state.shape[1:] != (w - 1, c):
        raise ValueError(f"conv_state {conv_state.shape} must be [num_slots, W-1={w - 1}, C={c}]")
    if block_c & (block_c - 1):
        raise ValueError(f"block_c={block_c} must be a power of two")
    # The largest power of two up to block_c dividing C (a device's share of the channels under
    # tensor parallelism, e.g. 3328 / 4 = 832, takes 64).
    bc = min(block_c, c & -c)
    return w, c, bc, (jnp.zeros((c,), jnp.float32) if bias is None else bias)


def _check_activation(activation):
    if activation not in ("silu", None):
        raise ValueError(f"activation={activation!r}: 'silu' or None")


def causal_conv1d(x, weight, bias, conv_state, cu_seqlens, slots, has_initial_state=None, *,
                  src_slots=None, activation="silu", block_t: int = 32, block_c: int = 128,
                  num_warps: int = 4, interpret: bool = False):
    """The causal conv over a ragged batch (module docstring). Returns (y [T, C] in x's dtype,
    zeros on padding/dead rows; conv_state with each live sequence's last W-1 inputs)."""
    _check_activation(activation)
    w, c, bc, bias = _check_conv(x, weight, bias, conv_state, block_c)
    t = x.shape[0]
    s = check_ragged(t, cu_seqlens, slots, has_initial_state, src_slots)
    cu = cu_seqlens.astype(jnp.int32)
    info = sequence_table(cu, slots, has_initial_state, src_slots)
    if block_t & (block_t - 1) or block_t < max(16, w - 1):
        raise ValueError(f"block_t={block_t} must be a power of two >= 16 and >= W-1={w - 1}")
    table = _block_table(cu, slots, t, block_t)
    xp, front = _padded(x, w, block_t, interpret)
    rows = xp.shape[0] - front
    n = conv_state.shape[0]
    y, pool = pl.pallas_call(
        functools.partial(_prefill_kernel, block_t=block_t, activation=activation, front=front),
        grid=(table.shape[0], c // bc),
        in_specs=[pl.BlockSpec(table.shape, lambda i, j: (0, 0)),
                  pl.BlockSpec((s, 5), lambda i, j: (0, 0)),
                  pl.BlockSpec((xp.shape[0], bc), lambda i, j: (0, j)),
                  pl.BlockSpec((w, bc), lambda i, j: (0, j)),
                  pl.BlockSpec((bc,), lambda i, j: (j,)),
                  pl.BlockSpec((n, w - 1, bc), lambda i, j: (0, 0, j)),
                  pl.BlockSpec((rows, bc), lambda i, j: (0, j))],
        out_specs=[pl.BlockSpec((rows, bc), lambda i, j: (0, j)),
                   pl.BlockSpec((n, w - 1, bc), lambda i, j: (0, 0, j))],
        out_shape=[jax.ShapeDtypeStruct((rows, c), x.dtype),
                   jax.ShapeDtypeStruct(conv_state.shape, conv_state.dtype)],
        # y starts as zeros (a write-only fill) and the kernel writes the live sequences' rows:
        # padding rows stay zero without a select over all of y.
        input_output_aliases={5: 1, 6: 0},
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="causal_conv1d",
    )(table, info, xp, weight, bias, conv_state, jnp.zeros((rows, c), x.dtype))
    return y[:t], pool


def _padded(x, width: int, block_t: int, interpret: bool):
    """(x as the kernel reads it, the zero rows in front of it). On the GPU the taps' loads are
    masked outside a sequence's rows, so x goes in as it is. Pallas' interpreter clamps a load's
    window to the array (its rows would shift), so there x gets W-1 zero rows in front (the first
    sequence's earliest tap) and block_t behind (a last block's window)."""
    if not interpret:
        return x, 0
    return jnp.pad(x, ((width - 1, block_t), (0, 0))), width - 1


def _update_kernel(slot_ref, x_ref, w_ref, b_ref, st_ref, y_ref, st_out_ref, *, activation):
    i = pl.program_id(0)
    slot, init, src = slot_ref[i, 0], slot_ref[i, 1], slot_ref[i, 2]
    width = w_ref.shape[0]

    @pl.when(slot >= 0)
    def _():
        window = [jnp.where(init > 0, st_ref[src, m, :], 0) for m in range(width - 1)]
        window.append(x_ref[...])
        acc = b_ref[...].astype(jnp.float32)
        for i in range(width):
            acc = acc + w_ref[i, :].astype(jnp.float32) * window[i].astype(jnp.float32)
        y_ref[...] = _activate(acc, activation).astype(y_ref.dtype)
        for m in range(width - 1):
            st_out_ref[slot, m, :] = window[m + 1].astype(st_out_ref.dtype)

    @pl.when(slot < 0)
    def _():
        y_ref[...] = jnp.zeros(y_ref.shape, y_ref.dtype)


def causal_conv1d_update(x, weight, bias, conv_state, slots, *, src_slots=None, activation="silu",
                         block_c: int = 128, num_warps: int = 4, interpret: bool = False):
    """One token per sequence: x [S, C], slots [S] (< 0: padding row, zeros out, nothing
    written), src_slots [S] the inputs each continues from (default: slots); each destination
    gets its source's inputs shifted by one. Returns (y [S, C], conv_state)."""
    _check_activation(activation)
    w, c, bc, bias = _check_conv(x, weight, bias, conv_state, block_c)
    s = x.shape[0]
    check_sources(slots, src_slots)
    if slots.shape != (s,):
        raise ValueError(f"slots {slots.shape} must be [num_seqs={s}]")
    n = conv_state.shape[0]
    row = pl.BlockSpec((None, bc), lambda i, j: (i, j))
    state_spec = pl.BlockSpec((n, w - 1, bc), lambda i, j: (0, 0, j))
    return pl.pallas_call(
        functools.partial(_update_kernel, activation=activation),
        grid=(s, c // bc),
        in_specs=[pl.BlockSpec((s, 3), lambda i, j: (0, 0)), row,
                  pl.BlockSpec((w, bc), lambda i, j: (0, j)),
                  pl.BlockSpec((bc,), lambda i, j: (j,)), state_spec],
        out_specs=[row, state_spec],
        out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype),
                   jax.ShapeDtypeStruct(conv_state.shape, conv_state.dtype)],
        input_output_aliases={4: 1},
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="causal_conv1d_update",
    )(slot_table(slots, None, src_slots), x, weight, bias, conv_state)
