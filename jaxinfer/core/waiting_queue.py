"""The scheduler's queue of waiting sequences, in admission order (priority, prompt index,
arrival), preempted sequences in front.

A request of several prompts names each `<id>#<i>` (serve/engine_requests.py): its prompt i waits
behind every other request's prompts of a lower index, so one request's many long prompts cannot
hold up a request that arrives after them (`prompt_index`). The queue counts its sequences and,
among them, those whose tokens one prefill chunk computes (`num_short`: they decode from the step
after their admission; the ITL target's batch to come), both kept as sequences come and go so
that no step walks the queue. Sequences that finish while waiting leave the heap lazily."""

from __future__ import annotations

import heapq
import itertools

from jaxinfer.core.request import Sequence, SeqStatus

PROMPT_INDEX_SEP = "#"


def prompt_index(request_id: str) -> int:
    """i of a request id `<id>#<i>` (prompt i of a request of several prompts), else 0: the
    admission order's round-robin key."""
    _, sep, tail = request_id.rpartition(PROMPT_INDEX_SEP)
    return int(tail) if sep and tail.isascii() and tail.isdigit() else 0


class WaitingQueue:
    def __init__(self, short_tokens: int):
        self.short_tokens = short_tokens  # the scheduler's long_prefill_chunk
        # Heap of (priority, prompt index, order, seq); in front: index -1, order < 0.
        self._heap: list[tuple[int, int, int, Sequence]] = []
        self._front = itertools.count(-1, -1)
        self._back = itertools.count()
        self._len = 0
        self.num_short = 0

    def __len__(self) -> int:
        return self._len

    def _count(self, seq: Sequence, sign: int) -> None:
        # (a waiting sequence's num_tokens stays put: a token in flight moves from pending to known)
        self._len += sign
        self.num_short += sign * (seq.num_tokens <= self.short_tokens)

    def push(self, seq: Sequence) -> None:
        heapq.heappush(self._heap, (seq.request.priority, prompt_index(seq.request.request_id),
                                    next(self._back), seq))
        self._count(seq, 1)

    def push_front(self, seq: Sequence) -> None:
        """A preempted sequence: ahead of every other of its priority."""
        heapq.heappush(self._heap, (seq.request.priority, -1, next(self._front), seq))
        self._count(seq, 1)

    def peek(self) -> Sequence | None:
        while self._heap and self._heap[0][3].status is not SeqStatus.WAITING:
            heapq.heappop(self._heap)  # finished while waiting
        return self._heap[0][3] if self._heap else None

    def pop(self) -> Sequence:
        """The sequence `peek` returned, admitted."""
        seq = heapq.heappop(self._heap)[3]
        self._count(seq, -1)
        return seq

    def discard(self, seq: Sequence) -> None:
        """A waiting sequence that finished (its heap entry goes when it reaches the top)."""
        self._count(seq, -1)
