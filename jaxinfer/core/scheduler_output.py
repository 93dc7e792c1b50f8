"""What the scheduler hands the runner for one step: the scheduled sequences with their block
rows and token counts, and the step's device-side work (copy-on-write copies, host-tier
transfers, loops). Plain data besides each row's `Sequence` (vLLM V1's `v1/core/sched/output.py`
is the model this follows)."""

from __future__ import annotations

import collections.abc
import dataclasses

from jaxinfer.core.kv_loads import KVTransfers
from jaxinfer.core.request import Sequence


@dataclasses.dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    start: int        # num_computed before this step: position of the first new token
    num_tokens: int   # new tokens computed this step
    emits: bool       # its sampled token is kept (the step reaches the end of its known tokens)
    # Its physical KV block ids in logical order (its block-table row), set once the step is
    # scheduled: the KV manager's own list, to read before the scheduler runs again. (Defaults are
    # tuples: a list per row per step is garbage-collector work, see docs/engine.md.)
    block_ids: collections.abc.Sequence[int] = ()
    # With several KV groups (a model with sliding windows): every group's row, block_ids first.
    group_block_ids: list[list[int]] | None = None
    # KVCacheManager.table_version of those rows: the runner's persistent copy of its slot's row
    # (worker/block_table.py) takes only the appended blocks while it is unchanged. None: the
    # row is built from the lists alone.
    table_version: int | None = None
    # Speculative decoding: tokens proposed after the decode's input (num_tokens = 1 + len), which
    # the step verifies (jaxinfer/spec_decode/); placeholders when the device proposes them.
    proposal: collections.abc.Sequence[int] = ()


@dataclasses.dataclass
class SchedulerOutput:
    decodes: list[ScheduledSeq]   # exactly one new token each
    prefills: list[ScheduledSeq]  # several new tokens each
    preempted: list[Sequence]
    # > 1: run this many decode steps on the device in one call (pure-decode steps only).
    decode_steps: int = 1
    # (src, dst) block copies the device performs before this step writes any KV or state:
    # attention pages' copy-on-write, and state pages' (snapshots, prefix hits, rollbacks;
    # only the target's own caches hold state pages).
    block_copies: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    state_copies: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    # Some row computes prompt tokens of a request that reads their hidden states (prompt
    # logprobs, pooling: worker/hidden_reads.py).
    reads_hidden: bool = False
    num_proposed: int = 0  # proposed tokens over all decodes (speculative decoding)
    # > 1: its decodes run this many verifying iterations on the device (spec_decode/spec_loop.py)
    spec_iterations: int = 1
    # The host KV tier's copies, made before anything else of the step (also with no rows).
    kv_transfers: KVTransfers | None = None

    @property
    def device_copies(self) -> list[tuple[int, int]]:
        """Every copy the target's caches take."""
        return self.block_copies + self.state_copies if self.state_copies else self.block_copies

    @property
    def scheduled(self) -> list[ScheduledSeq]:
        return self.decodes + self.prefills

    @property
    def num_tokens(self) -> int:
        return len(self.decodes) + self.num_proposed + sum(s.num_tokens for s in self.prefills)

    def __bool__(self) -> bool:
        return bool(self.decodes or self.prefills)
