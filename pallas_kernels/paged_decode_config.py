"""The Mosaic GPU paged-decode kernel's static tuning knobs (`MosaicDecodeConfig`);
`paged_decode_mosaic` builds the kernel from them. `MosaicDecodeConfig()` is the production kernel."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class MosaicDecodeConfig:
    """Static tuning knobs; every distinct value compiles its own kernel. The defaults are the
    production configuration (the H200 decode grid of benchmarks/RESULTS.md).

    tokens_per_step: K/V tokens per pipeline slot, a positive multiple of 64 (wgmma N tiling).
    stages: slots in the ring, even and >= 2 (see the module docstring); None: as many as fit in
      shared memory.
    num_ctas: persistent CTAs; None: one per SM.
    split_workers: workers the split plan balances over; None: num_ctas.
    num_splits: force this many context splits (benchmarks, tests); None: planned.
    bt_lookahead: the producer reads block ids this many steps ahead (0: just in time).
    pdl: programmatic dependent launch: the kernel's launch and set-up overlap the previous
      kernel's tail; nothing is read from memory before `griddepcontrol.wait`; with splits, the
      combine kernel's launch overlaps this one.
    combine_kernel: merge splits with split_combine_mosaic; False: the same merge in XLA (three
      kernels), the combine kernel's oracle in tests.
    fp8_widen_ahead: with an fp8 cache, each consumer widens V during its QK^T wgmma and its next
      K during its P V wgmma (two staging tiles); False: each tile just before its wgmma (one
      staging tile, two more ring slots; 4% faster at batch 64 x 4096 on the H200). See
      mgpu_fp8.py.
    fp8_qk: with an fp8 cache, QK^T reads the fp8 K pages straight from the ring with fp8 wgmmas
      (no K widening): q goes in as two e4m3 tiles, q_hi + q_lo = q * c (c a power of two per
      item, so q keeps about 8 mantissa bits), and the consumer widens V while they run. See
      mgpu_fp8.py.
    fp8_widener: with fp8_qk, a fourth warpgroup widens every V tile into the owning consumer's
      staging tile, so the consumers never widen.
    fp8_widener_tiles: staging tiles per consumer with fp8_widener (the widener runs that many
      of a consumer's steps ahead).
    fp8_swap: with fp8_qk, the transposed consumer (paged_decode_swap.py: KV tokens on wgmma's M
      side, the G query heads on N) for one-split plans.
    fp8_v_producer: with an fp8 cache, a second producer warpgroup issues V's page copies (the
      first issues q's and K's): an fp8 step is half the bytes of a 16-bit one in as many copies.
    fp8_widen_layout: the register layout the fp8 tiles are widened through (`mgpu_fp8.widen`).
    profile_dir: write each call's per-warpgroup timeline (Mosaic GPU's profiler, a Perfetto JSON)
      here; see benchmarks/profile_decode.py."""
    tokens_per_step: int = 64
    stages: int | None = None
    num_ctas: int | None = None
    split_workers: int | None = None
    num_splits: int | None = None
    bt_lookahead: int = 2
    pdl: bool = True
    combine_kernel: bool = True
    fp8_widen_ahead: bool = False
    fp8_qk: bool = False
    fp8_widener: bool = False
    fp8_widener_tiles: int = 1
    fp8_swap: bool = False
    fp8_v_producer: bool = False
    fp8_widen_layout: str = "WGMMA_8BIT"
    profile_dir: str = ""

    def __post_init__(self):
        if self.tokens_per_step <= 0 or self.tokens_per_step % 64:
            raise ValueError(f"tokens_per_step={self.tokens_per_step} must be a positive multiple "
                             f"of 64")
        if self.stages is not None and (self.stages < 2 or self.stages % 2):
            raise ValueError(f"stages={self.stages} must be even and >= 2 (None: as many as fit)")
        for name in ("num_ctas", "split_workers", "num_splits"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name}={value} must be positive (or None)")
        if self.fp8_qk and self.fp8_widen_ahead:
            raise ValueError("fp8_qk and fp8_widen_ahead are exclusive (fp8_qk widens only V, "
                             "during QK^T)")
        if (self.fp8_widener or self.fp8_swap) and not self.fp8_qk:
            raise ValueError("fp8_widener and fp8_swap need fp8_qk")
        if self.fp8_widener and self.fp8_v_producer:
            raise ValueError("fp8_widener and fp8_v_producer both take the fourth warpgroup")
        if self.fp8_widener_tiles < 1:
            raise ValueError(f"fp8_widener_tiles={self.fp8_widener_tiles} must be >= 1")
        if self.bt_lookahead < 0:
            raise ValueError(f"bt_lookahead={self.bt_lookahead} must be >= 0")
