"""GPU attention backends: each pairs a decode kernel with a prefill kernel.

`mosaic` (Hopper: TMA + wgmma through Mosaic GPU; with MLA's latent decode kernel) and `triton`
(Triton-lowered `pallas_call`, the portable path for other CUDA GPUs; MLA decodes with the jnp
latent reference there). Imported only when selected, so a CPU machine never compiles them.
"""

from pallas_kernels.attention.backend import AttentionBackend
from pallas_kernels.attention.flash_prefill import flash_prefill_mosaic, flash_prefill_triton
from pallas_kernels.attention.latent_decode_mosaic import MosaicLatentDecode
from pallas_kernels.attention.paged_decode import paged_decode_mosaic, paged_decode_triton
from pallas_kernels.norm.rms_norm import add_rms_norm_triton

MOSAIC = AttentionBackend("mosaic", decode=paged_decode_mosaic, prefill=flash_prefill_mosaic,
                          split_mixed_steps=True, add_rms_norm=add_rms_norm_triton,
                          latent_decode=MosaicLatentDecode)
TRITON = AttentionBackend("triton", decode=paged_decode_triton, prefill=flash_prefill_triton,
                          split_mixed_steps=True, add_rms_norm=add_rms_norm_triton)
