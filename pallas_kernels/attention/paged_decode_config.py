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
    The fp8_* knobs: how the kernel reads an fp8 cache (mgpu_fp8.py; docs/kernels/paged_decode.md,
    "FP8 KV cache"): K straight from the ring into fp8 QK^T wgmmas against q split into two e4m3
    tiles, V widened to float16.
    fp8_widen_layout: the register layout the fp8 tiles are widened through (`mgpu_fp8.widen`).
    fp8_shared_scratch: the plain consumer's fp32 hand-over tile overlays the two V staging tiles
      (warpgroup 1 hands over once warpgroup 0's last P @ V of the item is done, and widens again
      once the merge has read it), so more ring slots fit (paged_decode_smem.py).
    fp8_pv_tokens: V widened and P @ V run in chunks of this many tokens (a multiple of 64
      dividing the step) through staging tiles of that size; None: the whole step.
    fp8_tokens_per_step: tokens_per_step on an fp8 cache; None: tokens_per_step.
    fp8_q_split: QK^T as two fp8 wgmmas against q_hi and q_lo (q to ~8 mantissa bits, bf16's);
      False: one, against q_hi alone (q rounded to e4m3: half the QK^T tensor work, 3 bits).
    profile_dir: write each call's per-warpgroup timeline (Mosaic GPU's profiler, a Perfetto JSON)
      here; see jaxinfer/bench/profile/profile_decode.py."""
    tokens_per_step: int = 64
    stages: int | None = None
    num_ctas: int | None = None
    split_workers: int | None = None
    num_splits: int | None = None
    bt_lookahead: int = 2
    pdl: bool = True
    combine_kernel: bool = True
    fp8_widen_layout: str = "WGMMA_8BIT"
    # 128-token fp8 steps, V in 64-token chunks, shared staging: 181 us at B64 x 4096 on the H200
    # (64.6 % of the read ceiling) against 228 us for 64-token steps (quant_kv_h200.json).
    fp8_shared_scratch: bool = True
    fp8_pv_tokens: int | None = 64
    fp8_tokens_per_step: int | None = 128
    fp8_q_split: bool = True
    profile_dir: str = ""

    def __post_init__(self):
        for name in ("tokens_per_step", "fp8_tokens_per_step"):
            value = getattr(self, name)
            if value is not None and (value <= 0 or value % 64):
                raise ValueError(f"{name}={value} must be a positive multiple of 64")
        if self.stages is not None and (self.stages < 2 or self.stages % 2):
            raise ValueError(f"stages={self.stages} must be even and >= 2 (None: as many as fit)")
        for name in ("num_ctas", "split_workers", "num_splits"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name}={value} must be positive (or None)")
        fp8_step = self.fp8_tokens_per_step or self.tokens_per_step
        if self.fp8_pv_tokens is not None and (self.fp8_pv_tokens <= 0 or self.fp8_pv_tokens % 64
                                               or fp8_step % self.fp8_pv_tokens):
            raise ValueError(f"fp8_pv_tokens={self.fp8_pv_tokens} must be a positive multiple of "
                             f"64 dividing the fp8 step ({fp8_step} tokens)")
        if self.bt_lookahead < 0:
            raise ValueError(f"bt_lookahead={self.bt_lookahead} must be >= 0")
