"""Compile buckets: the few padded shapes every step is rounded up to, so the number of compilations
is fixed at start-up (and tested) instead of growing with the workload.

- pure-decode steps: S sequences of one token, S in `decode_buckets` (T == S, all decode attention):
  powers of two from `min_seqs`, and with `lone_sequence` 1 before them (batch-1 latency: padding
  rows cost a lone sequence the decode kernel's one-sequence split plan and a scatter for its cache
  write; worth it where its projections are fused, since at one row XLA turns the narrow k/v
  matmuls into a multiply and a reduce: benchmarks/RESULTS.md);
- mixed steps (any prefill chunk): T tokens in `token_buckets`, with S = min(T, max_num_seqs)
  sequence rows (a step never has more sequences than tokens). The decode count is a static part of
  the attention metadata, so backends that split a mixed step (the GPU kernels: decodes to the
  decode kernel, the rest to ragged prefill) compile per count seen; the reference backend sends
  every row through the ragged path;
- copy-on-write block copies: padded to `copy_buckets`.
"""

from __future__ import annotations

import bisect
import dataclasses


def _powers_of_two(lo: int, hi: int, factor: int = 2) -> list[int]:
    out, b = [], lo
    while b < hi:
        out.append(b)
        b *= factor
    out.append(hi)
    return out


def pow2_rows(n: int, least: int) -> int:
    """The padded size of a per-step array of n rows (prompt-logprob rows, pooled segments): a
    power of two from `least`, so a few shapes compile."""
    return max(least, 1 << (max(n, 1) - 1).bit_length())


@dataclasses.dataclass(frozen=True)
class Buckets:
    token_buckets: tuple[int, ...]
    decode_buckets: tuple[int, ...]
    copy_buckets: tuple[int, ...]
    max_num_seqs: int

    @classmethod
    def make(cls, max_num_seqs: int, max_num_batched_tokens: int, min_tokens: int = 16,
             min_seqs: int = 8, lone_sequence: bool = False) -> "Buckets":
        if max_num_batched_tokens < max_num_seqs:
            raise ValueError(f"--max-num-batched-tokens ({max_num_batched_tokens}) must be >= "
                             f"--max-num-seqs ({max_num_seqs})")
        tokens = _powers_of_two(min(min_tokens, max_num_batched_tokens), max_num_batched_tokens)
        seqs = _powers_of_two(min(min_seqs, max_num_seqs), max_num_seqs)
        if lone_sequence and seqs[0] > 1:
            seqs = [1, *seqs]
        copies = _powers_of_two(min(min_seqs, max_num_seqs), max_num_seqs, factor=4)
        return cls(tuple(tokens), tuple(seqs), tuple(copies), max_num_seqs)

    @staticmethod
    def _fit(buckets: tuple[int, ...], n: int, what: str) -> int:
        i = bisect.bisect_left(buckets, n)
        if i == len(buckets):
            raise ValueError(f"{what}={n} exceeds the largest bucket {buckets[-1]}")
        return buckets[i]

    def decode_shape(self, num_seqs: int) -> int:
        return self._fit(self.decode_buckets, num_seqs, "decode sequences")

    def mixed_shape(self, num_tokens: int) -> tuple[int, int]:
        t = self._fit(self.token_buckets, num_tokens, "step tokens")
        return t, min(t, self.max_num_seqs)

    def copy_shape(self, num_copies: int) -> int:
        return self._fit(self.copy_buckets, num_copies, "block copies")


def step_shape(buckets: Buckets, num_tokens: int, num_rows: int, pure_decode: bool,
               ready: set[tuple[int, int, int]] | None) -> tuple[int, int, int]:
    """(tokens, rows, decode rows) of the executable a step runs in: its own bucket when `ready` is
    None (no background compile) or holds it, else the smallest ready bucket that fits (a decode
    bucket before a mixed one); its own bucket when none fits (the step then compiles it)."""
    if pure_decode:
        own = (buckets.decode_shape(num_rows),) * 3
    else:
        t, s = buckets.mixed_shape(num_tokens)
        own = (t, s, 0)
    if ready is None or own in ready:
        return own
    if pure_decode:
        for s in buckets.decode_buckets:
            if s >= num_rows and (s, s, s) in ready:
                return s, s, s
    for t in buckets.token_buckets:
        shape = (t, *buckets.mixed_shape(t)[1:], 0)
        if t >= num_tokens and shape[1] >= num_rows and shape in ready:
            return shape
    return own
