"""The flash-decoding combine as one Mosaic GPU kernel: merges the Mosaic decode kernel's
normalised per-split parts into the attention output.

Why a kernel and not XLA: the same math in XLA is three kernels on the H200 (max, exp2, sums over
the splits; 4.5 us at batch 1 x 32768 with 16 splits); this one takes 1.3-1.7 us
(docs/kernels/paged_decode.md). It waits on `griddepcontrol.wait` and the decode
kernel triggers its dependents when it starts, so where programmatic dependent launch is honoured
its launch overlaps the decode kernel (inside XLA's command buffers it is not, and the graph
launches it back to back instead).

Layout: each CTA is one warpgroup and owns `rows_per_cta` consecutive output rows (query heads),
as one flat strided vector of rows_per_cta * D elements (1 row at D = 128 or 256, 2 at D = 64 or
192: a warpgroup vector needs a multiple of 128 elements). Its weights are scalars: every thread
reads the C log-sum-exps of its rows (scalar loads; the same addresses for all threads, so they
broadcast) and computes exp2(lse - max); the C part rows are loaded in the same burst. Everything
it reads was just written by the decode kernel and sits in L2.

Attention sinks (gpt-oss) join here when the decode kernel splits: a row's sink logit (log2 units)
is one more term of the denominator, with no part of its own."""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
import numpy as np

from pallas_kernels.attention.paged_decode_common import NEG_INF, DecodeShape

_WARPGROUP = 128
_LSE_WIDTH = 64  # the decode kernel's lse row per item: its 64-row wgmma tile
_LOG2E = math.log2(math.e)


def _combine_kernel(lse_ref, o_ref, *refs, num_splits: int, rows: int, head_dim: int,
                    group: int, lse_width: int, q_padded: bool, rows_per_cta: int, pdl: bool,
                    num_q_heads: int | None):
    sink_ref, out_ref = refs if num_q_heads else (None, *refs)
    d, g = head_dim, group
    n = rows_per_cta * d
    per_thread = n // _WARPGROUP
    vec = math.gcd(per_thread, 4)  # contiguous elements per access: up to 16 bytes, dividing it
    layout = plgpu.Layout.WG_STRIDED((n,), vec_size=vec)
    first = lax.axis_index("cta") * rows_per_cta
    if pdl:
        plgpu.griddepcontrol_wait()  # the parts come from the decode kernel just before

    def lse_of(row):
        """The row's C split log-sum-exps (scalar loads), and its sink logit (or None)."""
        row = jnp.minimum(row, rows - 1)  # padding rows read the last row's log-sum-exps
        item, i = row // g, lax.rem(row, g)
        r0 = 0 if q_padded else lax.rem(item * g, 8)  # where the decode kernel put the item's rows
        idx = item * lse_width + r0 + i
        sink = None if sink_ref is None else sink_ref[lax.rem(row, num_q_heads)]
        return [lse_ref[c, idx] for c in range(num_splits)], sink

    # Every load is issued before any arithmetic, so the CTA pays one L2 round trip, not two.
    lses = [lse_of(first + r) for r in range(rows_per_cta)]
    parts = [plgpu.load(o_ref.at[c, pl.ds(first * d, n)], layout=layout)
             for c in range(num_splits)]

    def weights(lse, sink):
        """-> the C split weights exp2(lse_c - max), and their sum (with the sink's term)."""
        m = functools.reduce(jnp.maximum, lse)  # an all-empty row: every weight 1, parts 0
        if sink is not None:
            m = jnp.maximum(m, sink)
        w = [jnp.exp2(x - m) for x in lse]
        return w, functools.reduce(lax.add, w + ([] if sink is None else [jnp.exp2(sink - m)]))

    per_row = [weights(*lse) for lse in lses]
    if rows_per_cta == 1:
        (scale, total), = per_row
        inv = 1.0 / total
    else:  # per-element weights: element e belongs to row e // d of the CTA's rows
        row_of = plgpu.broadcasted_iota(jnp.int32, (n,), 0, layout=layout) // d

        def pick(values):
            out = values[0]
            for r in range(1, rows_per_cta):
                out = jnp.where(row_of == r, values[r], out)
            return out
        scale = [pick([per_row[r][0][c] for r in range(rows_per_cta)]) for c in range(num_splits)]
        inv = pick([1.0 / t for _, t in per_row])
    acc = functools.reduce(lax.add, [part * w for part, w in zip(parts, scale)])
    out_ref[pl.ds(first * d, n)] = (acc * inv).astype(out_ref.dtype)


def combine_split_parts(o, lse, *, group: int, q_padded: bool, dtype, pdl: bool = True,
                        sinks: jax.Array | None = None, interpret: bool = False) -> jax.Array:
    """o: [C, R, D] fp32 normalised parts (R = S * Hq rows); lse: [C, items, W] fp32 log2-domain
    log-sum-exps, the rows of item k's query heads at k * W + r0 + i (r0 as in the decode
    kernel); sinks: [Hq] fp32 logits in log2 units (row r's is sinks[r % Hq]), or None.
    Returns [R, D] in `dtype`."""
    c, rows, d = o.shape
    rows_per_cta = _WARPGROUP // math.gcd(d, _WARPGROUP)  # fewest rows filling whole warpgroups
    padded = -(-rows // rows_per_cta) * rows_per_cta
    if padded != rows:  # e.g. odd rows at D = 64: garbage rows, computed and sliced off
        o = jnp.pad(o, ((0, 0), (0, padded - rows), (0, 0)))
    kernel = functools.partial(
        _combine_kernel, num_splits=c, rows=rows, head_dim=d, group=group, lse_width=lse.shape[-1],
        q_padded=q_padded, rows_per_cta=rows_per_cta, pdl=pdl and not interpret,
        num_q_heads=None if sinks is None else sinks.shape[0])
    out = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((padded * d,), dtype),
        grid=(padded // rows_per_cta,),
        grid_names=("cta",),
        kernel_name="split_combine",  # what profiles show
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=plgpu.InterpretGPUParams() if interpret else False,
    )(lse.reshape(c, -1), o.reshape(c, padded * d),
      *(() if sinks is None else (sinks.astype(jnp.float32),)))
    return out.reshape(padded, d)[:rows]


@dataclasses.dataclass(frozen=True)
class DecodeLaunch:
    """What `mosaic_decode_call` decided: the split plan and the q tile geometry."""
    shape: DecodeShape
    num_splits: int
    q_padded: bool  # q passed as [S * Hkv * Gp, D] (else [S * Hq, D], tiles at r0 = base % 8)


def sink_rows(sinks: jax.Array, shape: DecodeShape, q_padded: bool) -> jax.Array:
    """The one-split decode kernel's sinks: [S * Hkv, 64] fp32, item k's q tile row r0 + i holding
    its query head i's sink in log2 units (r0 as for the lse rows), other rows NEG_INF (no term)."""
    g, hkv = shape.group, shape.num_kv_heads
    items = np.arange(shape.num_seqs * hkv)
    r0 = np.zeros_like(items) if q_padded else (items * g) % 8
    head = np.full((items.size, _LSE_WIDTH), -1)
    for i in range(g):
        head[items, r0 + i] = (items % hkv) * g + i
    table = (sinks.astype(jnp.float32) * _LOG2E)[np.maximum(head, 0)]
    return jnp.where(jnp.asarray(head >= 0), table, NEG_INF)


def combine_parts_xla(o, lse, launch: DecodeLaunch, sinks: jax.Array | None = None) -> jax.Array:
    """Merge the normalised per-split parts: weights softmax(lse) over the splits (and the rows'
    sinks, [Hq] log2 units, as weightless extra terms). The rows of each item's lse that belong
    to its query heads are picked with a static index."""
    shape = launch.shape
    g, hkv = shape.group, shape.num_kv_heads
    rows = np.arange(shape.num_seqs * shape.num_q_heads)
    r0 = 0 if launch.q_padded else ((rows // g) * g) % 8  # as in the kernel
    idx = (rows // g) * _LSE_WIDTH + r0 + rows % g
    lse = lse.reshape(launch.num_splits, shape.num_seqs * hkv * _LSE_WIDTH)[:, idx]
    m = lse.max(axis=0)
    if sinks is not None:
        sink = jnp.tile(sinks.astype(jnp.float32), shape.num_seqs)
        m = jnp.maximum(m, sink)
    w = jnp.exp2(lse - m)  # an all-empty row: every weight 1, o 0
    total = w.sum(axis=0) + (0.0 if sinks is None else jnp.exp2(sink - m))
    return (w[..., None] * o).sum(axis=0) / total[:, None]
