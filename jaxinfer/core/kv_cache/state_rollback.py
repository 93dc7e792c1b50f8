"""Speculative decoding over fixed states (kv_specs.FixedStateSpec: state-space layers): the KV
cache manager's side of rolling a state back. Mixed into KVCacheManager.

A verifying step runs a speculating decode as a (1 + k)-token chunk, and the state layers write
the state after all k + 1 inputs over the sequence's state pages; when the rejection sampler
keeps fewer, that state is past the sequence's last accepted token, and a state cannot be
truncated the way attention slots are. So before such a step the scheduler has the manager copy
the state pages to spare blocks (`snapshot_for_verify`: the copies run at the start of the step,
before it writes any state, take_pending_copies' contract); once the step is processed,
`settle_verify` keeps the new state when every proposal was accepted, else queues the copies
back (run at the start of the next step, before it writes) and answers the token count the
state stands for again, so the scheduler recomputes the accepted tokens as a short chunk:
exact, at the cost of that recompute on a rejection.
"""

from __future__ import annotations

from typing import Hashable


class StateRollbackMixin:
    @property
    def rolls_back_states(self) -> bool:
        """Whether a verifying step needs `snapshot_for_verify` (the model keeps fixed states)."""
        return bool(self._state_pages)

    def snapshot_for_verify(self, request_id: Hashable, start: int, end: int) -> bool:
        """The request's decode from token `start` verifies proposals up to token `end` (its
        state will stand for `end` tokens after the step): copy its state pages to spare blocks
        for `settle_verify`. False (nothing taken) when the pool has no room: the row must not
        speculate (a proposal never preempts anyone)."""
        req = self._requests[request_id]
        taken = None if req.verify is not None else self._copy_state_pages(req)
        if taken is None:
            return False
        req.verify = (start, end, taken)
        return True

    def settle_verify(self, request_id: Hashable, num_computed: int) -> int:
        """The verifying step was processed and the request computed `num_computed` tokens: the
        tokens its state stands for from now on, `num_computed` when every proposal was accepted
        (the step's state kept), else the step's `start` (the snapshot copied back over the
        state pages before the next step writes them). `num_computed` when nothing was taken."""
        req = self._requests.get(request_id)
        if req is None or req.verify is None:
            return num_computed
        start, end, taken = req.verify
        req.verify = None
        if num_computed >= end:
            self._drop_verify(taken)
            return num_computed
        copies = self._pending_state_copies
        for g, blocks in taken.items():
            for src, dst in zip(blocks, req.tables[g]):
                copies[dst] = src
            self._copy_sources.extend(blocks)  # released once the copies are taken
        return start

    def _drop_verify_hold(self, req) -> None:
        """A freed request's spare state blocks go back."""
        if req.verify is not None:
            self._drop_verify(req.verify[2])
            req.verify = None

    def _drop_verify(self, taken: dict[int, list[int]]) -> None:
        for blocks in taken.values():
            for b in blocks:
                self._release(b)
