"""Facts about the GPU the kernels size their grids for."""

from __future__ import annotations

import jax

SMEM_LIMIT = 227 * 1024  # Hopper's largest dynamic shared memory per CTA


def num_sms() -> int:
    """Streaming multiprocessors of the default device (132 on an H100/H200): one persistent CTA
    each. 132 when tracing elsewhere (CPU tests, lowering for CUDA on a CPU machine)."""
    dev = jax.devices()[0]
    return int(getattr(dev, "core_count", 0) or 132) if dev.platform == "gpu" else 132
