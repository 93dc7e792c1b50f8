"""What a step reads from its final hidden states besides the next-token logits: prompt logprobs
(prompt_logprobs.py) and pooled embeddings.

An embedding request (`SamplingParams.pooling`: "last", "mean" or "cls") runs as a prompt-only
request: its prefill steps run the forward variant that returns the final-normed hidden states,
and `pool` reduces them to one float32 vector per request on the device. Every pooling method is a
weighted sum over one contiguous run of the step's rows (last: the last prompt token's row, cls:
the first's, weight 1; mean: the chunk's rows, weight 1/L), so the host describes each request by
a segment (first row, row count, weight), not per token, and the device sums all segments at once
as one [segments, T] 0/1 matrix times the hidden states (f32 accumulation). A prompt prefilled in
several chunks adds its chunks' sums up on the host (`record`). Such a request takes no
prefix-cache hit (every position is computed) and ends after its prefill (max_tokens 1): its KV
blocks go back then. A recomputation after preemption starts again at position 0, which resets
the sum.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.worker.buckets import pow2_rows
from jaxinfer.worker.prompt_logprobs import PromptLogprobRows, gather_rows, prompt_logprobs_fn
from jaxinfer.worker.prompt_logprobs import record as record_prompt_logprobs

MIN_SEGMENTS = 4


@dataclasses.dataclass
class PoolingRows:
    """One segment per embedding request of the step (host data), padded with empty segments."""
    start: np.ndarray   # i32[P]: the segment's first row in the step's flat token array
    count: np.ndarray   # i32[P]: its rows (0: this chunk holds none of them; padding)
    weight: np.ndarray  # f32[P]: each row's weight in the request's sum
    owners: list[tuple[object, bool]]  # (request, this step starts at its position 0)


def gather_pooling_rows(rows) -> PoolingRows | None:
    """From a step's scheduled sequences in flat token order, the segments embedding requests pool."""
    segments: list[tuple[int, int, float]] = []
    owners: list[tuple[object, bool]] = []
    offset = 0
    for entry in rows:
        req = entry.seq.request
        method = req.params.pooling
        if method is not None:
            n = req.num_prompt_tokens
            end = min(entry.start + entry.num_tokens, n)
            if method == "mean":
                segments.append((offset, max(end - entry.start, 0), 1.0 / n))
            else:
                target = n - 1 if method == "last" else 0
                hit = entry.start <= target < end
                segments.append((offset + target - entry.start if hit else offset, int(hit), 1.0))
            owners.append((req, entry.start == 0))
        offset += entry.num_tokens
    if not owners:
        return None
    size = pow2_rows(len(owners), MIN_SEGMENTS)
    start = np.zeros(size, np.int32)
    count = np.zeros(size, np.int32)
    weight = np.zeros(size, np.float32)
    start[:len(segments)], count[:len(segments)], weight[:len(segments)] = zip(*segments)
    return PoolingRows(start, count, weight, owners)


def pool(hidden: jax.Array, start: jax.Array, count: jax.Array, weight: jax.Array) -> jax.Array:
    """hidden [T, H] -> f32[P, H]: segment p's rows start[p] .. start[p] + count[p], summed and
    times weight[p]."""
    t = jnp.arange(hidden.shape[0], dtype=jnp.int32)
    member = (t >= start[:, None]) & (t < (start + count)[:, None])  # [P, T]
    sums = jnp.dot(member.astype(hidden.dtype), hidden, preferred_element_type=jnp.float32)
    return sums * weight[:, None]


_pool_fn = jax.jit(pool)


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
        out["pooled"] = _pool_fn(hidden, p.start, p.count, p.weight)
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
