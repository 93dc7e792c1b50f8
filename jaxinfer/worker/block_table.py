"""The persistent batch's block tables (vLLM V1's `BlockTable` of its InputBatch): each sequence
slot's row of every KV group's table, kept in numpy on the host, so a step gathers its rows with
one index instead of rebuilding [groups, S, max_blocks] from every row's list of block ids.

A row is brought up to date from the scheduled row it serves (`row_of`), through the KV manager's
`table_version` (KVCacheManager.table_version): while the version is the one copied last, only the
blocks appended since are copied (a decode crosses a block boundary once every block_size
steps); a new version (a new occupant of the slot, a preempted sequence back, copy-on-write, a
skipped or deduplicated block, a truncation) rewrites the row. Nothing is consumed, so a step
that was scheduled but never built (a failed dispatch) leaves no row stale.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from jaxinfer.core.scheduler_output import ScheduledSeq


class BlockTable:
    def __init__(self, num_slots: int, num_groups: int, width: int, growing: Sequence[int]):
        """`growing`: the groups whose tables grow with the tokens (all of one length; the others
        hold a fixed state's pages)."""
        self.pad = num_slots  # the extra last row: zeros (padding rows, rows built from lists)
        self.rows = np.zeros((num_groups, num_slots + 1, width), np.int32)
        self._growing = tuple(growing)
        self._version: list[int | None] = [None] * num_slots
        self._length = [0] * num_slots  # the growing groups' entries copied

    def row_of(self, entry: ScheduledSeq) -> int:
        """`entry`'s row of `rows`, up to date with its lists; `pad` where it has no row of its
        own (no slot: an n > 1 prompt sequence; no table version), for the caller to fill."""
        version, slot = entry.table_version, entry.seq.slot
        if version is None or slot < 0:
            return self.pad
        tables = entry.group_block_ids or (entry.block_ids,)
        if self._version[slot] != version:
            self._rewrite(slot, version, tables)
        elif self._growing:  # (a version's tables only grow: a truncation makes a new one)
            n = len(tables[self._growing[0]])
            old = self._length[slot]
            if n > old:
                rows = self.rows
                for g in self._growing:
                    rows[g, slot, old:n] = tables[g][old:n]
                self._length[slot] = n
        return slot

    def _rewrite(self, slot: int, version: int, tables: Sequence[list[int]]) -> None:
        self._version[slot] = None  # (until written: a failed write leaves no version)
        row = self.rows[:, slot]
        row[:] = 0
        for g, t in enumerate(tables):
            row[g, :len(t)] = t
        self._version[slot] = version
        self._length[slot] = len(tables[self._growing[0]]) if self._growing else 0
