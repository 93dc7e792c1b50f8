"""Attention metadata: the device arrays that tell attention where each token's K/V lives.

This is the seam between the engine (which builds these arrays on the host, padded to compile
buckets) and every attention backend (jnp reference, Triton-lowered Pallas, Mosaic GPU).

A step's batch is a flat array of T tokens from S sequences. Sequences are ordered decodes first:
the first `num_decodes` sequences have exactly one new token each, at token indices
0 .. num_decodes-1, so decode attention and prefill attention each get a contiguous slice.

Padding conventions (buckets):
- padding tokens have `slot_mapping == -1` (their K/V is not written) and belong to no sequence
  (they sit after `query_start_loc[-1]` or in a sequence of query length 0); their output is 0;
- padding sequences have `seq_lens == 0` and an empty query range; block-table entries past a
  sequence's last block are 0 (a valid block id, never read because of `seq_lens`).
"""

from __future__ import annotations

import dataclasses

import jax


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
    # int32[T]: flat cache slot (block_id * block_size + offset) for each new token; -1 = skip.
    slot_mapping: jax.Array
    # int32[S+1]: token index where each sequence's new tokens start; the last entry ends the batch.
    query_start_loc: jax.Array
    # int32[S]: context length of each sequence *including* its new tokens.
    seq_lens: jax.Array
    # int32[S, M]: physical block ids of each sequence, logical order.
    block_tables: jax.Array
    # Static: the first num_decodes sequences are single-token decodes (tokens 0..num_decodes-1).
    num_decodes: int = dataclasses.field(default=0, metadata=dict(static=True))
    # Static, KV groups (jaxinfer/core/kv_cache/kv_groups.py): per layer (cache array, group).
    # With it, slot_mapping is int32[G, T] and block_tables int32[G, S, M], one per group; None:
    # one group, layer i in cache array i (the arrays above as documented).
    kv_layout: tuple[tuple[int, int], ...] | None = dataclasses.field(
        default=None, metadata=dict(static=True))

    def for_layer(self, layer: int) -> tuple[int, AttentionMetadata]:
        """(cache array, metadata with that layer's group's slot mapping and block table)."""
        if self.kv_layout is None:
            return layer, self
        slot, group = self.kv_layout[layer]
        return slot, self.group(group)

    def group(self, g: int) -> AttentionMetadata:
        """KV group g's slot mapping and block table alone (one group: this metadata)."""
        if self.kv_layout is None:
            return self
        return dataclasses.replace(self, slot_mapping=self.slot_mapping[g],
                                   block_tables=self.block_tables[g], kv_layout=None)

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]
