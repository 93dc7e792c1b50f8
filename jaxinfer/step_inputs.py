"""Host side of a step: flatten the scheduled sequences into padded numpy arrays (one bucket shape).

Layout of a step of S sequence rows and T tokens: decode rows first (one token each), then prefill
chunks, then padding (slot -1, seq_len 0, see pallas_kernels/metadata.py). A decode whose input token
is still on the device (sampled by the previous, in-flight step) gets `input_slot` = its sequence's
row in the device array of last sampled tokens, so the host never waits for it.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from jaxinfer.kv_cache import KVCacheManager
from jaxinfer.sampler import BASE_SAMPLER, FULL_SAMPLER, SamplerVariant, SamplingTensors
from jaxinfer.sampling_params import MAX_STOP_TOKEN_IDS
from jaxinfer.scheduler import ScheduledSeq
from pallas_kernels.metadata import AttentionMetadata


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


def sampler_variant(rows: list[ScheduledSeq]) -> SamplerVariant:
    """The base variant unless some row needs top-k/top-p/min-p, logprobs or penalties; then the full
    one (both extras together: two compiled variants per shape instead of four)."""
    for r in rows:
        p = r.seq.request.params
        if p.uses_truncation or p.logprobs is not None or p.uses_penalties:
            return FULL_SAMPLER
    return BASE_SAMPLER


def build_step_batch(rows: list[ScheduledSeq], num_decode_rows: int, num_tokens: int,
                     num_seqs: int, kv: KVCacheManager, block_size: int, max_blocks: int,
                     max_model_len: int, variant: SamplerVariant) -> StepBatch:
    """rows: decodes first. num_decode_rows: the static decode count (T == S == num_decode_rows for
    a pure-decode bucket, 0 for a mixed step). Returns numpy arrays (the caller device_puts)."""
    n = len(rows)
    i32 = np.int32
    token_ids = np.zeros(num_tokens, i32)
    input_slot = np.full(num_tokens, -1, i32)
    positions = np.zeros(num_tokens, i32)
    token_row = np.full(num_tokens, -1, i32)
    qsl = np.zeros(num_seqs + 1, i32)
    seq_lens = np.zeros(num_seqs, i32)
    block_tables = np.zeros((num_seqs, max_blocks), i32)
    logits_indices = np.zeros(num_seqs, i32)
    emit_slot = np.full(num_seqs, -1, i32)

    t = 0
    for r, entry in enumerate(rows):
        seq, start, k = entry.seq, entry.start, entry.num_tokens
        ids = kv.get_block_ids(seq.seq_id)
        block_tables[r, :len(ids)] = ids
        end = start + k
        known = len(seq.token_ids)
        if end <= known:
            token_ids[t:t + k] = seq.token_ids[start:end]
        else:  # a decode of the token the in-flight step is sampling
            input_slot[t] = seq.slot
        positions[t:t + k] = range(start, end)
        token_row[t:t + k] = r
        seq_lens[r] = end
        t += k
        qsl[r + 1] = t
        logits_indices[r] = t - 1
        if entry.emits:
            emit_slot[r] = seq.slot
    if num_decode_rows:  # pure-decode bucket: padding rows are one-token decodes too
        qsl[n + 1:] = np.arange(n + 1, num_seqs + 1)
    else:
        qsl[n + 1:] = t
    real = token_row >= 0
    rows_idx = np.where(real, token_row, 0)
    blk = block_tables[rows_idx, positions // block_size]
    slot_mapping = np.where(real, blk * block_size + positions % block_size, -1).astype(i32)
    md = AttentionMetadata(slot_mapping, qsl, seq_lens, block_tables, num_decodes=num_decode_rows)
    sampling = sampling_tensors(rows, num_seqs, max_model_len, variant)
    return StepBatch(token_ids, input_slot, positions, md, logits_indices, emit_slot, sampling)


def sampling_tensors(rows: list[ScheduledSeq], num_seqs: int, max_model_len: int,
                     variant: SamplerVariant) -> SamplingTensors:
    n = len(rows)
    temperature = np.zeros(num_seqs, np.float32)
    top_k = np.zeros(num_seqs, np.int32)
    top_p = np.ones(num_seqs, np.float32)
    min_p = np.zeros(num_seqs, np.float32)
    seed = np.zeros(num_seqs, np.uint32)
    out_pos = np.zeros(num_seqs, np.int32)
    min_tokens = np.zeros(num_seqs, np.int32)
    stop_ids = np.full((num_seqs, MAX_STOP_TOKEN_IDS), -1, np.int32)
    for r, entry in enumerate(rows):
        seq = entry.seq
        p = seq.request.params
        temperature[r] = p.temperature
        top_k[r] = max(p.top_k, 0)
        top_p[r] = p.top_p
        min_p[r] = p.min_p
        seed[r] = seq.seed
        out_pos[r] = entry.start + entry.num_tokens - seq.prompt_len
        min_tokens[r] = p.min_tokens
        stop_ids[r] = seq.request.stop_ids_row
    t = SamplingTensors(temperature, top_k, top_p, min_p, seed, out_pos, min_tokens, stop_ids)
    if variant.penalties:
        rep = np.ones(num_seqs, np.float32)
        pres = np.zeros(num_seqs, np.float32)
        freq = np.zeros(num_seqs, np.float32)
        history = np.full((num_seqs, max_model_len), -1, np.int32)
        prompt_len = np.zeros(num_seqs, np.int32)
        for r, entry in enumerate(rows[:n]):
            seq = entry.seq
            p = seq.request.params
            rep[r], pres[r], freq[r] = p.repetition_penalty, p.presence_penalty, p.frequency_penalty
            history[r, :len(seq.token_ids)] = seq.token_ids
            prompt_len[r] = seq.prompt_len
        t = dataclasses.replace(t, repetition_penalty=rep, presence_penalty=pres,
                                frequency_penalty=freq, history=history, prompt_len=prompt_len)
    return t
