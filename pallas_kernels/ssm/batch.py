"""The ragged batch every recurrent-layer kernel takes, and its checks.

A step's tokens are packed on one axis T. Sequence s owns tokens cu_seqlens[s] : cu_seqlens[s+1]
(its new tokens of this step: a whole prompt, one chunk of a chunked prefill, or the one token of
a decode row); tokens from cu_seqlens[-1] to T are padding (outputs zero, no state touched).
Its recurrent state lives in slot slots[s] of a state pool [num_slots, ...]; slots[s] < 0 marks a
padding sequence (nothing read, nothing written, outputs zero). has_initial_state[s] False starts
the sequence from zeros whatever the slot holds (a new request in a reused slot); True continues
from the slot (the next chunk of a prefill, or decode); has_initial_state=None: every sequence
continues. src_slots (optional, default slots) names the slot a continuing sequence reads its
state from, when that is not the one its final state goes to (a state cache that keeps the state
after each block in that block's page). The kernels write each sequence's final state into
slots[s] in place (the pool is aliased to the output; donate it to the enclosing jit), leaving
every other slot untouched. Within one call the live sequences' destination slots must differ
and no destination may be another sequence's source (several may read one source).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def check_ragged(num_tokens: int, cu_seqlens: jax.Array, slots: jax.Array,
                 has_initial_state: jax.Array | None, src_slots: jax.Array | None = None) -> int:
    """The number of sequences S, after checking the batch arrays agree on it."""
    s = slots.shape[0]
    check_sources(slots, src_slots)
    if cu_seqlens.shape != (s + 1,):
        raise ValueError(f"cu_seqlens {cu_seqlens.shape} must be [num_seqs + 1] = [{s + 1}] "
                         f"(slots is {slots.shape})")
    if has_initial_state is not None and has_initial_state.shape != (s,):
        raise ValueError(f"has_initial_state {has_initial_state.shape} must be [num_seqs={s}]")
    if num_tokens < 1 or s < 1:
        raise ValueError(f"the packed batch needs a token row and a sequence ({num_tokens} "
                         f"tokens, {s} sequences)")
    return s


def token_sequence(cu_seqlens: jax.Array, num_tokens: int) -> jax.Array:
    """i32[T]: the sequence each token belongs to; S for the padding tokens past cu_seqlens[-1]."""
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    return jnp.searchsorted(cu_seqlens[1:].astype(jnp.int32), t, side="right",
                            method="compare_all").astype(jnp.int32)


def live_tokens(cu_seqlens: jax.Array, slots: jax.Array, num_tokens: int) -> jax.Array:
    """bool[T]: the tokens of live sequences (not padding tokens, not of a slot < 0 sequence)."""
    seq = token_sequence(cu_seqlens, num_tokens)
    s = slots.shape[0]
    return (seq < s) & (jnp.concatenate([slots, -jnp.ones((1,), slots.dtype)])[seq] >= 0)


def check_sources(slots: jax.Array, src_slots: jax.Array | None) -> None:
    if slots.ndim != 1 or (src_slots is not None and src_slots.shape != slots.shape):
        raise ValueError(f"slots {slots.shape} and src_slots "
                         f"{None if src_slots is None else src_slots.shape} must be [num_seqs]")


def initial_flags(slots: jax.Array, has_initial_state: jax.Array | None,
                  src_slots: jax.Array | None = None) -> jax.Array:
    """i32[S]: 1 where a live sequence continues from a state (its source slot's)."""
    init = jnp.ones(slots.shape, bool) if has_initial_state is None else has_initial_state
    src = slots if src_slots is None else src_slots
    return (init & (slots >= 0) & (src >= 0)).astype(jnp.int32)


def slot_table(slots: jax.Array, has_initial_state: jax.Array | None,
               src_slots: jax.Array | None) -> jax.Array:
    """i32[S, 3] rows (destination slot, continues, source slot) that the decode kernels read
    per sequence."""
    src = slots if src_slots is None else src_slots
    init = initial_flags(slots, has_initial_state, src_slots)
    return jnp.stack([slots.astype(jnp.int32), init,
                      jnp.where(init > 0, src, 0).astype(jnp.int32)], axis=1)


def sequence_table(cu_seqlens: jax.Array, slots: jax.Array, has_initial_state: jax.Array | None,
                   src_slots: jax.Array | None) -> jax.Array:
    """i32[S, 5] rows (first packed row, tokens, destination slot, continues, source slot) that
    the prefill kernels read per sequence."""
    cu = cu_seqlens.astype(jnp.int32)
    return jnp.concatenate([jnp.stack([cu[:-1], cu[1:] - cu[:-1]], axis=1),
                            slot_table(slots, has_initial_state, src_slots)], axis=1)


def _chunk_counts(cu_seqlens: jax.Array, slots: jax.Array, chunk: int) -> jax.Array:
    lens = jnp.where(slots >= 0, cu_seqlens[1:] - cu_seqlens[:-1], 0)
    return (lens + chunk - 1) // chunk


def first_chunks(cu_seqlens: jax.Array, slots: jax.Array, chunk: int) -> jax.Array:
    """i32[S]: the row of `chunk_table` holding each sequence's first chunk (where its chunks
    would start, for a sequence with none)."""
    n = _chunk_counts(cu_seqlens.astype(jnp.int32), slots, chunk)
    return (jnp.cumsum(n) - n).astype(jnp.int32)


def chunk_table(cu_seqlens: jax.Array, slots: jax.Array, num_tokens: int, chunk: int) -> jax.Array:
    """i32[NC, 2] rows (first packed row, rows) of every chunk of every live sequence: a
    sequence's tokens cut into `chunk`-row pieces from its first token (a chunk never crosses
    into the next sequence), in order; rows past the live chunks have 0 rows. NC =
    cdiv(num_tokens, chunk) + S bounds the count for any batch (each sequence adds at most one
    partial chunk)."""
    s = slots.shape[0]
    cu = cu_seqlens.astype(jnp.int32)
    n = _chunk_counts(cu, slots, chunk)
    ends = jnp.cumsum(n)
    i = jnp.arange(num_chunks(num_tokens, s, chunk), dtype=jnp.int32)
    seq = jnp.minimum(jnp.searchsorted(ends, i, side="right", method="compare_all"), s - 1)
    row0 = cu[seq] + (i - (ends[seq] - n[seq])) * chunk
    rows = jnp.where(i < ends[-1], jnp.clip(cu[seq + 1] - row0, 0, chunk), 0)
    return jnp.stack([row0, rows], axis=1).astype(jnp.int32)


def num_chunks(num_tokens: int, num_seqs: int, chunk: int) -> int:
    """NC, the rows of `chunk_table`: enough for any batch of these sizes."""
    return -(-num_tokens // chunk) + num_seqs
