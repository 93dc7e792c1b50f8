"""Register-level pieces of the flash kernel's online softmax that Pallas cannot express: per-thread
branches and per-thread partial row sums over Mosaic GPU's WGMMA register layout (`inline_mgpu`).

In the WGMMA layout a thread holds two rows of a 64-row tile (r and r + 8) and, of each 8-column
block, two adjacent columns; the four threads of a quad (lanes 4i .. 4i+3) share their rows. A row
statistic in the row layout (`WGMMA.reduce(1)`) is replicated over the quad.

GPU only: Mosaic GPU's interpreter has no `inline_mgpu`, so `flash_mgpu` uses the plain jnp form
of each piece there (the same math, without the branch or the deferred reduction)."""

from __future__ import annotations

import jax.experimental.mosaic.gpu as mgpu
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
import numpy as np
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, scf, vector

WGMMA = plgpu.Layout.WGMMA
ROW = WGMMA.reduce(1)


def _scalars(reg: ir.Value) -> list[ir.Value]:
    return [vector.extract(reg, [], [i]) for i in range(ir.VectorType(reg.type).shape[0])]


def _any_row_moved(m_old, m_new) -> ir.Value:
    """i1: some row of this thread has m_new != m_old (bitwise; NaN counts as moved)."""
    moved = None
    for a, b in zip(m_old.registers.flat, m_new.registers.flat):
        for x, y in zip(_scalars(a), _scalars(b)):
            ne = arith.cmpf(arith.CmpFPredicate.UNE, x, y)
            moved = ne if moved is None else arith.ori(moved, ne)
    return moved


def _branch(cond: ir.Value, then_fn, arrays):
    """Per-thread `arrays if not cond else then_fn()` for FragmentedArrays of equal layouts."""
    regs = [r for a in arrays for r in a.registers.flat]
    branch = scf.IfOp(cond, [r.type for r in regs], has_else=True)
    with ir.InsertionPoint(branch.then_block):
        scf.yield_([r for a in then_fn() for r in a.registers.flat])
    with ir.InsertionPoint(branch.else_block):
        scf.yield_(regs)
    results, out = list(branch.results), []
    for a in arrays:
        new = np.empty(a.registers.shape, dtype=object)
        new.flat[:] = results[:a.registers.size]
        results = results[a.registers.size:]
        out.append(mgpu.FragmentedArray(_registers=new, _layout=a.layout, _is_signed=None))
    return out


def _f32(shape, layout):
    return plgpu.ShapeDtypeStruct(shape, jnp.float32, layout=layout)


def rows_scale_where_needed(acc, alpha):
    """acc * alpha[:, None], with the multiply skipped in every thread whose rows all have
    alpha == 1 (lazy rescaling: most steps keep every row's max)."""
    @plgpu.inline_mgpu(arg_types=(WGMMA, ROW), return_type=_f32(acc.shape, WGMMA))
    def scale(_, acc, alpha):
        one = arith.constant(ir.F32Type.get(), 1.0)
        need = None
        for reg in alpha.registers.flat:
            for x in _scalars(reg):
                ne = arith.cmpf(arith.CmpFPredicate.UNE, x, one)
                need = ne if need is None else arith.ori(need, ne)
        [acc] = _branch(need, lambda: [acc * alpha.broadcast_in_dim(acc.shape, (0,), acc.layout)],
                        [acc])
        return acc

    return scale(acc, alpha)


def exp2_where_max_moved(s, p_stale, acc, m_old, m_new, factor: float):
    """Speculative softmax numerators. p_stale = exp2(s * factor - m_old) was computed against the
    previous row max, so its exp2s did not wait for this step's max reduction; it is exact in every
    row whose max stayed (m_new == m_old, the common case under lazy rescaling). Threads with a row
    whose max moved (the first step, or a jump past the threshold) recompute p against m_new and
    rescale acc by exp2(m_old - m_new); the others skip both. -> (p, acc)."""
    @plgpu.inline_mgpu(arg_types=(WGMMA, WGMMA, WGMMA, ROW, ROW),
                       return_type=(_f32(s.shape, WGMMA), _f32(acc.shape, WGMMA)))
    def fix(_, s, p, acc, m_old, m_new):
        def recompute():
            rows = lambda v, shape: v.broadcast_in_dim(shape, (0,), s.layout)
            p_new = (s * factor - rows(m_new, s.shape)).exp2(approx=True)
            alpha = (m_old - m_new).exp2(approx=True)
            return p_new, acc * rows(alpha, acc.shape)
        p, acc = _branch(_any_row_moved(m_old, m_new), recompute, [p, acc])
        return p, acc

    return fix(s, p_stale, acc, m_old, m_new)


def thread_row_sums(p):
    """Row sums of this thread's own elements of p (in the row layout, but *not* summed over the
    quad): per-step partial sums that `quad_sums` completes once per work item, which takes the
    two shuffle rounds of a full row reduction off every step."""
    @plgpu.inline_mgpu(arg_types=(WGMMA,), return_type=_f32((p.shape[0],), ROW))
    def sums(_, p):
        out_layout = p.layout.reduce((1,))
        out = np.empty(out_layout.registers_shape((p.shape[0],)), dtype=object)
        regs = p.registers
        # (row tiles, column blocks, ..., row halves, ...): sum the column blocks per row half.
        assert regs.ndim == 9 and regs.shape[1] == p.shape[1] // 8 and out.shape == (1, 1, 2, 1, 1), (
            regs.shape, out.shape)
        for h in range(2):
            vals = [regs[0, b, 0, 0, h, 0, 0, 0, 0] for b in range(regs.shape[1])]
            while len(vals) > 1:  # a tree: the adds of exp2s that land early do not wait
                vals = [arith.addf(*vals[i:i + 2]) if i + 1 < len(vals) else vals[i]
                        for i in range(0, len(vals), 2)]
            a, b = _scalars(vals[0])
            out[0, 0, h, 0, 0] = vector.broadcast(ir.VectorType.get((1,), a.type),
                                                  arith.addf(a, b))
        return mgpu.FragmentedArray(_registers=out, _layout=out_layout, _is_signed=None)

    return sums(p)


def quad_sums(partial):
    """Complete `thread_row_sums` partials: sum over the quad of threads sharing each row."""
    @plgpu.inline_mgpu(arg_types=(ROW,), return_type=_f32(partial.shape, ROW))
    def reduce(_, partial):
        out = np.empty(partial.registers.shape, dtype=object)
        for idx, reg in np.ndenumerate(partial.registers):
            for lane_bit in (1, 2):
                reg = arith.addf(reg, mgpu_utils.shfl_bfly(reg, lane_bit))
            out[idx] = reg
        return mgpu.FragmentedArray(_registers=out, _layout=partial.layout, _is_signed=None)

    return reduce(partial)


# exp2 on the FMA pipe (FlashAttention-4's trick): 2^x = 2^round(x) * 2^f, f in [-0.5, 0.5], with
# 2^f a degree-3 polynomial (relative error 1.4e-4 in f32, far below P's bf16 rounding) and
# 2^round(x) added straight into the exponent bits. round(x) comes from the 1.5 * 2^23 trick:
# x + 1.5 * 2^23 holds round(x) in its low mantissa bits.
_EXP2_POLY = (0.9999281167984009, 0.6932609677314758, 0.24261054396629333, 0.05517132207751274)
_ROUND_MAGIC = 12582912.0  # 1.5 * 2^23
_EXP2_MIN = -126.0  # below this 2^x is denormal, where the exponent-bit add would wrap


def _exp2_poly_reg(x: ir.Value) -> ir.Value:
    """exp2 of a vector<N x f32> register with FMA-pipe instructions only."""
    vec = ir.VectorType(x.type)
    i32_vec = ir.VectorType.get(vec.shape, ir.IntegerType.get_signless(32))
    const = lambda v: arith.constant(vec, ir.DenseElementsAttr.get_splat(
        vec, ir.FloatAttr.get(ir.F32Type.get(), v)))
    x = arith.maxnumf(x, const(_EXP2_MIN))  # also maps -inf (masked keys) to ~1e-38
    t = arith.addf(x, const(_ROUND_MAGIC))  # no fast-math flags: (x + M) - M must round
    f = arith.subf(x, arith.subf(t, const(_ROUND_MAGIC)))
    c0, c1, c2, c3 = (const(c) for c in _EXP2_POLY)
    fma = lambda a, b, c: arith.addf(arith.mulf(a, b, fastmath=arith.FastMathFlags.contract), c,
                                     fastmath=arith.FastMathFlags.contract)
    p = fma(fma(fma(c3, f, c2), f, c1), f, c0)
    shift = arith.constant(i32_vec, ir.DenseElementsAttr.get_splat(
        i32_vec, ir.IntegerAttr.get(ir.IntegerType.get_signless(32), 23)))
    bits = arith.addi(arith.bitcast(i32_vec, p), arith.shli(arith.bitcast(i32_vec, t), shift))
    return arith.bitcast(vec, bits)


def exp2_mixed(x, poly_blocks: int):
    """exp2(x) for a [64, N] WGMMA-layout score tile, with `poly_blocks` of every 16 8-column blocks
    computed by `_exp2_poly_reg` on the FMA pipe and the rest by MUFU's ex2.approx: the MUFU pipe
    (16 exp2 per clock per SM) is what a softmax step waits on most, while the FMA pipe idles."""
    @plgpu.inline_mgpu(arg_types=(WGMMA,), return_type=_f32(x.shape, WGMMA))
    def mixed(_, x):
        mufu = x.exp2(approx=True)  # the registers not taken below are dead code for LLVM
        regs = mufu.registers.copy()
        assert regs.ndim == 9 and regs.shape[1] == x.shape[1] // 8, regs.shape
        for b in range(regs.shape[1]):
            if b % (16 // poly_blocks) == 0:  # spread evenly along the row
                for idx in np.ndindex(regs.shape[:1] + (1,) + regs.shape[2:]):
                    at = (idx[0], b, *idx[2:])
                    regs[at] = _exp2_poly_reg(x.registers[at])
        return mgpu.FragmentedArray(_registers=regs, _layout=x.layout, _is_signed=None)

    return mixed(x)
