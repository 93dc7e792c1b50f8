"""The Mosaic paged-decode kernel's shared-memory plan: what its fixed tiles take, and how many
ring slots (`stages`) the rest holds.

A CTA (one per SM, persistent) keeps its HBM stream busy only with enough bytes in flight: at the
H200's ~4.5 TB/s over 132 SMs each SM must move ~34 KB per µs, so with ~1-2 µs from a TMA copy's
issue to its landing under load an SM needs ~34-68 KB of copies outstanding. Slots held by the
consumers (K until its QK^T wgmma ends, V until widened or read by P·V) are not in flight, so the
ring must be well past that. Per slot: 2 x tokens x D bytes of cache (K and V).

- bf16, 64 tokens: 32 KiB slots; fixed 80.75 KiB (two q tiles 32, the fp32 hand-over tile 32,
  the output tile 16, m/l rows) -> 4 slots, 128 KiB.
- fp8, 64 tokens: 16 KiB slots; fixed 112.75 KiB (+ two f16 V staging tiles, 16 KiB each) -> 6
  slots, 96 KiB. With `fp8_shared_scratch` the hand-over tile overlays the staging tiles (their
  lifetimes are disjoint: the staging tiles are idle while an item's end merges), fixed 80.75
  KiB -> 8 slots, 128 KiB.
- fp8, 128 tokens: 32 KiB slots; fixed 144.75 KiB (staging 2 x 32) -> 2 slots, one per consumer;
  shared, fixed 112.75 KiB -> still 2. `fp8_pv_tokens=64` widens V and runs P·V in 64-token
  chunks through 64-token staging tiles; with the shared tiles: fixed 80.75 KiB -> 4 slots,
  128 KiB.
"""

from __future__ import annotations

WGMMA_ROWS = 64
SMEM_BUDGET = 227 * 1024 - 4096  # 227 KiB per block, less what Mosaic adds (barriers, alignment)
PROFILE_EVENT_BYTES = 16


def fixed_bytes(*, d: int, elem_bytes: int, one_split: bool, staging_tokens: int, shared: bool,
                p_tokens: int, num_consumers: int) -> int:
    """Shared memory outside the ring: two q tiles, the fp32 hand-over tile, m/l/lse rows, the
    output tile (one split), the P tiles (`p_tokens` columns: interpret mode; 0: none) and the fp8
    V staging tiles (`staging_tokens` rows each; 0: none), which the hand-over tile overlays when
    `shared`."""
    q = 2 * WGMMA_ROWS * d * elem_bytes
    out = WGMMA_ROWS * d * elem_bytes if one_split else 0
    handover = WGMMA_ROWS * d * 4
    staging = num_consumers * staging_tokens * d * elem_bytes
    p = num_consumers * WGMMA_ROWS * p_tokens * elem_bytes
    return (q + out + 3 * WGMMA_ROWS * 4 + p
            + (max(handover, staging) if shared else handover + staging))


def ring_stages(requested: int | None, fixed: int, *, tokens: int, d: int,
                cache_bytes: int) -> int:
    """`requested` ring slots, or as many (even) as the budget holds beside `fixed` bytes; raises
    if that is fewer than two. A requested count is not checked against the budget (the device's
    real limit is a little above SMEM_BUDGET)."""
    stage_bytes = 2 * tokens * d * cache_bytes  # K and V
    fit = (SMEM_BUDGET - fixed) // stage_bytes
    stages = requested or 2 * (fit // 2)
    if stages < 2 or stages % 2:
        raise ValueError(f"stages ({stages}) must be even and >= 2 (shared memory holds {fit} "
                         f"stages of {tokens} tokens at head_dim {d})")
    return stages


def profile_space(fixed: int, stages: int, *, tokens: int, d: int, cache_bytes: int,
                  num_threads: int, most: int = 1024) -> int:
    """Profiler events per warpgroup (PROFILE_EVENT_BYTES each, `num_threads` warpgroups) that fit
    beside `fixed` bytes and `stages` ring slots, at most `most`."""
    left = SMEM_BUDGET - fixed - stages * 2 * tokens * d * cache_bytes
    return max(0, min(most, left // (num_threads * PROFILE_EVENT_BYTES)))
