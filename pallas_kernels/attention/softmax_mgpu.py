"""Register-level pieces of the flash kernel's online softmax that Pallas cannot express:
per-thread and per-warp branches over Mosaic GPU's WGMMA register layout (`inline_mgpu`).

In the WGMMA layout a thread holds two rows of a 64-row tile (r and r + 8); the four threads of a
quad share their rows, and a row statistic in the row layout (`WGMMA.reduce(1)`) is replicated
over the quad. GPU only: the interpreter has no `inline_mgpu`, so `flash_mgpu` runs the plain jnp
form of each piece there (the same math)."""

from __future__ import annotations

import jax.experimental.mosaic.gpu as mgpu
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
import numpy as np
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, nvvm, scf, vector

# The stale-max step: a row sum of P at most this, against a kept max, means every p is too, far
# from fp32's range; a row whose max grew by at most the rescale threshold t has sums
# <= 2^t * block_kv.
STALE_SUM_BOUND = 2.0 ** 16


def _branch(cond, then_fn, arrays):
    """Per-thread `then_fn()` if cond else `arrays` (FragmentedArrays; then_fn returns the same
    layouts): an scf.if over their registers. Mosaic GPU has no per-thread control flow above
    this level."""
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


def _any_scalar(row, predicate):
    """i1: predicate(x) for some element x of this thread's registers of `row`."""
    out = None
    for reg in row.registers.flat:
        for i in range(ir.VectorType(reg.type).shape[0]):
            hit = predicate(vector.extract(reg, [], [i]))
            out = hit if out is None else arith.ori(out, hit)
    return out


def redo_where_sums_overflow(s, p, acc, m_i, l_i, row_sum, factor: float, threshold: float):
    """The stale-max step's check: p = exp2(s * factor - m_i) was taken against the kept max without
    the step's row max. Where every row sum is at most STALE_SUM_BOUND, (p, acc, m_i, l_i +
    row_sum) is the online softmax's step exactly (a kept max, no rescale). A warp with a larger,
    inf or NaN sum (the first step, or a max that jumped) redoes the step as the plain path would:
    the row max, the lazy threshold, rescaled acc and l, p against the new max. The branch is
    warp-uniform (a vote), since the redo's row reductions shuffle across lanes."""
    wgmma = plgpu.Layout.WGMMA
    row = wgmma.reduce(1)

    @plgpu.inline_mgpu(arg_types=(wgmma, wgmma, wgmma, row, row, row),
                       return_type=(plgpu.ShapeDtypeStruct(s.shape, jnp.float32, layout=wgmma),
                                    plgpu.ShapeDtypeStruct(acc.shape, jnp.float32, layout=wgmma),
                                    plgpu.ShapeDtypeStruct(m_i.shape, jnp.float32, layout=row),
                                    plgpu.ShapeDtypeStruct(l_i.shape, jnp.float32, layout=row)))
    def fix(_, s, p, acc, m_i, l_i, row_sum):
        bound = arith.constant(ir.F32Type.get(), STALE_SUM_BOUND)
        # Unordered >: true for NaN too, so NaN sums redo.
        bad = _any_scalar(row_sum, lambda x: arith.cmpf(arith.CmpFPredicate.UGT, x, bound))
        bad = nvvm.vote_sync(arith.constant(ir.IntegerType.get_signless(32), -1), bad, "any")

        def redo():
            rows = lambda v, like: v.broadcast_in_dim(like.shape, (0,), like.layout)
            m_new = m_i.max(s.reduce("max", 1) * factor)
            m_new = ((m_new - m_i) > threshold).select(m_new, m_i)  # NaN: keep
            alpha = (m_i - m_new).exp2(approx=True)
            p_new = (s * factor - rows(m_new, s)).exp2(approx=True)
            return p_new, acc * rows(alpha, acc), m_new, l_i * alpha + p_new.reduce("add", 1)

        return tuple(_branch(bad, redo, [p, acc, m_i, l_i + row_sum]))

    return fix(s, p, acc, m_i, l_i, row_sum)
