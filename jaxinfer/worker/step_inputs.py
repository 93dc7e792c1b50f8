"""Host side of a step: flatten the scheduled sequences into padded numpy arrays (one bucket shape).

Layout of a step of S sequence rows and T tokens: decode rows first (one token each), then prefill
chunks, then padding (slot -1, seq_len 0, see pallas_kernels/attention/metadata.py). A decode whose
input token is still on the device (sampled by the previous, in-flight step) gets `input_slot` =
its sequence's row in the device array of last sampled tokens, so the host never waits for it.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.errors import RequestFailedError
from jaxinfer.worker.block_table import BlockTable
from jaxinfer.worker.sampler import (BASE_SAMPLER, FULL_SAMPLER, MASKED_SAMPLER, SamplerVariant,
                                     SamplingTensors)
from jaxinfer.sampling_params import GREEDY_EPS, MAX_STOP_TOKEN_IDS
from jaxinfer.core.request import Sequence
from jaxinfer.core.scheduler import ScheduledSeq
from jaxinfer.structured.grammar import step_bitmask
from pallas_kernels.attention.metadata import AttentionMetadata


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class StepBatch:
    token_ids: jax.Array       # i32[T]: input ids known on the host
    input_slot: jax.Array      # i32[T]: >= 0 -> use last_tokens[input_slot] (in flight) instead
    positions: jax.Array       # i32[T]
    md: AttentionMetadata
    logits_indices: jax.Array  # i32[S]: the last new token of each row
    emit_slot: jax.Array       # i32[S]: >= 0 -> store the row's sampled token in last_tokens
    sampling: SamplingTensors
    # i32[T]: each token's LoRA slot (its row's adapter; 0: none), None when LoRA is off.
    lora_slot: jax.Array | None = None


def input_ids(batch: StepBatch, last_tokens: jax.Array) -> jax.Array:
    """On the device: the step's token ids, in-flight inputs read from `last_tokens`."""
    pending = last_tokens[jnp.maximum(batch.input_slot, 0)]
    return jnp.where(batch.input_slot >= 0, pending, batch.token_ids)


def store_emitted(last_tokens: jax.Array, emit_slot: jax.Array, tokens: jax.Array) -> jax.Array:
    """On the device: each emitting row's token into its `last_tokens` slot (others dropped)."""
    dst = jnp.where(emit_slot >= 0, emit_slot, last_tokens.shape[0])
    return last_tokens.at[dst].set(tokens, mode="drop")


class SamplingRows(NamedTuple):
    """A persistent batch's sampling constants (vLLM's InputBatch idea): one numpy array per field,
    one row per sequence slot, each row written once when a sequence takes its slot (`write`) and
    gathered per step with one index (`take`). SamplingParams.validate bounded every value to what
    its int32 / float32 column holds. Fresh rows are padding: greedy, every filter off."""
    temperature: np.ndarray       # f32; 0 = greedy
    top_k: np.ndarray             # i32; 0 = off
    top_p: np.ndarray             # f32; 1 = off
    min_p: np.ndarray             # f32; 0 = off
    seed: np.ndarray              # u32: the choice's own seed
    min_tokens: np.ndarray        # i32
    prompt_len: np.ndarray        # i32: where the row's outputs start
    num_top_logprobs: np.ndarray  # i32
    stop_ids: np.ndarray          # i32[MAX_STOP_TOKEN_IDS]: EOS + stop_token_ids, -1 = none

    @classmethod
    def padding(cls, num_rows: int) -> SamplingRows:
        zeros = functools.partial(np.zeros, num_rows)
        return cls(zeros(np.float32), zeros(np.int32), np.ones(num_rows, np.float32),
                   zeros(np.float32), zeros(np.uint32), zeros(np.int32), zeros(np.int32),
                   zeros(np.int32), np.full((num_rows, MAX_STOP_TOKEN_IDS), -1, np.int32))

    def write(self, row: int, seq: Sequence) -> None:
        """Row `row` from a sequence's request (the one place a request's sampling parameters
        become per-row values)."""
        p = seq.request.params
        self.temperature[row] = p.temperature if p.temperature >= GREEDY_EPS else 0.0
        self.top_k[row] = max(p.top_k, 0)
        self.top_p[row] = p.top_p
        self.min_p[row] = p.min_p
        self.seed[row] = seq.seed
        self.min_tokens[row] = p.min_tokens
        self.prompt_len[row] = seq.prompt_len
        self.num_top_logprobs[row] = p.logprobs or 0
        self.stop_ids[row] = seq.request.stop_ids_row

    def take(self, rows: np.ndarray) -> SamplingRows:
        return SamplingRows(*(field[rows] for field in self))


class SamplingTable:
    """The sequence rows' `SamplingRows`, kept on the host by slot and written once per sequence,
    so a step gathers them with one numpy index instead of converting 256 Python objects. The
    extra last row holds padding defaults (also used by n > 1 prompt sequences, which have no slot
    and no sample). `vocab_size` sizes the masked sampler variant's token bitmask; `sharding`
    places the device-resident inputs (`no_history`) like the step's others (None: default device)."""

    def __init__(self, num_slots: int, vocab_size: int = 0,
                 sharding: jax.sharding.Sharding | None = None):
        self.pad = num_slots
        self.vocab_size = vocab_size
        self.sharding = sharding
        self._no_history: dict[tuple[int, int], jax.Array] = {}
        self.rows = SamplingRows.padding(num_slots + 1)
        self._owner: list[object] = [None] * num_slots

    def no_history(self, num_seqs: int, length: int) -> jax.Array:
        """i32[S, L] of -1 (no token seen), kept on the device: the history a full-variant batch
        passes when no row uses penalties, so such a step neither fills nor copies megabytes on
        the host ([256, 2048] is 2 MiB: on the H200 a jitted call with a host argument of that
        size took 0.6 ms to dispatch, against 0.3 ms with a small one)."""
        key = (num_seqs, length)
        if key not in self._no_history:
            self._no_history[key] = jax.device_put(np.full(key, -1, np.int32), self.sharding)
        return self._no_history[key]

    def row_of(self, seq) -> int:
        slot = seq.slot
        if slot < 0:
            return self.pad
        if self._owner[slot] is not seq:  # a new occupant of this slot
            self._owner[slot] = seq
            self.rows.write(slot, seq)
        return slot


def sampler_variant(rows: list[ScheduledSeq]) -> SamplerVariant:
    """The base variant unless some row needs top-k/top-p/min-p, logprobs or penalties; then the full
    one (both extras together: two compiled variants per shape instead of four). A row with a
    grammar makes it the masked variant (the full one plus the bitmask)."""
    if any(r.seq.grammar is not None for r in rows):
        return MASKED_SAMPLER
    return FULL_SAMPLER if any(r.seq.request.needs_full_sampler for r in rows) else BASE_SAMPLER


def all_greedy(rows: list[ScheduledSeq]) -> bool:
    """Every row samples greedily: speculative steps then compute argmaxes only
    (`rejection_sampler.verify`'s greedy_only)."""
    return all(r.seq.request.params.temperature <= 0.0 for r in rows)


def build_step_batch(rows: list[ScheduledSeq], num_decode_rows: int, num_tokens: int,
                     num_seqs: int, table: SamplingTable,
                     block_size: int, max_blocks: int, max_model_len: int,
                     variant: SamplerVariant, lora: bool = False,
                     kv_layout: tuple[tuple[int, int], ...] | None = None,
                     blocks: BlockTable | None = None) -> StepBatch:
    """rows: decodes first, each with its block ids. num_decode_rows: the static decode count
    (T == S == num_decode_rows for a pure-decode bucket, 0 for a mixed step). Returns numpy
    arrays (the caller device_puts). `lora`: the batch carries each token's LoRA slot.
    `kv_layout` (KVCacheGroups.kv_layout): one block table and slot mapping per KV group, from
    each row's `group_block_ids`. `blocks`: the slots' persistent block tables, brought up to
    date and gathered (rows without a slot there are built from their lists); None: every row
    from its lists.

    The per-row work is plain list appends; every array is then made by a few vectorized numpy
    operations (this runs every step: 256 rows must cost well under a millisecond)."""
    i32 = np.int32
    n = len(rows)
    toks: list[int] = []
    in_slot: list[int] = []
    starts: list[int] = []
    q_lens: list[int] = []
    emit: list[int] = []
    block_rows: list[int] = []
    loose: list[int] = []  # the rows built from their lists
    table_rows: list[int] = []
    row_of = table.row_of
    block_row = blocks.row_of if blocks is not None else None
    pad_row = blocks.pad if blocks is not None else -1
    for r, entry in enumerate(rows):
        seq, start, k = entry.seq, entry.start, entry.num_tokens
        try:  # (free when nothing raises) a row that cannot be built fails its own request only
            b = block_row(entry) if block_row is not None else pad_row
            if b == pad_row:
                loose.append(r)
            block_rows.append(b)
            table_rows.append(row_of(seq))
        except Exception as e:
            rid = seq.request.request_id
            raise RequestFailedError(f"building request {rid}'s step: {e!r}", (rid,)) from e
        if k == 1:
            if start < len(seq.token_ids):
                toks.append(seq.token_ids[start])
                in_slot.append(-1)
            else:  # a decode of the token the in-flight step is sampling
                toks.append(0)
                in_slot.append(seq.slot)
        else:
            toks.extend(seq.token_ids[start:start + k])
            toks.extend(entry.proposal)  # a speculative decode: its input token, then these
            in_slot.extend([-1] * k)
        starts.append(start)
        q_lens.append(k)
        emit.append(seq.slot if entry.emits else -1)
    t = len(toks)

    def padded(values: list[int], size: int, fill: int) -> np.ndarray:
        out = np.full(size, fill, i32)
        out[:len(values)] = values
        return out

    token_ids = padded(toks, num_tokens, 0)
    input_slot = padded(in_slot, num_tokens, -1)
    seq_lens = padded(starts, num_seqs, 0)  # (+ q_lens below: each row's end)
    emit_slot = padded(emit, num_seqs, -1)
    qsl = np.zeros(num_seqs + 1, i32)
    np.cumsum(q_lens, out=qsl[1:n + 1])
    positions = np.zeros(num_tokens, i32)
    if t == n:  # one token a row (decodes): its position is its start
        positions[:n] = seq_lens[:n]
        token_row = np.arange(n)
    else:
        q = np.asarray(q_lens, i32)
        positions[:t] = np.repeat(seq_lens[:n] - qsl[:n], q) + np.arange(t, dtype=i32)
        token_row = np.repeat(np.arange(n), q)
    seq_lens[:n] += qsl[1:n + 1] - qsl[:n]
    if num_decode_rows:  # pure-decode bucket: padding rows are one-token decodes too
        qsl[n + 1:] = np.arange(n + 1, num_seqs + 1)
    else:
        qsl[n + 1:] = t
    logits_indices = np.zeros(num_seqs, i32)
    logits_indices[:n] = qsl[1:n + 1] - 1
    num_groups = 1 + max(g for _, g in kv_layout) if kv_layout else 1
    if blocks is not None:
        gather = np.full(num_seqs, blocks.pad, np.intp)
        gather[:n] = block_rows
        block_tables = blocks.rows[:num_groups, gather, :max_blocks]
    else:
        block_tables = np.zeros((num_groups, num_seqs, max_blocks), i32)
    _fill_tables(block_tables, [rows[r] for r in loose], loose, kv_layout is not None)
    blk = block_tables[:, token_row, positions[:t] // block_size]
    slot_mapping = np.full((num_groups, num_tokens), -1, i32)
    slot_mapping[:, :t] = blk * block_size + positions[:t] % block_size
    if not kv_layout:
        block_tables, slot_mapping = block_tables[0], slot_mapping[0]
    md = AttentionMetadata(slot_mapping, qsl, seq_lens, block_tables, num_decodes=num_decode_rows,
                           kv_layout=kv_layout)
    sampling = sampling_tensors(rows, padded(table_rows, num_seqs, table.pad), seq_lens, table,
                                max_model_len, variant)
    lora_slot = None
    if lora:
        lora_slot = np.zeros(num_tokens, i32)
        lora_slot[:t] = np.repeat([entry.seq.lora_slot for entry in rows], q_lens)
    return StepBatch(token_ids, input_slot, positions, md, logits_indices, emit_slot, sampling,
                     lora_slot)


def _fill_tables(block_tables: np.ndarray, entries: list[ScheduledSeq], at: list[int],
                 grouped: bool) -> None:
    """Rows `at` of `block_tables` [groups, S, width] (zeros) from `entries`' lists."""
    n = len(entries)
    tables = [e.group_block_ids if grouped else (e.block_ids,) for e in entries]
    at = np.asarray(at, np.intp)
    # The groups that grow with the tokens share their tables' length; a fixed state's group
    # holds its state's pages whatever the length (kv_specs.FixedStateSpec).
    lengths = {}
    for g in range(block_tables.shape[0] if n else 0):
        counts = np.fromiter((len(ts[g]) for ts in tables), np.int32, n)
        key = counts.tobytes()
        if key not in lengths:
            lengths[key] = (np.repeat(at, counts), np.arange(int(counts.sum()))
                            - np.repeat(np.cumsum(counts) - counts, counts))
        table_row, table_col = lengths[key]
        block_tables[g, table_row, table_col] = np.fromiter(
            itertools.chain.from_iterable(ts[g] for ts in tables), np.int32, table_col.size)


def sampling_tensors(rows: list[ScheduledSeq], table_rows: np.ndarray, seq_lens: np.ndarray,
                     table: SamplingTable, max_model_len: int,
                     variant: SamplerVariant) -> SamplingTensors:
    num_seqs = table_rows.shape[0]
    per_row = table.rows.take(table_rows)
    out_pos = np.maximum(seq_lens - per_row.prompt_len, 0).astype(np.int32)
    t = SamplingTensors(per_row.temperature, per_row.top_k, per_row.top_p, per_row.min_p,
                        per_row.seed, out_pos, per_row.min_tokens, per_row.stop_ids)
    if variant.advanced:
        t = dataclasses.replace(t, num_top_logprobs=per_row.num_top_logprobs)
    if variant.penalties:
        rep = np.ones(num_seqs, np.float32)
        pres = np.zeros(num_seqs, np.float32)
        freq = np.zeros(num_seqs, np.float32)
        # Neutral penalties everywhere (the batch runs the full variant for its other extras, e.g.
        # top-p): the device skips them, so no history crosses from the host.
        uses = any(entry.seq.request.params.uses_penalties for entry in rows)
        history = (np.full((num_seqs, max_model_len), -1, np.int32) if uses
                   else table.no_history(num_seqs, max_model_len))
        for r, entry in enumerate(rows if uses else ()):
            seq = entry.seq
            p = seq.request.params
            rep[r], pres[r], freq[r] = p.repetition_penalty, p.presence_penalty, p.frequency_penalty
            history[r, :len(seq.token_ids)] = seq.token_ids
        t = dataclasses.replace(t, repetition_penalty=rep, presence_penalty=pres,
                                frequency_penalty=freq, history=history,
                                prompt_len=per_row.prompt_len)
    if variant.masked:
        t = dataclasses.replace(t, token_bitmask=step_bitmask(rows, num_seqs, table.vocab_size))
    return t
