"""Sequences waiting for their prefix's KV to come back from the host tier (WAITING_FOR_KV).

At admission the scheduler matches a prompt against the device prefix cache and then, past that
match, against the host tier (`KVCacheManager.match_host`): host hits get fresh device blocks and
the sequence leaves the waiting queue for `KVLoads`, holding those blocks, while the worker copies
the blocks host -> device on its own (`KVTransfers.load_starts`). No step waits for it. Each step
the engine tells the scheduler which copies have landed (checked without a sync); those sequences
go back to the front of the waiting queue with the loaded blocks counted as computed and entered
in the device prefix cache, and the step's `KVTransfers.load_scatters` write the landed blocks
into the device cache before the step runs, so the forward that first reads them comes after.

An abort while the copy is in flight frees the device blocks and unpins the host slots at once and
tells the worker to drop the copy (`load_cancels`): no scatter is ever issued for a block the
sequence no longer holds. Loading sequences are not running, so preemption never meets one.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable

from jaxinfer.core.kv_cache import KVCacheManager
from jaxinfer.core.request import Sequence, SeqStatus


@dataclasses.dataclass
class KVTransfers:
    """The host tier's copies a step's dispatch makes first, in this order (worker/kv/host_store)."""
    # Runs of (device block, host slot): blocks to copy out before anything writes them again
    # (a released request's prefix, or evicted blocks; core/kv_cache/host_offload.py).
    offloads: list[list[tuple[int, int]]] = dataclasses.field(default_factory=list)
    # Copies whose sequence ended: drop their device buffers (seq ids).
    load_cancels: list[str] = dataclasses.field(default_factory=list)
    # (seq id, host slots): start the host -> device copy into a buffer of the worker's.
    load_starts: list[tuple[str, list[int]]] = dataclasses.field(default_factory=list)
    # (seq id, device block per loaded block, -1: skip): landed buffers into the cache.
    load_scatters: list[tuple[str, list[int]]] = dataclasses.field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.offloads or self.load_cancels or self.load_starts or self.load_scatters)


class KVLoads:
    """The scheduler's loading sequences, and the transfers to hand the worker with the next step."""

    def __init__(self, kv: KVCacheManager):
        self.kv = kv
        # seq id -> (sequence, host slots, device blocks) while its copy is in flight.
        self._loading: dict[str, tuple[Sequence, list[int], list[int]]] = {}
        # seq id -> blocks its first chunk after the load will need: other loads leave them free,
        # so loading sequences cannot take each other's room and then all fail to run.
        self._room: dict[str, int] = {}
        self._next = KVTransfers()

    def __len__(self) -> int:
        return len(self._loading)

    def start(self, seq: Sequence, chunk_tokens: int) -> bool:
        """After the sequence's device prefix match: start loading its host hits, if any (the
        sequence is then WAITING_FOR_KV, its num_computed covering them), leaving free the blocks
        of a first chunk of `chunk_tokens` (so loads cannot fill the pool with sequences that
        then cannot run). False: none to load."""
        if seq.request.reads_prompt_hidden:  # computes every prompt position: no hit at all
            return False
        pairs = self.kv.match_host(seq.seq_id, seq.token_ids, chunk_tokens,
                                   sum(self._room.values()))
        if not pairs:
            return False
        left = len(seq.token_ids) - seq.num_computed - len(pairs) * self.kv.block_size
        self._room[seq.seq_id] = 1 + -(-min(chunk_tokens, left) // self.kv.block_size)
        slots, blocks = [s for s, _ in pairs], [b for _, b in pairs]
        seq.status = SeqStatus.WAITING_FOR_KV
        seq.num_computed += len(blocks) * self.kv.block_size
        self._loading[seq.seq_id] = (seq, slots, blocks)
        self._next.load_starts.append((seq.seq_id, slots))
        return True

    def landed(self, seq_ids: Iterable[str]) -> list[Sequence]:
        """The worker's landed copies (unknown ids: cancelled meanwhile, ignored): their blocks
        enter the device prefix cache and are scattered with the next step; the sequences, to
        requeue."""
        ready = []
        for sid in seq_ids:
            entry = self._loading.pop(sid, None)
            if entry is None:
                continue
            del self._room[sid]
            seq, slots, blocks = entry
            self.kv.loaded(slots)
            self.kv.cache_blocks(sid, seq.token_ids, seq.num_computed)
            # A block the cache already had (computed meanwhile) replaced ours: skip its scatter.
            table = self.kv.get_block_ids(sid)
            first = seq.num_computed // self.kv.block_size - len(blocks)
            self._next.load_scatters.append(
                (sid, [b if table[first + i] == b else -1 for i, b in enumerate(blocks)]))
            ready.append(seq)
        return ready

    def cancel(self, seq: Sequence) -> None:
        """The loading sequence ends (abort): unpin its slots and drop its copy. The caller frees
        its device blocks."""
        _, slots, _ = self._loading.pop(seq.seq_id)
        del self._room[seq.seq_id]
        self.kv.loaded(slots, landed=False)
        self._next.load_cancels.append(seq.seq_id)

    def take_cancels(self) -> list[str]:
        """The cancelled copies not yet handed over (an abort between steps), and clear them."""
        out, self._next.load_cancels = self._next.load_cancels, []
        return out

    def take(self) -> KVTransfers:
        """The transfers for the step being scheduled (the manager's offloads included)."""
        out, self._next = self._next, KVTransfers()
        out.offloads = self.kv.take_pending_offloads()
        return out
