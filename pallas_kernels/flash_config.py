"""The flash prefill kernel's static tuning knobs (`KernelConfig`), their validation and its fixed
geometry; `flash_mgpu` builds the kernel from them and `flash_prefill.DEFAULT_CONFIG` holds the
measured default."""

from __future__ import annotations

import dataclasses

BLOCK_Q = 64          # query rows per consumer warpgroup (wgmma M = 64)
TILE_Q = 2 * BLOCK_Q  # query rows per CTA (two consumer warpgroups)
SMEM_LIMIT = 227 * 1024  # Hopper's largest dynamic shared memory per CTA
REGISTER_FILE = 65536    # 32-bit registers per SM (one CTA of 3 warpgroups fills it)
PROFILE_EVENTS = 256     # profiler events per warpgroup when profiling (16 bytes of SMEM each)


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Static tuning knobs; every distinct value compiles its own kernel.

    block_kv: keys per pipeline step (a multiple of 64; paged K/V also needs block_size | block_kv).
    stages: depth of the K/V shared-memory ring.
    persistent: one CTA per SM looping over work items (else one CTA per item).
    num_ctas: the persistent grid's size instead of one CTA per SM (tests use a few, so every CTA
      runs several items and the K/V ring and barrier phases carry across them).
    q_buffers: 2 = double-buffered Q/O so a persistent consumer prefetches its next item's Q.
    consumer_registers / producer_registers: setmaxnreg split (per thread).
    rescale_threshold: 0 = rescale the accumulator whenever a row max grows (FA2/FA3); t > 0 =
      FA4's lazy rescaling: keep the stale max until a row's max grows by more than t (log2 units,
      so p <= 2^t) and skip the accumulator multiply in every thread whose rows kept theirs. Exact
      after the final 1/l, since acc and l always refer to the same max.
    stale_max_exp: (needs rescale_threshold > 0) skip the row max: take the step's exp2s against
      the kept (stale) max and check their row sums instead; a warp with a row sum past
      softmax_mgpu.STALE_SUM_BOUND (or inf / NaN: the first step) redoes the step with the true
      max (`softmax_mgpu.redo_where_sums_overflow`). GPU only (inline_mgpu); interpret mode runs
      the plain path.
    profile_dir: write each call's per-warpgroup timeline of the named ranges (qk, softmax,
      wait_v_turn, pv; producer: wait_free) here with Mosaic GPU's profiler (GPU only;
      benchmarks/profile_prefill.py)."""
    block_kv: int = 128
    stages: int = 2
    persistent: bool = False
    num_ctas: int | None = None
    q_buffers: int = 1
    consumer_registers: int = 240
    producer_registers: int = 24
    rescale_threshold: float = 0.0
    stale_max_exp: bool = False
    profile_dir: str = ""

    def __post_init__(self):
        if self.block_kv <= 0 or self.block_kv % 64:  # PV's K dimension fills 128-byte swizzle rows
            raise ValueError(f"block_kv={self.block_kv} must be a positive multiple of 64")
        if self.stages < 2:
            raise ValueError(f"stages={self.stages} must be at least 2")
        if not 0 <= self.rescale_threshold <= 64:
            raise ValueError(f"rescale_threshold={self.rescale_threshold} must lie in [0, 64]")
        if self.stale_max_exp and not self.rescale_threshold:
            raise ValueError("stale_max_exp needs rescale_threshold > 0 (it keeps a stale max)")
        if self.num_ctas is not None and (self.num_ctas < 1 or not self.persistent):
            raise ValueError(f"num_ctas={self.num_ctas}: a positive grid size, with persistent=True")
        if self.q_buffers not in (1, 2) or (self.q_buffers == 2 and not self.persistent):
            raise ValueError(f"q_buffers={self.q_buffers}: 1, or 2 with persistent=True")
        if 128 * (2 * self.consumer_registers + self.producer_registers) > REGISTER_FILE:
            raise ValueError(f"consumer_registers={self.consumer_registers} / producer_registers="
                             f"{self.producer_registers} overflow the {REGISTER_FILE}-register file")

    def smem_bytes(self, d: int, itemsize: int) -> int:
        profile = 3 * PROFILE_EVENTS * 16 if self.profile_dir else 0
        return (self.q_buffers * TILE_Q + 2 * self.stages * self.block_kv) * d * itemsize + profile
