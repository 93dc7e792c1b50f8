"""GPU attention backends: each pairs a decode kernel with a prefill kernel.

`mosaic` (Hopper: TMA + wgmma through Mosaic GPU) and `triton` (Triton-lowered `pallas_call`, the
portable path for other CUDA GPUs). Imported only when selected, so a CPU machine never compiles
them. The other kernels of a GPU engine (the add + norm, MLA's latent decode) are the kernel
table's slots (jaxinfer/model/kernel_table.py).
"""

from pallas_kernels.attention.backend import AttentionBackend
from pallas_kernels.attention.flash_prefill import flash_prefill_mosaic, flash_prefill_triton
from pallas_kernels.attention.paged_decode import paged_decode_mosaic, paged_decode_triton

MOSAIC = AttentionBackend("mosaic", decode=paged_decode_mosaic, prefill=flash_prefill_mosaic,
                          split_mixed_steps=True)
TRITON = AttentionBackend("triton", decode=paged_decode_triton, prefill=flash_prefill_triton,
                          split_mixed_steps=True)
