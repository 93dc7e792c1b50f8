"""Paged decode attention kernels: one query token per sequence against its paged KV cache.

Both have the attention backend's `decode` signature (see `backend.py`):

    decode(q[S, Hq, D], k_cache, v_cache, block_tables[S, M], seq_lens[S], *, scale, softcap,
           window, sinks) -> [S, Hq, D]

- `paged_decode_mosaic` (`paged_decode_mosaic.py`): Mosaic GPU for Hopper — persistent CTAs,
  block-table-driven TMA page loads, a warp-specialised multi-stage pipeline, wgmma.
- `paged_decode_triton` (`paged_decode_triton.py`): Triton-lowered `pallas_call`, the portable
  path for other CUDA GPUs.

Shared pieces (input checks, the flash-decoding split plan, the combine of partial results) are in
`paged_decode_common.py`; the oracle is `reference.paged_decode_reference`.
"""

from pallas_kernels.attention.paged_decode_mosaic import MosaicDecodeConfig, paged_decode_mosaic
from pallas_kernels.attention.paged_decode_triton import (paged_decode_triton,
                                                          paged_decode_triton_configured)

__all__ = ["MosaicDecodeConfig", "paged_decode_mosaic",
           "paged_decode_triton", "paged_decode_triton_configured"]
