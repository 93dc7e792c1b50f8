"""N-gram prompt lookup (no draft model): find the sequence's last n tokens earlier in its own
prompt + output and propose the tokens that followed them there (longest n first, most recent
match first). It pays off where the output copies its input: edits, rewrites, extraction."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    on_device = False

    def __init__(self, min_n: int, max_n: int):
        self.min_n = min_n
        self.max_n = max_n

    def begin_step(self) -> None:
        pass

    def plan(self, seq, max_tokens: int) -> list[int]:
        return propose_ngram(seq.token_ids, self.min_n, self.max_n, max_tokens)


def propose_ngram(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The up to k tokens that followed the latest earlier occurrence of the longest suffix of
    `tokens` of length in [min_n, max_n]; [] when no suffix occurs earlier."""
    length = len(tokens)
    if k <= 0 or length < min_n + 1:
        return []
    arr = np.asarray(tokens, np.int64)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        windows = sliding_window_view(arr[:-1], n)  # every n-gram that has a token after it
        hits = np.flatnonzero((windows == arr[-n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return arr[start:start + k].tolist()
    return []
