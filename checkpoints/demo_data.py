"""The demo models' training batches and held-out windows, as numpy arrays.

Training stream: each epoch the documents (stdlib files, `<|endoftext|>`-terminated) are shuffled
with (seed, epoch), concatenated and split into packed rows of seq_len + 1 tokens; attention
crosses document boundaries, as in GPT-2's training. The tail shorter than a row is dropped, so
every epoch has the same number of rows and step s's batch is a pure function of s: a resumed run
reads exactly the batches the uninterrupted one would have (no iterator state to save). Packing an
epoch is one concatenate (~20 ms for the 8.5 M-token corpus): at the 2 M tokens/s a fused GPU step
trains at, a per-example pipeline (the grain one the first models used) was the bottleneck.
"""

from __future__ import annotations

import numpy as np

ENDOFTEXT_ID = 0  # build_corpus.SPECIAL_TOKENS order


def split_documents(tokens: np.ndarray) -> list[np.ndarray]:
    ends = np.flatnonzero(tokens == ENDOFTEXT_ID) + 1
    return [d for d in np.split(tokens.astype(np.int32), ends) if d.size]


class PackedBatches:
    """batches(step, n) -> int32 [n, batch_size, seq_len + 1]: the batches of steps step..step+n-1."""

    def __init__(self, docs: list[np.ndarray], seq_len: int, batch_size: int, seed: int):
        self.docs, self.row, self.batch_size, self.seed = docs, seq_len + 1, batch_size, seed
        self.rows_per_epoch = sum(d.size for d in docs) // self.row
        if self.rows_per_epoch < 1:
            raise SystemExit(f"the training stream is shorter than one row of {self.row} tokens")
        self._epoch, self._rows = -1, None

    def epoch_rows(self, epoch: int) -> np.ndarray:
        if epoch != self._epoch:
            order = np.random.default_rng([self.seed, epoch]).permutation(len(self.docs))
            stream = np.concatenate([self.docs[i] for i in order])
            self._epoch = epoch
            self._rows = stream[:self.rows_per_epoch * self.row].reshape(-1, self.row)
        return self._rows

    def batches(self, step: int, n: int) -> np.ndarray:
        first, count = step * self.batch_size, n * self.batch_size
        out, filled = np.empty((count, self.row), np.int32), 0
        while filled < count:
            epoch, offset = divmod(first + filled, self.rows_per_epoch)
            take = min(count - filled, self.rows_per_epoch - offset)
            out[filled:filled + take] = self.epoch_rows(epoch)[offset:offset + take]
            filled += take
        return out.reshape(n, self.batch_size, self.row)

    def epochs(self, steps: int) -> float:
        return steps * self.batch_size / self.rows_per_epoch


def heldout_windows(tokens: np.ndarray, seq_len: int, max_windows: int) -> np.ndarray:
    """Non-overlapping [n, seq_len + 1] windows from the start of the held-out stream."""
    n = min((tokens.size - 1) // seq_len, max_windows)
    if n < 1:
        raise SystemExit(f"held-out stream has {tokens.size} tokens, fewer than seq_len + 1 = {seq_len + 1}")
    idx = np.arange(n)[:, None] * seq_len + np.arange(seq_len + 1)[None, :]
    return tokens.astype(np.int32)[idx]
