"""FP8 weight-streaming matmul for decode on Hopper (Mosaic GPU): y = (xq @ q.T) * sx * sw for a
few bf16 rows x (quantized per token inside the kernel), every e4m3 weight byte read once through a
deep TMA ring.

The arithmetic is the "fp8" (W8A8) implementation of `jaxinfer.model.quant.ops.quantized_matmul`:
x quantized per token to e4m3 (`quantize_tokens`), weights e4m3 [N, K] (K-major, the HF layout)
with float32 per-output-channel scales, products accumulated in float32 and scaled by the outer
product sx[m] * sw[n]. At decode the step is a weight stream (1..64 rows against megabytes of
weights), which XLA's gemms read at half the HBM rate; this kernel is laid out for the stream:

  - swap-AB: wgmma's A (M) side is the weight tile [64 rows, block_k] straight from the ring
    (fp8 wgmma takes both operands e4m3 and K-major, which the weight is as it lies) and its N side
    is x's e4m3 tile [8, block_k] read transposed, so no tensor-core work or shared memory goes to
    64 padded token rows;
  - x is quantized in the kernel, not by XLA (which took two extra kernels per projection: the
    amax reduce and the convert + pad, ~1.2 us each plus ~4.6 us of host launch): while the
    producer fills the ring, consumer 0 reads the m bf16 rows (L2-resident, 8-28 KB per row),
    takes each row's amax, and writes e4m3 x [8, K] (rows m..7 zero) into shared memory once per
    CTA, then hands it to consumer 1; x is no part of the ring. CTA 0 also writes sx [8];
  - one producer warpgroup runs a `stages`-deep TMA ring over K (weight panels only);
    two consumer warpgroups each take half of the panel's rows (`plgpu.emit_pipeline_warp_specialized`);
  - persistent CTAs (one per SM) walk the work units (N block, K split): a projection with few
    N blocks (o / down: 4096 rows, 32 blocks of 128) is split along K so every SM streams, each
    split writing its own float32 partial [rows, N];
  - the epilogue TMA-stores each consumer's float32 accumulator [64, rows] as it lies (y's
    partial, transposed: Mosaic GPU stores a WGMMA-layout float32 array into a transposed
    shared-memory view only in 16 bits); the caller's sum of the partials, transpose, scales and
    cast are elementwise (no reduce), so XLA fuses them into the consumer of y (the step already
    has a fusion after each projection: rope, SwiGLU, the convert before the norm kernel), and a
    projection adds no kernel to the step but this one.

CPU tests run the kernel in Mosaic GPU's interpreter and lower it for CUDA
(tests/test_fp8_matmul.py); benchmarks/bench_fp8_matmul.py times it on the H200.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from pallas_kernels.device_info import num_sms
from pallas_kernels.flash_config import SMEM_LIMIT

FP8 = jnp.float8_e4m3fn
FP8_MAX = float(jnp.finfo(FP8).max)
ROWS = 8  # wgmma's N side: x's e4m3 tile in shared memory always has 8 rows (the real ones first)
MAX_ROWS = ROWS  # token rows the kernel takes (x [rows, K] e4m3 stays in shared memory whole)
# Columns of x one store into the swizzled e4m3 tile takes: the SMEM_GMEM_COPY register layout of an
# [8, CHUNK] e4m3 tile spans four 128-byte swizzle tiles (one per warp).
CHUNK = 512
_PRODUCER_REGISTERS = 40  # the producer warpgroup only issues TMA
# Per-unit cost of refilling the ring, in bytes of stream it is worth (the split choice's model:
# ~1 us of HBM latency at an SM's share of the H200's bandwidth).
_UNIT_OVERHEAD_BYTES = 32 << 10


@dataclasses.dataclass(frozen=True)
class Fp8Config:
    """block_n: weight rows per work unit (two consumers, block_n / 2 rows each: wgmma's M side);
    block_k: the K step of the TMA ring (fp8 bytes per weight row per stage); stages: ring depth;
    splits: K splits (0 = chosen from the shape, `choose_splits`); num_ctas: persistent CTAs
    (0 = one per SM)."""
    block_n: int = 128
    block_k: int = 128
    stages: int = 6
    splits: int = 0
    num_ctas: int = 0

    def __post_init__(self):
        if self.block_n not in (128, 256):
            raise ValueError(f"block_n={self.block_n}: must be 128 or 256 (64 or 128 rows per "
                             f"consumer)")
        if self.block_k not in (128, 256):
            raise ValueError(f"block_k={self.block_k}: must be 128 or 256 (multiples of the "
                             f"128-byte swizzle)")
        if self.stages < 2:
            raise ValueError(f"stages={self.stages}: must be at least 2")
        if self.splits < 0:
            raise ValueError(f"splits={self.splits}: must be >= 0")

    def smem_bytes(self, k: int) -> int:
        """The weight ring, x e4m3 [8, K] and its staging tile, the consumers' float32 outputs."""
        return (self.stages * self.block_n * self.block_k + ROWS * (k + CHUNK)
                + 4 * ROWS * self.block_n)


def choose_splits(n: int, k: int, cfg: Fp8Config, sms: int) -> int:
    """K splits for an [n, k] weight: the count (dividing k / block_k) that minimises the busiest
    CTA's stream, ceil(units / sms) units of block_n * k / splits bytes each plus a ring refill;
    the fewest splits among equals (each adds a float32 partial to write and sum)."""
    steps = k // cfg.block_k
    nb = n // cfg.block_n

    def cost(s):
        return -(-nb * s // sms) * (cfg.block_n * k // s + _UNIT_OVERHEAD_BYTES)

    return min((s for s in range(1, min(steps, 16) + 1) if steps % s == 0),
               key=lambda s: (cost(s), s))


def check_inputs(x, w, ws, cfg: Fp8Config) -> None:
    m, k = x.shape
    n, k2 = w.shape
    if x.dtype != jnp.bfloat16 or w.dtype != FP8:
        raise ValueError(f"x {x.dtype}, w {w.dtype}: must be bfloat16 and {jnp.dtype(FP8)}")
    if k2 != k or ws.shape != (n,):
        raise ValueError(f"shapes: x {x.shape}, w {w.shape}, ws {ws.shape}")
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"rows={m}: the kernel takes 1..{MAX_ROWS}")
    if n % cfg.block_n or k % cfg.block_k or k % CHUNK:
        raise ValueError(f"N={n} / K={k} must be multiples of block_n={cfg.block_n} / "
                         f"block_k={cfg.block_k} and {CHUNK}")
    if cfg.smem_bytes(k) > SMEM_LIMIT:
        raise ValueError(f"{cfg} needs {cfg.smem_bytes(k)} bytes of shared memory at K={k}; "
                         f"the limit is {SMEM_LIMIT}")


def supports(n: int, k: int, cfg: Fp8Config = Fp8Config()) -> bool:
    """Whether an [n, k] weight tiles with `cfg` and x [8, k] fits beside its ring (callers fall
    back to XLA otherwise)."""
    return (n % cfg.block_n == 0 and k % cfg.block_k == 0 and k % CHUNK == 0
            and cfg.smem_bytes(k) <= SMEM_LIMIT)


def _transforms():
    """TMA + wgmma layout of an fp8 [rows, block_k] tile: 128-byte swizzle, (8, 128) tiles."""
    return plgpu.TilingTransform((8, 128)), plgpu.SwizzleTransform(128)


def quantize_x(x_ref, xq_smem, stage, m: int, k: int) -> list:
    """One warpgroup: x [m, K] bf16 (global memory) -> e4m3 [K / CHUNK, 8, CHUNK] in `xq_smem`
    (rows m..7 zero), as `ops.quantize_tokens` computes it: per row scale = max(amax, tiny) / 448,
    q = clip(x / scale). Returns the m scales (float32 scalars).

    The amax is a full-row reduction of a 1D strided array (every thread a slice of the row);
    the quantized chunk is written row by row into a plain staging tile and copied from there in
    the SMEM_GMEM_COPY register layout, which is what the swizzled tile wgmma reads accepts (a 1D
    row cannot be stored into a swizzled tile directly)."""
    scales = []
    for r in range(m):
        row = plgpu.load(x_ref.at[r]).astype(jnp.float32)
        scales.append(jnp.maximum(jnp.max(jnp.abs(row)), jnp.finfo(jnp.float32).tiny) / FP8_MAX)
    stage[...] = jnp.zeros((ROWS, CHUNK), FP8)  # rows m..7 stay zero: y's padding columns
    layout = plgpu.Layout.SMEM_GMEM_COPY((ROWS, CHUNK), FP8, swizzle=128)
    @pl.loop(0, k // CHUNK)  # a loop, not unrolled: Mosaic's layout inference is slow on 28 x m
    def _chunk(j):
        for r in range(m):
            v = plgpu.load(x_ref.at[r, pl.ds(j * CHUNK, CHUNK)]).astype(jnp.float32)
            stage.at[r][...] = jnp.clip(v / scales[r], -FP8_MAX, FP8_MAX).astype(FP8)
        plgpu.commit_smem()  # the rows -> every thread of the warpgroup
        xq_smem.at[j][...] = plgpu.load(stage, layout=layout)
        plgpu.commit_smem()  # the tile -> wgmma (async proxy); the staging tile free again

    return scales


def fp8_partials(x: jax.Array, w: jax.Array, cfg: Fp8Config, splits: int,
                 interpret: bool) -> tuple[jax.Array, jax.Array]:
    """(float32 [splits, N, 8], float32 [m]): split s holds w @ xq.T over K's s-th slice (x
    [m, K] bf16 quantized in the kernel to xq e4m3 with per-row scales sx, the second output;
    w [N, K] e4m3): the transpose of y's unscaled partial, as wgmma leaves it, columns m..7 zero."""
    m, k = x.shape
    n = w.shape[0]
    bn, bk = cfg.block_n, cfg.block_k
    wn = bn // 2
    kc = k // splits
    nb = n // bn
    units = nb * splits
    num_ctas = min(units, cfg.num_ctas or num_sms())
    transforms = _transforms()

    def pipeline(body, context):
        return plgpu.emit_pipeline_warp_specialized(
            body, grid=(kc // bk,), memory_registers=_PRODUCER_REGISTERS,
            in_specs=[plgpu.BlockSpec((bn, bk), lambda kk: (0, kk), transforms=transforms)],
            wg_axis="wg", num_compute_wgs=2, max_concurrent_steps=cfg.stages,
            compute_context=context)

    def ignore(*_, **__):
        return None

    def body(x_ref, w_ref, o_ref, sx_ref):
        allocs = pipeline(ignore, ignore).get_allocations(w_ref.at[pl.ds(0, bn), pl.ds(0, kc)])

        def scope(pipeline_allocs, o_smem, xq_smem, stage, x_ready):
            wg = lax.axis_index("wg")

            # The producer starts the ring at once; the consumers wait for x, which hides under
            # the ring's first `stages` loads.
            @pl.when(wg == 0)
            def _():
                scales = quantize_x(x_ref, xq_smem, stage, m, k)
                plgpu.barrier_arrive(x_ready)

                @pl.when(lax.axis_index("cta") == 0)
                def _():
                    for r, sc in enumerate(scales):
                        sx_ref[r] = sc

            pl.when(wg == 1)(lambda: plgpu.barrier_wait(x_ready))

            @plgpu.nd_loop((units,), collective_axes="cta")
            def _unit(loop_info):
                u = loop_info.index[0]
                ni, ks = lax.div(u, jnp.int32(splits)), lax.rem(u, jnp.int32(splits))

                def mma(idx, w_smem, acc):
                    # acc^T [wn, 8] += W [wn, bk] . xq^T [bk, 8]: both K-major e4m3.
                    off = (ks * (kc // bk) + idx[0]) * bk
                    chunk = lax.div(off, jnp.int32(CHUNK))
                    col = pl.multiple_of(lax.rem(off, jnp.int32(CHUNK)), bk)
                    x_tile = xq_smem.at[chunk, :, pl.ds(col, bk)]
                    plgpu.wgmma(acc, w_smem.at[pl.ds(wg * wn, wn)], x_tile.transpose((1, 0)))
                    plgpu.wgmma_wait(0)
                    return acc

                def epilogue(eval_pipeline):
                    def acc_scope(acc):
                        eval_pipeline(acc)
                        return acc[...]

                    acc = pl.run_scoped(acc_scope, plgpu.ACC((wn, ROWS)))
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last unit's store
                    o_smem[wg] = acc
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(o_smem.at[wg],
                                            o_ref.at[ks, pl.ds(ni * bn + wg * wn, wn)])

                pipeline(mma, epilogue)(
                    w_ref.at[pl.ds(ni * bn, bn), pl.ds(ks * kc, kc)],
                    allocations=pipeline_allocs)

            pl.when(wg < 2)(lambda: plgpu.wait_smem_to_gmem(0, wait_read_only=True))

        pl.run_scoped(scope, allocs, plgpu.SMEM((2, wn, ROWS), jnp.float32),
                      plgpu.SMEM((k // CHUNK, ROWS, CHUNK), FP8), plgpu.SMEM((ROWS, CHUNK), FP8),
                      plgpu.Barrier(), collective_axes="wg")

    return plgpu.kernel(
        body,
        out_type=(jax.ShapeDtypeStruct((splits, n, ROWS), jnp.float32),
                  jax.ShapeDtypeStruct((m,), jnp.float32)),
        grid=(num_ctas,),
        grid_names=("cta",),
        num_threads=3,
        thread_name="wg",
        kernel_name="fp8_matmul",
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=plgpu.InterpretGPUParams() if interpret else False,
    )(x, w)


# A jit of its own: every layer calls it with the same shapes, so it lowers once per shape.
@functools.partial(jax.jit, static_argnames=("config", "out_dtype", "interpret"))
def fp8_matmul(x: jax.Array, w: jax.Array, ws: jax.Array, *, config: Fp8Config = Fp8Config(),
               out_dtype=jnp.bfloat16, interpret: bool = False) -> jax.Array:
    """x [M, K] bf16, w [N, K] e4m3 with per-row scales ws [N] float32 -> [M, N] `out_dtype`:
    `quantized_matmul`'s "fp8" arithmetic, y[m, n] = sx[m] * ws[n] * sum_k xq[m, k] * w[n, k]
    with x quantized per token to xq, sx (in the kernel), M <= MAX_ROWS."""
    check_inputs(x, w, ws, config)
    m, k = x.shape
    n = w.shape[0]
    splits = config.splits or choose_splits(n, k, config, config.num_ctas or num_sms())
    if (k // config.block_k) % splits:
        raise ValueError(f"splits={splits} must divide K / block_k = {k // config.block_k}")
    parts, xs = fp8_partials(x, w, config, splits, interpret)
    parts = parts[:, :, :m]
    # A sum of slices, not a reduce, and a transpose: elementwise, so they fuse with the scales and
    # the cast into whatever consumes y.
    acc = functools.reduce(jnp.add, [parts[s] for s in range(splits)]).T
    return (acc * xs[:, None] * ws[None, :]).astype(out_dtype)
