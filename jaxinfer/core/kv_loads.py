"""A prefix's KV coming back from the host tier, with the step that first reads it.

At admission the scheduler matches a prompt against the device prefix cache and then, past that
match, against the host tier (`KVCacheManager.match_host`): host hits get fresh device blocks,
counted as computed and entered in the device prefix cache at once (with state-space layers, the
snapshot after the last of them is loaded into the sequence's state pages), and the sequence is
scheduled in the same step as any other admission. The step's `KVTransfers.loads` copy the host
pieces to the device and scatter them into those blocks ahead of the step's forward
(worker/kv/host_store.py), so the device runs copy, scatter and forward in that order.

Why the copy is not waited for in a state of its own, as the first design did: on the H200 (jax
0.11.2) a pinned-host -> device copy lands only once the compute dispatched before it has run
(42b733b:tools/probe_h2d_order.py: 3.8 ms idle, 53 ms behind ten queued 5.6 ms matmuls), so it
overlaps nothing either way; waiting for it apart added the queue's depth, a poll and one more
step to every hit's time to first token (54 ms per load, and the tier lost to recomputing the
prefix: `kv_tiers_h200.json`'s earlier run). Loaded this way a hit costs the copy plus its step.

The host slots stay pinned until the step's transfers are taken (`take`), so no offload planned
while this step is scheduled can take a slot the load reads; the store captures the slots'
arrays when it dispatches the load, before any later step's offloads reuse them.
"""

from __future__ import annotations

import dataclasses

from jaxinfer.core.kv_cache import KVCacheManager
from jaxinfer.core.kv_cache.host_tier import HostTier
from jaxinfer.core.request import Sequence


@dataclasses.dataclass
class KVTransfers:
    """The host tier's copies a step's dispatch makes first, in this order (worker/kv/host_store)."""
    # Runs of (device block, host slot): blocks to copy out before anything writes them again
    # (a released request's prefix, or evicted blocks; core/kv_cache/host_offload.py).
    offloads: list[list[tuple[int, int]]] = dataclasses.field(default_factory=list)
    # (host slots, device block per slot; -1: skip): copied in before the step's forward.
    loads: list[tuple[list[int], list[int]]] = dataclasses.field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.offloads or self.loads)


class KVLoads:
    """The loads planned while a step is scheduled, and the transfers to hand the worker with it."""

    def __init__(self, kv: KVCacheManager):
        self.kv = kv
        self._next = KVTransfers()
        self._pinned: list[int] = []  # the planned loads' host slots, unpinned at `take`

    def start(self, seq: Sequence, chunk_tokens: int) -> None:
        """After the sequence's device prefix match: load its host hits, if any, with the step
        being scheduled, leaving free the blocks of a first chunk of `chunk_tokens` (so a load
        never takes the room its own prefill needs). Its num_computed grows by the loaded
        tokens."""
        if seq.request.reads_prompt_hidden:  # computes every prompt position: no hit at all
            return
        pairs = self.kv.match_host(seq.seq_id, seq.token_ids, chunk_tokens)
        if not pairs:
            return
        seq.num_computed = self.kv.num_tokens(seq.seq_id)
        self.kv.cache_blocks(seq.seq_id, seq.token_ids, seq.num_computed)
        # A block the cache already had replaced ours in the table: skip its scatter.
        held = {b for table in self.kv.get_block_tables(seq.seq_id) for b in table}
        slots = [s for s, _ in pairs]
        self._next.loads.append((slots, [b if b in held else -1 for _, b in pairs]))
        # Unpinned last first (`take`): the prefix's head becomes the host's most recently used.
        self._pinned += slots[::-1]

    def take(self) -> KVTransfers:
        """The transfers for the step being scheduled (the manager's offloads included)."""
        out, self._next = self._next, KVTransfers()
        out.offloads = self.kv.take_pending_offloads()
        if self._pinned:  # every offload of this step is planned: the slots may go from now on
            self.kv.loaded(self._pinned)
            self._pinned = []
        return out

    @property
    def host(self) -> HostTier:
        """The host tier's slots (its size, how many are used)."""
        return self.kv.host

    @property
    def host_hit_tokens(self) -> int:
        """Prompt tokens found in the host tier past the device prefix match, so far."""
        return self.kv.stats.host_hits

    def offload_cached(self) -> KVTransfers | None:
        """Every unreferenced cached device block to the host (before the device cache is
        released, LLMEngine.sleep): the copies to run now; None when no block needs one."""
        return self.take() if self.kv.offload_cached() else None
