"""A choice's sampled-token logprobs, kept as flat lists, and the read-only views outputs hand out.

The engine appends one entry per sampled token on the host, inside the step loop: a per-token
object (a TokenLogprob, plus its list of alternatives) there cost about as much host time per
step as the rest of a decode row's processing, and left the garbage collector ever more objects
to walk. So a sequence keeps plain lists: the token ids, their logprobs and, when the request
asked for K > 0 alternatives, K ids and K logprobs per token, row-major. Floats and ints are not
tracked by the collector, and an append is one list append per column.

`CompletionOutput.logprobs` / `new_logprobs` are `LogprobsView`s over these lists: sequences of
TokenLogprob built on access, so callers index and iterate as before, while `to_rollout_batch`
reads the lists themselves. A view fixes its range when made and the lists only grow, so an output
does not change as the request goes on (as the copied lists it replaces did not).
"""

from __future__ import annotations

import collections.abc

import numpy as np

from jaxinfer.core.outputs import TokenLogprob


class SampledLogprobs:
    """One choice's logprobs so far: entry i is its i-th output token's."""

    __slots__ = ("k", "token_ids", "logprobs", "top_ids", "top_logprobs")

    def __init__(self, k: int):
        self.k = k  # alternatives per token (SamplingParams.logprobs)
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.top_ids: list[int] = []         # k per token, best first
        self.top_logprobs: list[float] = []  # ... and their logprobs

    def __len__(self) -> int:
        return len(self.logprobs)

    def append(self, token_id: int, logprob: float, top_ids: list[int] | None = None,
               top_logprobs: list[float] | None = None) -> None:
        """One token's entry; `top_ids` / `top_logprobs`: its k alternatives when k > 0."""
        self.token_ids.append(token_id)
        self.logprobs.append(logprob)
        if self.k:
            self.top_ids.extend(top_ids)
            self.top_logprobs.extend(top_logprobs)

    def view(self, start: int = 0, stop: int | None = None) -> LogprobsView:
        return LogprobsView(self, start, len(self.logprobs) if stop is None else stop)


class LogprobsView(collections.abc.Sequence):
    """Entries [start, stop) of a SampledLogprobs as a sequence of TokenLogprob (made on access;
    rank is None: it is reported for prompt logprobs only)."""

    __slots__ = ("_store", "_start", "_stop")

    def __init__(self, store: SampledLogprobs, start: int, stop: int):
        self._store, self._start, self._stop = store, start, stop

    def __len__(self) -> int:
        return self._stop - self._start

    def _entry(self, i: int) -> TokenLogprob:
        s, k = self._store, self._store.k
        return TokenLogprob(s.token_ids[i], s.logprobs[i],
                            list(zip(s.top_ids[i * k:(i + 1) * k], s.top_logprobs[i * k:(i + 1) * k])))

    def __getitem__(self, index):
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step == 1:
                return LogprobsView(self._store, self._start + start, self._start + max(stop, start))
            return [self[i] for i in range(start, stop, step)]
        n = len(self)
        if not -n <= index < n:
            raise IndexError("logprobs index out of range")
        return self._entry(self._start + (index % n))

    def __iter__(self):
        return map(self._entry, range(self._start, self._stop))

    def followed_by(self, other) -> LogprobsView | None:
        """This view and `other`, the entries right after it in the same store, as one view; None
        for anything else."""
        if isinstance(other, LogprobsView) and other._store is self._store \
                and other._start == self._stop:
            return LogprobsView(self._store, self._start, other._stop)
        return None

    def __eq__(self, other) -> bool:
        if isinstance(other, (LogprobsView, list, tuple)):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    __hash__ = None  # mutable-looking like the list it stands for

    def __repr__(self) -> str:
        return f"LogprobsView({list(self)!r})"

    # -- flat reads (to_rollout_batch): no per-token objects -------------------------------------
    @property
    def k(self) -> int:
        return self._store.k

    def values(self) -> list[float]:
        """The sampled tokens' logprobs."""
        return self._store.logprobs[self._start:self._stop]

    def top(self, top_k: int) -> tuple[np.ndarray, np.ndarray]:
        """(ids i32[len, top_k], logprobs f32[len, top_k]) of the best `top_k` alternatives; needs
        top_k <= k."""
        s, k, n = self._store, self._store.k, len(self)
        lo, hi = self._start * k, self._stop * k
        ids = np.asarray(s.top_ids[lo:hi], np.int32).reshape(n, k)[:, :top_k]
        lps = np.asarray(s.top_logprobs[lo:hi], np.float32).reshape(n, k)[:, :top_k]
        return ids, lps

