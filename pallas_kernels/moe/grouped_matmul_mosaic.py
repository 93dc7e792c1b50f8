"""Grouped matmul for routed experts on Hopper in Mosaic GPU: TMA + wgmma, tiles walking the groups.

`out[r] = x[r] @ w[g(r)]` for rows sorted by group (expert), `group_sizes[e]` rows per group. The
rows are cut into *tiles*: block_m-row windows of one group, the first starting at the 8-row
boundary at or before the group's first row (a group that fits one window is one tile, an empty
group none), so each expert's weights are streamed once per tile and, at decode (groups of a few
rows), once per step. A *work unit* is one (tile, N block) pair and one CTA per SM walks the units
(`plgpu.nd_loop`). A unit streams its expert's K x block_n weight panel and the tile's window of x
through a `stages`-deep TMA ring and accumulates with wgmma; window rows outside the tile's group
are computed and dropped.

Tile table row (int32[4], built by `tile_table` outside the kernel): group, row0 (first row of
the tile), load0 // 8 (first row of the block_m-row window TMA loads, clamped so the window stays
inside x, so x is never padded beyond a multiple of 8 rows), n_rows (0 = no tile, skip).

Outputs go through shared memory and out as TMA stores of exactly the tile's rows: n_rows is only
known at run time and a TMA box is static, so the rows are stored as a ladder of power-of-two boxes
(block_m, block_m / 2, ..., 1 rows), each predicated on its bit of n_rows; no unit ever writes a
row of another group.

`fuse_swiglu`: two weight stacks (gate, up) share the x tile and the output is silu(x @ w_gate) *
(x @ w_up), computed in float32 from the accumulators; the intermediate never touches HBM.

CPU tests run the kernel in Mosaic GPU's interpreter (`interpret=True`) and lower it for CUDA; the
H200 checks it at real sizes in `jaxinfer/bench/suites/moe.py`.
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


@dataclasses.dataclass(frozen=True)
class GmmConfig:
    """block_m: rows per tile (wgmma's M: 64 or 128); block_n: output columns per unit; block_k:
    the K step of the TMA ring; stages: ring depth; num_ctas: persistent CTAs (0 = one per SM)."""
    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    stages: int = 4
    num_ctas: int = 0

    def __post_init__(self):
        if self.block_m not in (64, 128):
            raise ValueError(f"block_m={self.block_m}: must be 64 or 128")
        if self.block_n % 64 or not 64 <= self.block_n <= 256:
            raise ValueError(f"block_n={self.block_n}: must be 64, 128, 192 or 256")
        check_ring(self)

    def smem_bytes(self, num_weights: int) -> int:
        return ring_smem_bytes(self, num_weights)

    def check(self, num_weights: int, weight_itemsize: int = 2) -> None:
        if weight_itemsize != 2:
            raise ValueError(f"{self}: the one-warpgroup kernel takes 16-bit weights")
        check_smem(self, num_weights)
        if num_weights * self.block_m * self.block_n > 128 * 128:
            raise ValueError(f"{self}: {num_weights} float32 accumulator(s) of block_m x block_n "
                             f"exceed one warpgroup's registers (at most 128 x 128 in all)")


def check_ring(cfg) -> None:
    """The K step and depth of a config's TMA ring (either kernel's)."""
    if cfg.block_k not in (32, 64, 128):
        raise ValueError(f"block_k={cfg.block_k}: must be 32, 64 or 128")
    if cfg.stages < 2:
        raise ValueError(f"stages={cfg.stages}: must be at least 2")


def ring_smem_bytes(cfg, num_weights: int, itemsize: int = 2) -> int:
    """Shared memory of either kernel: the TMA ring (x window + weight panels per stage) plus the
    block_m x block_n output staging."""
    stage = cfg.block_m * cfg.block_k + num_weights * cfg.block_k * cfg.block_n
    return itemsize * (cfg.stages * stage + cfg.block_m * cfg.block_n)


def check_smem(cfg, num_weights: int) -> None:
    if ring_smem_bytes(cfg, num_weights) > SMEM_LIMIT:
        raise ValueError(f"{cfg} needs {ring_smem_bytes(cfg, num_weights)} bytes of shared memory "
                         f"with {num_weights} weight stack(s); the limit is {SMEM_LIMIT}")


def num_tiles(rows: int, groups: int, block_m: int) -> int:
    """Static bound on the tiles of any split of `rows` into `groups`: a group of s rows starting r
    rows past an 8-row boundary takes ceil((s + r) / block_m) <= (s + 6 + block_m) / block_m."""
    return (rows + groups * (block_m + 6)) // block_m


def tile_table(group_sizes: jax.Array, rows: int, block_m: int) -> jax.Array:
    """int32[num_tiles, 4] rows (group, row0, load0 // 8, n_rows) in row order; unused rows have
    n_rows 0. A group's tiles are block_m-row windows starting at the 8-row boundary at or before
    its first row (TMA loads into tiled shared memory start on 8-row boundaries), so a group of up
    to block_m - 7 rows is one tile and its expert's weights are streamed once. rows must be a
    multiple of 8 and at least block_m. Built with a compare-and-sum per tile (no sort, no loop)."""
    sizes = group_sizes.astype(jnp.int32)
    g = sizes.shape[0]
    nt = num_tiles(rows, g, block_m)
    start = jnp.cumsum(sizes) - sizes
    end = start + sizes
    base = start // 8 * 8
    tiles_per_group = jnp.where(sizes > 0, (end - base + block_m - 1) // block_m, 0)
    tile_end = jnp.cumsum(tiles_per_group)               # first tile index after group e
    t = jnp.arange(nt, dtype=jnp.int32)
    group = jnp.minimum(jnp.sum(tile_end[None, :] <= t[:, None], axis=1), g - 1).astype(jnp.int32)
    window = base[group] + (t - (tile_end[group] - tiles_per_group[group])) * block_m
    row0 = jnp.maximum(start[group], window)
    row_end = jnp.minimum(end[group], window + block_m)
    n_rows = jnp.where(t < tile_end[-1], jnp.maximum(row_end - row0, 0), 0)
    # rows is a multiple of 8, so the window clamped inside x still starts on an 8-row boundary
    # and still holds the tile's rows.
    load0 = jnp.minimum(window, rows - block_m)
    return jnp.stack([group, row0, load0 // 8, n_rows], axis=1).astype(jnp.int32)


def check_inputs(x, weights, group_sizes, block_k: int, block_n: int,
                 weight_dtype=None) -> tuple[int, int]:
    """Validate x [M, K] (16-bit), 1 or 2 weight stacks [G, K, N] of `weight_dtype` (default x's)
    and group_sizes [G] against the tiling's K step and N block; returns (G, N)."""
    m, k = x.shape
    if len(weights) not in (1, 2):
        raise ValueError(f"weights: expected 1 (plain) or 2 (gate, up) stacks, got {len(weights)}")
    g, k2, n = weights[0].shape
    weight_dtype = jnp.dtype(weight_dtype or x.dtype)
    for w in weights:
        if w.shape != (g, k, n) or w.dtype != weight_dtype:
            raise ValueError(f"weights: {w.shape} {w.dtype} does not match x {x.shape}, "
                             f"{(g, k2, n)} and {weight_dtype}")
    if group_sizes.shape != (g,):
        raise ValueError(f"group_sizes: shape {group_sizes.shape}, expected ({g},)")
    if jnp.dtype(x.dtype).itemsize != 2:
        raise ValueError(f"x: dtype {x.dtype}; the kernel takes 16-bit inputs")
    if k % block_k or n % block_n:
        raise ValueError(f"K={k} / N={n} must be multiples of block_k={block_k} / "
                         f"block_n={block_n}")
    return g, n


def padded_rows(m: int, block_m: int) -> int:
    """The rows the kernels see: a multiple of 8 and at least block_m (load windows start on 8-row
    boundaries inside x)."""
    return max(-(-m // 8) * 8, block_m)


def pad_rows(x: jax.Array, block_m: int) -> tuple[jax.Array, int]:
    """x padded to `padded_rows`, and that row count."""
    m = x.shape[0]
    rows = padded_rows(m, block_m)
    return (jnp.pad(x, ((0, rows - m), (0, 0))) if rows > m else x), rows


def store_rows(o_smem, o_ref, src, dst, n_rows, box: int, cols) -> None:
    """TMA-store rows src .. src + n_rows of o_smem to rows dst .. of o_ref (columns `cols`) as a
    static ladder of boxes (box, box / 2, ..., 1 rows), each issued iff its bit is in n_rows
    (n_rows < 2 * box): a TMA box is static, n_rows is known at run time only."""
    size = box
    while size:
        @pl.when((n_rows & size) != 0)
        def _(size=size, src=src, dst=dst):
            plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(src, size)], o_ref.at[pl.ds(dst, size), cols])

        src = src + (n_rows & size)
        dst = dst + (n_rows & size)
        size //= 2


def plan(x, weights, group_sizes, cfg, table, weight_dtype=None):
    """What both kernels set up before launching: the checks, x padded (`pad_rows`), the tile
    table (the caller's, or built here), N, the (tile, N block) work units and the persistent
    CTAs. Returns (x, table, n, units, num_ctas)."""
    _, n = check_inputs(x, weights, group_sizes, cfg.block_k, cfg.block_n, weight_dtype)
    cfg.check(len(weights), jnp.dtype(weight_dtype or x.dtype).itemsize)
    x, rows = pad_rows(x, cfg.block_m)
    if table is None:
        table = tile_table(group_sizes, rows, cfg.block_m)
    units = table.shape[0] * (n // cfg.block_n)
    return x, table, n, units, min(units, cfg.num_ctas or num_sms())


def unit_of(table_ref, idx, nb: int):
    """Work unit idx (tile-major over nb N blocks): (N block, group, first row, first row of the
    load window, rows)."""
    tile, ni = lax.div(idx, jnp.int32(nb)), lax.rem(idx, jnp.int32(nb))
    load0 = table_ref[tile, 2] * 8  # a product: 8-aligned, as TMA windows need
    return ni, table_ref[tile, 0], table_ref[tile, 1], load0, table_ref[tile, 3]


def silu_mul(gate, up):
    return gate / (1.0 + jnp.exp(-gate)) * up


# A jit of its own: a model calls the kernel once per layer with the same shapes, and jax lowers a
# nested jit of one jaxpr once per module, so the Mosaic lowering is paid once, not once per layer.
@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def grouped_matmul_mosaic(x: jax.Array, weights: tuple[jax.Array, ...], group_sizes: jax.Array, *,
                          config: GmmConfig = GmmConfig(), interpret: bool = False,
                          table: jax.Array | None = None) -> jax.Array:
    """x: [M, K] rows sorted by group; weights: (w,) with w [G, K, N], or (w_gate, w_up) for the
    fused SwiGLU; group_sizes: int32[G] summing to at most M. Returns [M, N] in x's dtype; rows past
    sum(group_sizes) are left unwritten (undefined). table: `tile_table(group_sizes,
    padded_rows(M, block_m), block_m)` when the caller shares one between calls."""
    cfg = config
    m, k = x.shape
    x, table, n, units, num_ctas = plan(x, weights, group_sizes, cfg, table)
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    nb = n // bn
    fused = len(weights) == 2
    dtype = x.dtype

    def body(table_ref, x_ref, *refs):
        w_refs, o_ref = refs[:-1], refs[-1]

        @plgpu.nd_loop((units,), collective_axes="cta")
        def _unit(loop_info):
            ni, group, row0, load0, n_rows = unit_of(table_ref, loop_info.index[0], nb)

            @pl.when(n_rows > 0)
            def _():
                def acc_scope(*accs):
                    def step(_, x_smem, *w_smem):
                        for acc, w in zip(accs, w_smem):
                            plgpu.wgmma(acc, x_smem, w)

                    plgpu.emit_pipeline(
                        step, grid=(k // bk,),
                        in_specs=[plgpu.BlockSpec((bm, bk), lambda kk: (0, kk), delay_release=1)]
                        + [plgpu.BlockSpec((bk, bn), lambda kk: (kk, ni), delay_release=1)]
                        * len(w_refs),
                        max_concurrent_steps=cfg.stages,
                    )(x_ref.at[pl.ds(load0, bm)], *(w.at[group] for w in w_refs))
                    return tuple(acc[...] for acc in accs)

                accs = pl.run_scoped(acc_scope, *[plgpu.ACC((bm, bn))] * len(w_refs))
                out = silu_mul(*accs) if fused else accs[0]

                def store(o_smem):
                    o_smem[...] = out.astype(dtype)
                    plgpu.commit_smem()
                    store_rows(o_smem, o_ref, row0 - load0, row0, n_rows, bm, pl.ds(ni * bn, bn))
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

                pl.run_scoped(store, plgpu.SMEM((bm, bn), dtype))

    return launch(body, x, weights, table, m, n, num_ctas, "grouped_matmul", interpret)


def launch(body, x, weights, table, m: int, n: int, num_ctas: int, name: str, interpret: bool,
           scales: tuple = (), out_dtype=None, **threads) -> jax.Array:
    """Run either kernel's body(table, x, *weights, *scales, out) on `num_ctas` persistent CTAs
    (`threads`: the warp-specialised kernel's warpgroups); the output (in `out_dtype`, default x's)
    has its rows past m (padding) cut."""
    rows = x.shape[0]
    out = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((rows, n), out_dtype or x.dtype),
        grid=(num_ctas,),
        grid_names=("cta",),
        kernel_name=name + ("_fp8" if scales else "") + ("_swiglu" if len(weights) == 2 else ""),
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Warpgroup, approx_math=True),
        interpret=plgpu.InterpretGPUParams() if interpret else False,
        **threads,
    )(table, x, *weights, *scales)
    return out[:m] if rows > m else out
