"""What a step reads from its final hidden states besides the next-token logits: prompt logprobs
(prompt_logprobs.py) and pooled embeddings.

An embedding request (`SamplingParams.pooling`: "last", "mean" or "cls") runs as a prompt-only
request: its prefill steps run the forward variant that returns the final-normed hidden states,
and `pool` reduces the request's rows of each step to one float32 vector per request on the
device: every pooling method is a weighted sum of rows (last: the last prompt token's row, weight
1; cls: the first's; mean: each row 1/L), so a prompt prefilled in several chunks adds its
chunks' sums up on the host (`record`). Such a request takes no prefix-cache hit (every position
is computed) and ends after its prefill (max_tokens 1): its KV blocks go back then. A recomputation
after preemption starts again at position 0, which resets the sum.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.worker.prompt_logprobs import PromptLogprobRows, gather_rows, prompt_logprobs_fn
from jaxinfer.worker.prompt_logprobs import record as record_prompt_logprobs

MIN_ROWS, MIN_SEGMENTS = 16, 4


@dataclasses.dataclass
class PoolingRows:
    """The rows of one step that embedding requests pool (host data)."""
    token_index: np.ndarray  # i32[P]: row in the step's flat token array; padding 0
    weights: np.ndarray      # f32[P]: the row's weight in its request's sum; padding 0
    segment: np.ndarray      # i32[P]: which owner the row adds to
    owners: list[tuple[object, bool]]  # (request, this step starts at its position 0)


def _pow2(n: int, least: int) -> int:
    return max(least, 1 << (max(n, 1) - 1).bit_length())


def gather_pooling_rows(rows) -> PoolingRows | None:
    """From a step's scheduled sequences in flat token order, the rows embedding requests pool."""
    index: list[int] = []
    weights: list[float] = []
    segment: list[int] = []
    owners: list[tuple[object, bool]] = []
    offset = 0
    for entry in rows:
        req = entry.seq.request
        method = req.params.pooling
        if method is not None:
            n = req.num_prompt_tokens
            end = min(entry.start + entry.num_tokens, n)
            if method == "mean":
                positions, w = range(entry.start, end), 1.0 / n
            else:
                target = n - 1 if method == "last" else 0
                positions, w = [target] if entry.start <= target < end else [], 1.0
            for j in positions:
                index.append(offset + j - entry.start)
                weights.append(w)
                segment.append(len(owners))
            owners.append((req, entry.start == 0))
        offset += entry.num_tokens
    if not owners:
        return None
    size = _pow2(len(index), MIN_ROWS)

    def pad(values, dtype):
        out = np.zeros(size, dtype)
        out[:len(values)] = values
        return out
    return PoolingRows(pad(index, np.int32), pad(weights, np.float32), pad(segment, np.int32), owners)


def pool(hidden: jax.Array, token_index: jax.Array, weights: jax.Array, segment: jax.Array, *,
         num_segments: int) -> jax.Array:
    """hidden [T, H] -> f32[num_segments, H]: each segment's weighted sum of its rows."""
    rows = hidden[token_index].astype(jnp.float32) * weights[:, None]
    return jax.ops.segment_sum(rows, segment, num_segments=num_segments)


_pool_fn = jax.jit(pool, static_argnames=("num_segments",))


@dataclasses.dataclass
class HiddenReads:
    prompt: PromptLogprobRows | None
    pooling: PoolingRows | None


def gather_hidden_reads(rows) -> HiddenReads | None:
    reads = HiddenReads(gather_rows(rows), gather_pooling_rows(rows))
    return reads if reads.prompt is not None or reads.pooling is not None else None


def read_hidden(params, cfg, hidden: jax.Array, reads: HiddenReads) -> dict:
    """Dispatch the step's reads of `hidden` (device arrays, fetched with the step's tokens)."""
    out = {}
    if reads.prompt is not None:
        out["prompt"] = prompt_logprobs_fn(cfg)(params, hidden, reads.prompt.token_index,
                                                reads.prompt.targets)
    if reads.pooling is not None:
        p = reads.pooling
        out["pooled"] = _pool_fn(hidden, p.token_index, p.weights, p.segment,
                                 num_segments=_pow2(len(p.owners), MIN_SEGMENTS))
    return out


def record(reads: HiddenReads, out: dict) -> None:
    """Write a finished step's reads into their requests (prompt logprobs, pooled sums)."""
    if reads.prompt is not None:
        record_prompt_logprobs(reads.prompt, out["prompt"])
    if reads.pooling is not None:
        pooled = np.asarray(out["pooled"])
        for s, (req, from_start) in enumerate(reads.pooling.owners):
            if from_start or req.pooled is None:
                req.pooled = pooled[s].copy()
            else:
                req.pooled += pooled[s]
