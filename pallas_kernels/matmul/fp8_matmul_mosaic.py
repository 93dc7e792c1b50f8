"""FP8 weight-streaming matmul for decode on Hopper (Mosaic GPU): y = (xq @ q.T) * sx * sw for a
few rows, every e4m3 weight byte read once through a deep TMA ring.

The arithmetic is the "fp8" (W8A8) implementation of `jaxinfer.model.quant.ops.quantized_matmul`:
x quantized per token to e4m3 (`quantize_tokens`), weights e4m3 [N, K] (K-major, the HF layout)
with float32 per-output-channel scales, products accumulated in float32 and scaled by the outer
product sx[m] * sw[n]. At decode the step is a weight stream (1..64 rows against megabytes of
weights), which XLA's gemms read at half the HBM rate; this kernel is laid out for the stream:

  - swap-AB: wgmma's A (M) side is the weight tile [64 rows, block_k] straight from the ring
    (fp8 wgmma takes both operands e4m3 and K-major, which the weight is as it lies) and its N side
    is the x tile [rows, block_k] read transposed (rows: the token count padded to a multiple of
    8), so no tensor-core work or shared memory goes to 64 padded token rows;
  - one producer warpgroup runs a `stages`-deep TMA ring over K (weight panel + the tiny x tile);
    two consumer warpgroups each take half of the panel's rows (`plgpu.emit_pipeline_warp_specialized`);
  - persistent CTAs (one per SM) walk the work units (N block, K split): a projection with few
    N blocks (o / down: 4096 rows, 32 blocks of 128) is split along K so every SM streams, each
    split writing its own float32 partial [rows, N];
  - the epilogue TMA-stores each consumer's float32 accumulator [64, rows] as it lies (y's
    partial, transposed: Mosaic GPU stores a WGMMA-layout float32 array into a transposed
    shared-memory view only in 16 bits); the caller's sum of the partials, transpose, scales and
    cast are elementwise (no reduce), so XLA fuses them into the consumer of y.

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

from pallas_kernels.common.device_info import num_sms
from pallas_kernels.common.device_info import SMEM_LIMIT
from pallas_kernels.moe.grouped_matmul_mosaic import pad_rows, padded_rows

FP8 = jnp.float8_e4m3fn
MAX_ROWS = 64  # token rows the kernel takes (wgmma's N side; a consumer's accumulator: block_n/2 x 64)
_ROW_STEP = 8  # token rows are padded to a multiple of wgmma's N step
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

    def smem_bytes(self, rows: int) -> int:
        """The ring (weight panel + x tile per stage) and the two consumers' float32 outputs."""
        return (self.stages * (self.block_n + rows) * self.block_k + 4 * rows * self.block_n)


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


def check_inputs(xq, xs, w, ws, cfg: Fp8Config) -> None:
    m, k = xq.shape
    n, k2 = w.shape
    if xq.dtype != FP8 or w.dtype != FP8:
        raise ValueError(f"xq {xq.dtype}, w {w.dtype}: both must be {jnp.dtype(FP8)}")
    if k2 != k or xs.shape != (m,) or ws.shape != (n,):
        raise ValueError(f"shapes: xq {xq.shape}, xs {xs.shape}, w {w.shape}, ws {ws.shape}")
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"rows={m}: the kernel takes 1..{MAX_ROWS}")
    if n % cfg.block_n or k % cfg.block_k:
        raise ValueError(f"N={n} / K={k} must be multiples of block_n={cfg.block_n} / "
                         f"block_k={cfg.block_k}")
    rows = padded_rows(m, _ROW_STEP)
    if cfg.smem_bytes(rows) > SMEM_LIMIT:
        raise ValueError(f"{cfg} needs {cfg.smem_bytes(rows)} bytes of shared memory at {rows} "
                         f"rows; the limit is {SMEM_LIMIT}")


def supports(n: int, k: int, cfg: Fp8Config = Fp8Config()) -> bool:
    """Whether an [n, k] weight tiles with `cfg` (callers fall back to XLA otherwise)."""
    return n % cfg.block_n == 0 and k % cfg.block_k == 0


def _transforms():
    """TMA + wgmma layout of an fp8 [rows, block_k] tile: 128-byte swizzle, (8, 128) tiles."""
    return plgpu.TilingTransform((8, 128)), plgpu.SwizzleTransform(128)


def fp8_partials(xq: jax.Array, w: jax.Array, cfg: Fp8Config, splits: int,
                 interpret: bool) -> jax.Array:
    """float32 [splits, N, rows]: split s holds w @ xq.T over K's s-th slice (xq [rows, K] with rows
    a multiple of 8, w [N, K], both e4m3): the transpose of y's partial, as wgmma leaves it."""
    rows, k = xq.shape
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
            in_specs=[plgpu.BlockSpec((bn, bk), lambda kk: (0, kk), transforms=transforms),
                      plgpu.BlockSpec((rows, bk), lambda kk: (0, kk), transforms=transforms)],
            wg_axis="wg", num_compute_wgs=2, max_concurrent_steps=cfg.stages,
            compute_context=context)

    def ignore(*_, **__):
        return None

    def body(x_ref, w_ref, o_ref):
        allocs = pipeline(ignore, ignore).get_allocations(
            w_ref.at[pl.ds(0, bn), pl.ds(0, kc)], x_ref.at[:, pl.ds(0, kc)])

        def scope(pipeline_allocs, o_smem):
            wg = lax.axis_index("wg")

            @plgpu.nd_loop((units,), collective_axes="cta")
            def _unit(loop_info):
                u = loop_info.index[0]
                ni, ks = lax.div(u, jnp.int32(splits)), lax.rem(u, jnp.int32(splits))

                def mma(_, w_smem, x_smem, acc):
                    # acc^T [wn, rows] += W [wn, bk] . x^T [bk, rows]: both K-major e4m3.
                    plgpu.wgmma(acc, w_smem.at[pl.ds(wg * wn, wn)], x_smem.transpose((1, 0)))
                    plgpu.wgmma_wait(0)
                    return acc

                def epilogue(eval_pipeline):
                    def acc_scope(acc):
                        eval_pipeline(acc)
                        return acc[...]

                    acc = pl.run_scoped(acc_scope, plgpu.ACC((wn, rows)))
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last unit's store
                    o_smem[wg] = acc
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(o_smem.at[wg],
                                            o_ref.at[ks, pl.ds(ni * bn + wg * wn, wn)])

                pipeline(mma, epilogue)(
                    w_ref.at[pl.ds(ni * bn, bn), pl.ds(ks * kc, kc)],
                    x_ref.at[:, pl.ds(ks * kc, kc)],
                    allocations=pipeline_allocs)

            pl.when(wg < 2)(lambda: plgpu.wait_smem_to_gmem(0, wait_read_only=True))

        pl.run_scoped(scope, allocs, plgpu.SMEM((2, wn, rows), jnp.float32), collective_axes="wg")

    return plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((splits, n, rows), jnp.float32),
        grid=(num_ctas,),
        grid_names=("cta",),
        num_threads=3,
        thread_name="wg",
        kernel_name="fp8_matmul",
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=plgpu.InterpretGPUParams() if interpret else False,
    )(xq, w)


# A jit of its own: every layer calls it with the same shapes, so it lowers once per shape.
@functools.partial(jax.jit, static_argnames=("config", "out_dtype", "interpret"))
def fp8_matmul(xq: jax.Array, xs: jax.Array, w: jax.Array, ws: jax.Array, *,
               config: Fp8Config = Fp8Config(), out_dtype=jnp.bfloat16,
               interpret: bool = False) -> jax.Array:
    """xq [M, K] e4m3 with per-row scales xs [M] float32, w [N, K] e4m3 with per-row scales ws [N]
    float32 -> [M, N] `out_dtype`: y[m, n] = xs[m] * ws[n] * sum_k xq[m, k] * w[n, k], M <= 64."""
    check_inputs(xq, xs, w, ws, config)
    m, k = xq.shape
    n = w.shape[0]
    xq, _ = pad_rows(xq, _ROW_STEP)
    splits = config.splits or choose_splits(n, k, config, config.num_ctas or num_sms())
    if (k // config.block_k) % splits:
        raise ValueError(f"splits={splits} must divide K / block_k = {k // config.block_k}")
    parts = fp8_partials(xq, w, config, splits, interpret)[:, :, :m]
    # A sum of slices, not a reduce, and a transpose: elementwise, so they fuse with the scales and
    # the cast into whatever consumes y.
    acc = functools.reduce(jnp.add, [parts[s] for s in range(splits)]).T
    return (acc * xs[:, None] * ws[None, :]).astype(out_dtype)
