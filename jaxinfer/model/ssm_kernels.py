"""The kernel table's slots for the fixed-state layers: Mamba-2's (KernelTable.mamba2: the
causal conv1d and the SSD scan) and Gated DeltaNet's (KernelTable.gdn: the causal conv1d and
the gated delta rule), over a ragged batch, as the Triton-lowered Pallas kernels
(pallas_kernels/ssm: GPU) or their jnp references (elsewhere), one call shape for both.

Every call takes a state pool and the batch of pallas_kernels/ssm/batch.py (cu_seqlens, slots,
has_initial_state) and returns (output, the pool with each live sequence's final state); a
step of one token per sequence (`decode`) takes the one-token forms.

`StateHeads` is where a layer's state-space heads live: all on this device here; under tensor
parallelism (parallel/state_heads.py) split over the devices, each keeping its heads' states in
its head shard of the cache pages.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from pallas_kernels.ssm import reference


@dataclasses.dataclass(frozen=True)
class StateHeads:
    """A fixed-state layer's per-device step (its states read from the cache, the conv and the
    scan, its states written back) over every head, on this device. `run(step, args, axes,
    out_axes)` calls step(self, *args); axes (per argument, as out_axes per output) name the axis
    its heads or channels lie along (None: not split), which ShardedStateHeads splits over tp."""

    @property
    def count(self) -> int:
        """The devices the heads are split over."""
        return 1

    def index(self):
        """This device's place among them (its heads: the index-th of `count` equal parts)."""
        return 0

    def gather(self, x, axis: int):
        """x whole, from every device's part along `axis`."""
        return x

    def own(self, x, axis: int):
        """This device's part along `axis` of x, which every device holds whole."""
        return x

    def run(self, step, args: tuple, axes: tuple, out_axes: tuple):
        del axes, out_axes
        return step(self, *args)


@dataclasses.dataclass(frozen=True)
class CausalConvKernels:
    """`pallas`: the Pallas kernels (`interpret` runs them in the interpreter: CPU tests);
    else the references (the conv's windowed sum, the scans' chunked forms)."""
    pallas: bool = False
    interpret: bool = False

    def conv(self, x, weight, bias, pool, cu_seqlens, slots, has_initial_state, *,
             decode: bool = False):
        """Causal depthwise conv + SiLU: x [T, C], weight [W, C], pool [n, W-1, C]."""
        if self.pallas:
            from pallas_kernels.ssm.conv1d import causal_conv1d, causal_conv1d_update
            if decode:
                return causal_conv1d_update(x, weight, bias, pool, slots,
                                            interpret=self.interpret)
            return causal_conv1d(x, weight, bias, pool, cu_seqlens, slots, has_initial_state,
                                 interpret=self.interpret)
        if decode:
            return reference.causal_conv1d_update_reference(x, weight, bias, pool, slots)
        return reference.causal_conv1d_reference(x, weight, bias, pool, cu_seqlens, slots,
                                                 has_initial_state)


@dataclasses.dataclass(frozen=True)
class Mamba2Kernels(CausalConvKernels):
    """The conv and Mamba-2's SSD scan."""

    def ssd(self, x, dt, a, b, c, d, pool, cu_seqlens, slots, has_initial_state, *,
            chunk_size: int, decode: bool = False):
        """The SSM: x [T, H, P], dt [T, H] (after softplus), a, d [H], b, c [T, G, N],
        pool [n, H, P, N] float32."""
        if self.pallas:
            from pallas_kernels.ssm.mamba2 import ssd_decode, ssd_prefill
            if decode:
                return ssd_decode(x, dt, a, b, c, pool, slots, d=d, interpret=self.interpret)
            # The kernel's chunk is its own tiling (the default, timed in ssm_kernels_<gpu>.json);
            # a checkpoint's mamba_chunk_size (Granite: 256) is its training kernel's, and
            # 256 x 256 float32 tiles would not fit a GPU's registers.
            return ssd_prefill(x, dt, a, b, c, pool, cu_seqlens, slots, has_initial_state, d=d,
                               interpret=self.interpret)
        if decode:
            return reference.ssd_decode_reference(x, dt, a, b, c, pool, slots, d=d)
        return reference.ssd_chunked_reference(x, dt, a, b, c, pool, cu_seqlens, slots,
                                               has_initial_state, d=d, chunk_size=chunk_size)


@dataclasses.dataclass(frozen=True)
class GatedDeltaNetKernels(CausalConvKernels):
    """The conv and Gated DeltaNet's delta rule (q and k L2-normalised inside, as HF passes
    use_qk_l2norm_in_kernel=True)."""

    def delta_rule(self, q, k, v, g, beta, pool, cu_seqlens, slots, has_initial_state, *,
                   chunk_size: int, decode: bool = False):
        """q, k [T, Hk, K], v [T, Hv, V], g (the log decay) and beta [T, Hv] float32, pool
        [n, Hv, K, V] float32 -> (o [T, Hv, V], the pool)."""
        if self.pallas:
            from pallas_kernels.ssm.gated_deltanet import gdn_decode, gdn_prefill
            if decode:
                return gdn_decode(q, k, v, g, beta, pool, slots, interpret=self.interpret)
            # The kernel's chunk is its own tiling (the default, timed in ssm_kernels_<gpu>.json),
            # as the SSD's: the chunked form is exact at any chunk.
            return gdn_prefill(q, k, v, g, beta, pool, cu_seqlens, slots, has_initial_state,
                               interpret=self.interpret)
        if decode:
            return reference.gdn_decode_reference(q, k, v, g, beta, pool, slots)
        return reference.gdn_chunked_reference(q, k, v, g, beta, pool, cu_seqlens, slots,
                                               has_initial_state, chunk_size=chunk_size)


# Kernels of the outputs' shapes and dtypes only (zeros, the pools as given): tracing a model's
# parameter shapes (transformer.param_shapes) runs every layer's step, and the references'
# chunked scans took half of a hybrid's trace (seconds for Qwen3-Next-80B). They create no
# parameters, so the tree is the same.
def _zero_conv(self, x, weight, bias, pool, *ragged, decode: bool = False):
    return jnp.zeros_like(x), pool


@dataclasses.dataclass(frozen=True)
class ShapeOnlyMamba2Kernels(Mamba2Kernels):
    conv = _zero_conv

    def ssd(self, x, dt, a, b, c, d, pool, *ragged, chunk_size: int, decode: bool = False):
        return jnp.zeros_like(x), pool


@dataclasses.dataclass(frozen=True)
class ShapeOnlyGatedDeltaNetKernels(GatedDeltaNetKernels):
    conv = _zero_conv

    def delta_rule(self, q, k, v, g, beta, pool, *ragged, chunk_size: int,
                   decode: bool = False):
        return jnp.zeros_like(v), pool
