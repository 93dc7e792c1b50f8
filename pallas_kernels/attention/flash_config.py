"""The flash prefill kernel's static tuning knobs (`KernelConfig`), their validation and its fixed
geometry; `flash_mgpu` builds the kernel from them. `KernelConfig()` is the production kernel."""

from __future__ import annotations

import dataclasses

BLOCK_Q = 64          # query rows per consumer warpgroup (wgmma M = 64)
TILE_Q = 2 * BLOCK_Q  # query rows per CTA (two consumer warpgroups)
REGISTER_FILE = 65536    # 32-bit registers per SM (one CTA of 3 warpgroups fills it)
PROFILE_EVENTS = 256     # profiler events per warpgroup when profiling (16 bytes of SMEM each)
Q_BUFFERS = 2            # Q/O buffers per consumer: a persistent consumer prefetches its next Q


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Static tuning knobs; every distinct value compiles its own kernel. The defaults are the
    production configuration (the H200 sweeps of benchmarks/RESULTS.md, "Flash prefill attention",
    the same for dense and paged K/V).

    The kernel is always persistent (one CTA per SM looping over work items, each consumer
    prefetching its next item's Q into a second Q/O buffer) and always rescales lazily, taking each
    step's exp2s against the kept (stale) row max and checking their row sums
    (`softmax_mgpu.redo_where_sums_overflow`; interpret mode runs the plain online softmax).

    block_kv: keys per pipeline step (a multiple of 64; paged K/V also needs block_size | block_kv).
    stages: depth of the K/V shared-memory ring.
    num_ctas: the persistent grid's size instead of one CTA per SM (tests use a few, so every CTA
      runs several items and the K/V ring and barrier phases carry across them).
    consumer_registers / producer_registers: setmaxnreg split (per thread).
    rescale_threshold: FA4's lazy rescaling: keep the stale max until a row's max grows by more
      than this (log2 units, so p <= 2^t) and skip the accumulator multiply in every thread whose
      rows kept theirs. Exact after the final 1/l, since acc and l always refer to the same max.
      A warp whose row sums pass softmax_mgpu.STALE_SUM_BOUND (or inf / NaN) redoes its step with
      the true max.
    profile_dir: write each call's per-warpgroup timeline of the named ranges (qk, softmax,
      wait_v_turn, pv; producer: wait_free) here with Mosaic GPU's profiler (GPU only;
      jaxinfer/bench/profile/profile_prefill.py)."""
    block_kv: int = 128
    stages: int = 2
    num_ctas: int | None = None
    consumer_registers: int = 240
    producer_registers: int = 24
    rescale_threshold: float = 8.0
    profile_dir: str = ""

    def __post_init__(self):
        if self.block_kv <= 0 or self.block_kv % 64:  # PV's K dimension fills 128-byte swizzle rows
            raise ValueError(f"block_kv={self.block_kv} must be a positive multiple of 64")
        if self.stages < 2:
            raise ValueError(f"stages={self.stages} must be at least 2")
        if not 0 < self.rescale_threshold <= 64:  # the stale-max step keeps a stale max
            raise ValueError(f"rescale_threshold={self.rescale_threshold} must lie in (0, 64]")
        if self.num_ctas is not None and self.num_ctas < 1:
            raise ValueError(f"num_ctas={self.num_ctas} must be a positive grid size")
        if 128 * (2 * self.consumer_registers + self.producer_registers) > REGISTER_FILE:
            raise ValueError(f"consumer_registers={self.consumer_registers} / producer_registers="
                             f"{self.producer_registers} overflow the {REGISTER_FILE}-register file")

    def smem_bytes(self, d: int, itemsize: int, kv_itemsize: int | None = None) -> int:
        """Shared memory of the kernel at head_dim d: Q/O buffers of `itemsize`, the K/V ring of
        `kv_itemsize` (default: the same), and with a narrower cache (fp8) one staging tile of
        `itemsize` per consumer (`mgpu_fp8.wgmma_tile`)."""
        kv_itemsize = kv_itemsize or itemsize
        profile = 3 * PROFILE_EVENTS * 16 if self.profile_dir else 0
        staging = 2 * self.block_kv * d * itemsize if kv_itemsize != itemsize else 0
        return ((Q_BUFFERS * TILE_Q * itemsize + 2 * self.stages * self.block_kv * kv_itemsize) * d
                + staging + profile)
