"""Grouped matmul for routed experts on Hopper: warp-specialised, two consumer warpgroups.

Same contract, tile table and output ladder as `grouped_matmul_mosaic` (rows sorted by group; a
tile is a window of one group's rows starting at the 8-row boundary at or before the group's first
row; no group's m-tiles are padded to the largest group), on a producer/consumer schedule that
both the decode weight stream and the compute-bound prefill tiles run faster on (the MoE suite, H200):

  - one producer warpgroup runs a `stages`-deep TMA ring over K (x window + weight panels), the two
    consumer warpgroups only wait and issue wgmma, so loads, matmuls and the epilogue of one unit
    overlap the next unit's first loads (`plgpu.emit_pipeline_warp_specialized`);
  - the CTA tile is block_m x block_n, split between the consumers along M (`split="m"`: each
    takes block_m / 2 rows, sharing the weight panel; block_m 128) or along N (`split="n"`: each
    takes block_n / 2 columns of the same block_m rows, sharing the x window; block_m 64 keeps
    less of each window past a group's end);
  - persistent CTAs (one per SM) walk the (tile, N block) work units;
  - each consumer stages its part of the output in shared memory and TMA-stores exactly its rows
    of the tile (`store_rows`), waiting for the previous unit's stores only when it reuses the
    buffer.

The SwiGLU fusion as in the one-warpgroup kernel: two weight stacks (gate, up), each consumer holds two
float32 accumulators and writes silu(gate) * up. CPU tests run it in Mosaic GPU's interpreter and
lower it for CUDA; `jaxinfer/bench/suites/moe.py` times it on the H200.

FP8 (e4m3) weights (`scales` given: float32 [G, N] per stack, w = q * scale, the stacks
`--quantization fp8` makes) are widened after the TMA load: weight-only, x stays 16-bit. Why not
W8A8 (both wgmma operands e4m3, twice the tensor-core rate): Hopper's fp8 wgmma reads its operands
only K-major, and the expert stacks are [G, K, N] (N-major), the layout the loader, the TP sharding
of experts and the XLA paths all use; W8A8 would also quantize the activations, which the XLA paths
(and so the greedy tokens) do not. The step it speeds is a weight stream (decode: a few rows per
expert), where the MMA rate is idle and only HBM bytes count, which either option halves. So:
  - the ring streams the e4m3 panels (half the bytes of bf16: twice the stages fit);
  - each consumer loads the part of the panel its wgmma reads (split "n": its half of the columns;
    "m": the whole panel) into registers, four bytes per thread and load (WGMMA_8BIT), widens
    it with the paired `cvt.rn.f16x2.e4m3x2` (exact: every e4m3 value is a float16 value) into its
    own float16 staging tile, and runs a float16 wgmma on it. float16, not bfloat16: Mosaic's
    e4m3 -> bf16 convert needs PTX ISA 9.2 (else it goes through float32, two more converts per
    element), so x comes in float16 (exact for bf16 values in [2^-14, 65504]; the caller converts);
  - the epilogue multiplies each accumulator by its group's channel scales (loaded per unit
    straight from global memory, a column vector broadcast over the rows) before the SwiGLU, and
    writes `out_dtype`.
The widening costs shared-memory bandwidth (1 byte read, 2 written, 2 read by wgmma per element,
against 2 for bf16), not HBM time; at prefill (compute-bound) "m" consumers each widen the whole
panel, twice the work of "n".
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from pallas_kernels.common.device_info import SMEM_LIMIT
from pallas_kernels.moe.grouped_matmul_mosaic import (check_ring, check_smem, launch, plan,
                                                      ring_smem_bytes, silu_mul, store_rows,
                                                      unit_of)

# Registers the producer warpgroup keeps (it only issues TMA); the consumers get the rest.
_PRODUCER_REGISTERS = 40
FP8 = jnp.float8_e4m3fn
FP8_COMPUTE = jnp.float16  # what an e4m3 weight is widened to, and the dtype x must have with it


@dataclasses.dataclass(frozen=True)
class WsConfig:
    """block_m x block_n: the CTA tile; split: how the two consumers share it ("m": block_m / 2
    rows each, "n": block_n / 2 columns each); block_k: the K step of the TMA ring; stages: ring
    depth; num_ctas: persistent CTAs (0 = one per SM)."""
    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    stages: int = 4
    split: str = "m"
    num_ctas: int = 0

    def __post_init__(self):
        if self.split not in ("m", "n"):
            raise ValueError(f"split={self.split!r}: must be 'm' or 'n'")
        if self.block_m not in (64, 128) or (self.split == "m" and self.block_m != 128):
            raise ValueError(f"block_m={self.block_m}: must be 64 or 128 (128 with split='m': "
                             f"each consumer's wgmma takes 64 rows)")
        if self.block_n % (128 if self.split == "n" else 64) or not 64 <= self.block_n <= 256:
            raise ValueError(f"block_n={self.block_n}: a multiple of 64 up to 256 (of 128 with "
                             f"split='n': each consumer takes a 64-aligned half)")
        check_ring(self)

    @property
    def wg_tile(self) -> tuple[int, int]:
        """One consumer's accumulator shape."""
        if self.split == "m":
            return self.block_m // 2, self.block_n
        return self.block_m, self.block_n // 2

    def smem_bytes(self, num_weights: int, weight_itemsize: int = 2) -> int:
        """Both consumers' output tiles together are block_m x block_n, as in the other kernel;
        8-bit weights: a narrower ring plus each consumer's 16-bit staging tiles (one per stack,
        block_k x its columns)."""
        if weight_itemsize == 2:
            return ring_smem_bytes(self, num_weights)
        wn = self.wg_tile[1]
        ring = self.stages * (2 * self.block_m * self.block_k
                              + num_weights * self.block_k * self.block_n)
        return ring + 2 * self.block_m * self.block_n + 2 * 2 * num_weights * self.block_k * wn

    def check(self, num_weights: int, weight_itemsize: int = 2) -> None:
        if weight_itemsize == 2:
            check_smem(self, num_weights)
        elif self.smem_bytes(num_weights, weight_itemsize) > SMEM_LIMIT:
            raise ValueError(f"{self} needs {self.smem_bytes(num_weights, weight_itemsize)} bytes "
                             f"of shared memory with {num_weights} 8-bit weight stack(s); the "
                             f"limit is {SMEM_LIMIT}")
        wm, wn = self.wg_tile
        if num_weights * wm * wn > 64 * 256:
            raise ValueError(f"{self}: {num_weights} float32 accumulator(s) of {wm} x {wn} per "
                             f"consumer exceed its registers (at most 64 x 256 in all)")


def _tma_transforms(cols: int, dtype):
    """Tiled + swizzled shared-memory layout wgmma reads, for a tile `cols` elements wide."""
    swizzle = plgpu.find_swizzle(cols * jnp.dtype(dtype).itemsize * 8)
    return (plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)),
            plgpu.SwizzleTransform(swizzle))


@functools.partial(jax.jit, static_argnames=("config", "interpret", "out_dtype"))
def grouped_matmul_ws(x: jax.Array, weights: tuple[jax.Array, ...], group_sizes: jax.Array, *,
                      config: WsConfig = WsConfig(), interpret: bool = False,
                      table: jax.Array | None = None, scales: tuple[jax.Array, ...] | None = None,
                      out_dtype=None) -> jax.Array:
    """`grouped_matmul_mosaic`'s arguments and result, on this kernel's schedule. scales: with
    e4m3 weights, float32 [G, N] per stack (x then float16: `FP8_COMPUTE`); out_dtype: the
    result's dtype (default x's)."""
    cfg = config
    m, k = x.shape
    fp8 = scales is not None
    x, table, n, units, num_ctas = plan(x, weights, group_sizes, cfg, table,
                                        FP8 if fp8 else None)
    if fp8:
        if x.dtype != FP8_COMPUTE:
            raise ValueError(f"x: {x.dtype}; with e4m3 weights the kernel takes {FP8_COMPUTE}")
        if len(scales) != len(weights) or any(s.shape != (w.shape[0], n) or s.dtype != jnp.float32
                                              for s, w in zip(scales, weights)):
            raise ValueError(f"scales: expected float32 {(weights[0].shape[0], n)} per stack")
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    wm, wn = cfg.wg_tile
    nb = n // bn
    nw = len(weights)
    fused = nw == 2
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    in_transforms = _tma_transforms(bk, x.dtype)
    # An e4m3 panel is tiled 64 bytes wide, so each consumer's half (split "n": wn = 64 or 128
    # columns) is whole tiles; its float16 staging copy is laid out as a 16-bit panel would be.
    w_transforms = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(64)) if fp8 \
        else in_transforms
    wide_transforms = _tma_transforms(wn, FP8_COMPUTE)

    def pipeline(body, context):
        return plgpu.emit_pipeline_warp_specialized(
            body, grid=(k // bk,), memory_registers=_PRODUCER_REGISTERS,
            in_specs=[plgpu.BlockSpec((bm, bk), lambda kk: (0, kk), transforms=in_transforms)]
            + [plgpu.BlockSpec((bk, bn), lambda kk: (kk, 0), transforms=w_transforms)] * nw,
            wg_axis="wg", num_compute_wgs=2, max_concurrent_steps=cfg.stages,
            compute_context=context)

    def ignore(*_, **__):
        return None

    def body(table_ref, x_ref, *refs):
        w_refs, s_refs, o_ref = refs[:nw], refs[nw:-1], refs[-1]
        allocs = pipeline(ignore, ignore).get_allocations(
            x_ref.at[pl.ds(0, bm)], *(w.at[0, :, pl.ds(0, bn)] for w in w_refs))

        def scope(pipeline_allocs, o_smem, wide=None):
            wg = lax.axis_index("wg")
            rows_of_wg = pl.ds(wg * wm, wm) if cfg.split == "m" else slice(None)
            cols_of_wg = slice(None) if cfg.split == "m" else pl.ds(wg * wn, wn)

            @plgpu.nd_loop((units,), collective_axes="cta")
            def _unit(loop_info):
                ni, group, row0, load0, n_rows = unit_of(table_ref, loop_info.index[0], nb)

                # This consumer's rows of the tile, as offsets in the window; with split="m" a
                # consumer whose half holds none of them skips its matmuls.
                lo, hi, first = row0 - load0, row0 - load0 + n_rows, 0
                if cfg.split == "m":
                    first = wg * wm
                    lo, hi = jnp.clip(lo, first, first + wm), jnp.clip(hi, first, first + wm)

                def mma(_, x_smem, *rest):
                    *w_smem, accs = rest

                    def issue():
                        operands = [w.at[:, cols_of_wg] for w in w_smem]
                        if fp8:  # widen this consumer's columns into its staging tiles
                            for i, w in enumerate(operands):
                                wide[wg, i] = plgpu.load(
                                    w, layout=plgpu.Layout.WGMMA_8BIT).astype(FP8_COMPUTE)
                            plgpu.commit_smem()  # the stores -> visible to wgmma
                            operands = [wide.at[wg, i] for i in range(nw)]
                        for acc, w in zip(accs, operands):
                            plgpu.wgmma(acc, x_smem.at[rows_of_wg], w)
                        plgpu.wgmma_wait(0)

                    if cfg.split == "m":
                        pl.when(hi > lo)(issue)
                    else:
                        issue()
                    return accs

                def epilogue(eval_pipeline):
                    col0 = ni * bn + (0 if cfg.split == "m" else wg * wn)
                    # The group's channel scales for this consumer's columns, fetched while the
                    # K loop runs.
                    col_scales = [plgpu.load(s.at[group, pl.ds(col0, wn)],
                                             layout=plgpu.Layout.WGMMA.reduce(0), optimized=False)
                                  for s in s_refs]

                    def acc_scope(*accs):
                        eval_pipeline(accs)
                        return tuple(a[...] for a in accs)

                    accs = pl.run_scoped(acc_scope, *[plgpu.ACC((wm, wn))] * nw)
                    accs = [a * lax.broadcast_in_dim(s, a.shape, [1])
                            for a, s in zip(accs, col_scales)] or accs
                    out = silu_mul(*accs) if fused else accs[0]
                    if out_dtype == jnp.float16:  # past float16's range: its largest, not inf
                        out = jnp.clip(out, -65504.0, 65504.0)
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last unit's stores
                    o_smem[wg] = out.astype(out_dtype)
                    plgpu.commit_smem()
                    store_rows(o_smem.at[wg], o_ref, lo - first, load0 + lo, hi - lo, wm,
                               pl.ds(col0, wn))

                @pl.when(n_rows > 0)
                def _():
                    pipeline(mma, epilogue)(
                        x_ref.at[pl.ds(load0, bm)],
                        *(w.at[group, :, pl.ds(ni * bn, bn)] for w in w_refs),
                        allocations=pipeline_allocs)

            pl.when(wg < 2)(lambda: plgpu.wait_smem_to_gmem(0, wait_read_only=True))

        scratch = [plgpu.SMEM((2, wm, wn), out_dtype)]
        if fp8:
            scratch.append(plgpu.SMEM((2, nw, bk, wn), FP8_COMPUTE, transforms=wide_transforms))
        pl.run_scoped(scope, allocs, *scratch, collective_axes="wg")

    return launch(body, x, weights, table, m, n, num_ctas, "grouped_matmul_ws", interpret,
                  scales=tuple(scales or ()), out_dtype=out_dtype, num_threads=3,
                  thread_name="wg")
