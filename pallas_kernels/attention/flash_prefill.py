"""Flash-attention prefill: ragged batches over the paged KV cache, and dense batched attention.

Public entry points (both Mosaic GPU, Hopper only; `flash_mgpu.py` holds the kernel):
  - `flash_prefill_mosaic` has the backend's `prefill` signature (see `backend.py`): sequence s owns
    tokens query_start_loc[s]:query_start_loc[s+1], the last tokens of its seq_lens[s]-token context;
    every key (cached prefix and the new tokens, already written by `write_kv`) is read through the
    block table. Tokens past query_start_loc[-1] get zeros.
  - `flash_attention(q[B,L,Hq,D], k[B,L,Hkv,D], v, *, causal, scale, softcap)`: dense attention,
    the same kernel with K/V read from contiguous memory (benchmarks, training-shaped inputs).
  - `flash_prefill_triton`: the same ragged paged prefill as a Triton-lowered `pallas_call`
    (`flash_triton.py`), the portable path for non-Hopper CUDA GPUs.

Work decomposition: the flat token axis is cut into *query tiles* of TILE_Q = 128 rows that never
cross a sequence boundary, described by an int32 table built here with a few jnp ops (cheap, on the
device, inside the caller's jit). The kernel's work is Hq x NT (tile, head) items with the static
bound NT = cdiv(T + 7(S+1), TILE_Q) + S + 1 (each sequence wastes at most one partial tile and < 8
alignment rows; the +1 is the tail of padding tokens, a pseudo-sequence with no keys whose rows
come out as zeros). Tiles are
ordered by decreasing number of K/V steps so the longest causal tiles start first (less tail).

Sliding window (paged entry points): a tile's K/V loop starts at the block holding the first key its
first row sees, so pages wholly before the window are never read; sinks join the final 1 / l
(docs/kernels/attention_variants.md).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.attention import flash_mgpu, flash_triton
from pallas_kernels.attention.flash_config import TILE_Q, KernelConfig
from pallas_kernels.attention.kv_quant import is_fp8
from pallas_kernels.attention.mgpu_fp8 import compute_dtype
from pallas_kernels.attention.reference import check_window

SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
SUPPORTED_HEAD_DIMS = (64, 128)


def tile_table(starts: jax.Array, q_lens: jax.Array, ctx_lens: jax.Array, kv_ref: jax.Array,
               num_tokens: int, *, causal: bool, window: int | None = None) -> jax.Array:
    """int32[NT, 6] rows (row0 // 8, lead, n_rows, q_pos0, ctx_len, kv_ref) — see `flash_mgpu` —
    for every query tile of the ragged batch, longest first; unused rows have n_rows == 0.

    Sequence s owns flat tokens starts[s] .. starts[s] + q_lens[s], the last q_lens[s] of its
    ctx_lens[s]-token context; kv_ref[s] is what the kernel needs to find its keys (block-table row,
    or flat row // 8 of its first key for contiguous K/V). Tokens from the end of the last sequence to
    num_tokens form a pseudo-sequence with no keys (zeros out).

    Tiles start at a multiple of 8 rows (Mosaic GPU's tiled TMA needs provably 8-aligned offsets):
    a sequence's first tile starts at starts[s] rounded down, and its `lead` rows (< 8, belonging to
    the previous sequence) are computed but never stored."""
    s = q_lens.shape[0]
    i32 = lambda x: jnp.asarray(x, jnp.int32)
    end = i32(starts[-1] + q_lens[-1]) if s else jnp.int32(0)
    start = jnp.concatenate([i32(starts), end[None]])
    q_len = jnp.concatenate([i32(q_lens), (num_tokens - end)[None]])
    ctx = jnp.concatenate([i32(ctx_lens), jnp.zeros((1,), jnp.int32)])
    kv = jnp.concatenate([i32(kv_ref), jnp.zeros((1,), jnp.int32)])
    lead = start % 8
    n_tiles = jnp.where(q_len > 0, (q_len + lead + TILE_Q - 1) // TILE_Q, 0)
    ends = jnp.cumsum(n_tiles)
    num = -(-(num_tokens + 7 * (s + 1)) // TILE_Q) + s + 1  # >= sum(n_tiles) for any batch
    i = jnp.arange(num, dtype=jnp.int32)
    # compare_all: one fused compare, not the default scan's while loop (XLA's GPU while loop reads
    # its predicate back to the host each iteration unless it runs as a CUDA-graph conditional).
    seq = jnp.minimum(jnp.searchsorted(ends, i, side="right", method="compare_all"), s)
    k = i - (ends[seq] - n_tiles[seq])                      # tile index within its sequence
    row0 = start[seq] - lead[seq] + k * TILE_Q
    tile_lead = jnp.where(k == 0, lead[seq], 0)
    n_rows = jnp.minimum(start[seq] + q_len[seq], row0 + TILE_Q) - (row0 + tile_lead)
    n_rows = jnp.where(i < ends[-1], jnp.clip(n_rows, 0, TILE_Q), 0)
    q_pos0 = jnp.where(ctx[seq] > 0, ctx[seq] - q_len[seq] + (row0 - start[seq]), 0)
    visible = jnp.minimum(ctx[seq], q_pos0 + TILE_Q) if causal else ctx[seq]
    if window is not None:  # the keys before the first row's window are skipped
        visible = visible - jnp.maximum(q_pos0 - window + 1, 0)
    order = jnp.argsort(jnp.where(n_rows > 0, -visible, 1), stable=True)
    table = jnp.stack([row0 // 8, tile_lead, n_rows, q_pos0, ctx[seq], kv[seq]], axis=1)
    return table[order].astype(jnp.int32)


def _check_q(q: jax.Array, hkv: int, name: str) -> None:
    if jnp.dtype(q.dtype) not in SUPPORTED_DTYPES:
        raise ValueError(f"{name}.dtype={q.dtype}: the Mosaic GPU flash kernel takes bfloat16 or float16")
    if q.shape[-1] not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head_dim={q.shape[-1]} not in {SUPPORTED_HEAD_DIMS}")
    if q.shape[-2] % hkv:
        raise ValueError(f"num_q_heads={q.shape[-2]} is not a multiple of num_kv_heads={hkv}")


def _check_softcap(softcap: float | None) -> None:
    if softcap is not None and softcap < 0:
        raise ValueError(f"softcap={softcap} must be positive (or None/0 for no soft-cap)")


def _ragged_inputs(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, softcap,
                   window, sinks, extra_rows: int, block_kv: int):
    """Validate the prefill arguments; pad q's token axis to a multiple of 8 plus `extra_rows` and
    build the tile table. Returns (padded q, tiles)."""
    t, hq, d = q.shape
    hkv, _, block_size, dk = k_cache.shape
    _check_q(q, hkv, "q")
    _check_softcap(softcap)
    check_window(window)
    if sinks is not None and sinks.shape != (hq,):
        raise ValueError(f"sinks must be [num_q_heads={hq}], got {sinks.shape}")
    if k_cache.shape != v_cache.shape or dk != d:
        raise ValueError(f"k_cache {k_cache.shape} / v_cache {v_cache.shape} do not match q {q.shape}")
    if v_cache.dtype != k_cache.dtype or not (k_cache.dtype == q.dtype or is_fp8(k_cache.dtype)):
        raise ValueError(f"cache dtype {k_cache.dtype} must equal q.dtype {q.dtype} or be fp8")
    if block_kv % block_size:
        raise ValueError(f"block_size={block_size} must divide the kernel's block_kv={block_kv}")
    s = seq_lens.shape[0]
    if query_start_loc.shape != (s + 1,) or block_tables.shape[0] != s:
        raise ValueError(f"query_start_loc {query_start_loc.shape}, seq_lens {seq_lens.shape}, "
                         f"block_tables {block_tables.shape} disagree on the number of sequences")
    qsl = query_start_loc.astype(jnp.int32)
    # Mosaic GPU's tiled TMA views the token axis in 8-row tiles: pad T to a multiple of 8 (engine
    # buckets normally are, so this costs nothing there).
    tp = -(-t // 8) * 8
    tiles = tile_table(qsl[:-1], qsl[1:] - qsl[:-1], seq_lens, jnp.arange(s, dtype=jnp.int32), tp,
                       causal=True, window=window)
    tp += extra_rows
    qp = jnp.pad(q, ((0, tp - t), (0, 0), (0, 0))) if tp != t else q
    return qp.astype(compute_dtype(k_cache.dtype) if is_fp8(k_cache.dtype) else q.dtype), tiles


def flash_prefill_mosaic(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, *,
                         scale: float, softcap: float | None = None, window: int | None = None,
                         sinks: jax.Array | None = None, config: KernelConfig = KernelConfig(),
                         interpret: bool = False):
    """Ragged causal prefill over the paged cache (the backend's `prefill`): [T, Hq, D] -> [T, Hq, D].
    `config`: the kernel's tuning (the default is the production kernel). `interpret`: Mosaic GPU's
    interpreter (CPU tests; see `flash_mgpu.mosaic_attention`)."""
    t = q.shape[0]
    qp, tiles = _ragged_inputs(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables,
                               softcap, window, sinks, extra_rows=0, block_kv=config.block_kv)
    out = flash_mgpu.mosaic_attention(qp, k_cache, v_cache, tiles, block_tables.astype(jnp.int32),
                                      kv_mode="paged", causal=True, scale=scale, softcap=softcap,
                                      window=window, sinks=sinks, config=config,
                                      interpret=interpret)
    return out[:t].astype(q.dtype)


def flash_prefill_triton(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, *,
                         scale: float, softcap: float | None = None, window: int | None = None,
                         sinks: jax.Array | None = None, interpret: bool = False):
    """The same ragged causal prefill as a Triton-lowered pallas_call (portable; CPU-interpretable).
    q is padded by one tile of rows so every tile's block of rows lies inside the array."""
    t = q.shape[0]
    qp, tiles = _ragged_inputs(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables,
                               softcap, window, sinks, extra_rows=TILE_Q,
                               block_kv=KernelConfig().block_kv)
    out = flash_triton.triton_paged_attention(qp, k_cache, v_cache, tiles,
                                              block_tables.astype(jnp.int32), scale=scale,
                                              softcap=softcap, window=window, sinks=sinks,
                                              interpret=interpret)
    return out[:t].astype(q.dtype)


def flash_attention(q, k, v, *, causal: bool = True, scale: float | None = None,
                    softcap: float | None = None, config: KernelConfig = KernelConfig(),
                    interpret: bool = False):
    """Dense attention. q: [B, L, Hq, D]; k, v: [B, L, Hkv, D] -> [B, L, Hq, D]. Any L (the ragged
    end of the last query/key tile is masked); GQA maps each query head to its KV head in the
    kernel's index arithmetic, K/V are never repeated. `config`, `interpret`: as in
    `flash_prefill_mosaic`."""
    b, l, hq, d = q.shape
    if k.shape != v.shape or k.shape[:2] != (b, l) or k.shape[3] != d:
        raise ValueError(f"k {k.shape} / v {v.shape} must be [B={b}, L={l}, Hkv, D={d}]")
    hkv = k.shape[2]
    _check_q(q, hkv, "q")
    _check_softcap(softcap)
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"k/v dtype {k.dtype}/{v.dtype} must equal q.dtype {q.dtype}")
    scale = d ** -0.5 if scale is None else scale
    # Sequences start at multiples of 8 rows (tile alignment, see tile_table): pad L if needed; the
    # padded keys lie past ctx_len = L and are masked, the padded rows are dropped.
    lp = -(-l // 8) * 8
    if lp != l:
        pad = ((0, 0), (0, lp - l), (0, 0), (0, 0))
        q, k, v = jnp.pad(q, pad), jnp.pad(k, pad), jnp.pad(v, pad)
    with jax.ensure_compile_time_eval():  # static shapes: the table is a constant of the program
        starts = jnp.arange(b, dtype=jnp.int32) * lp
        lens = jnp.full((b,), l, jnp.int32)
        tiles = tile_table(starts, lens, lens, starts // 8, b * lp, causal=causal)
    out = flash_mgpu.mosaic_attention(
        q.reshape(b * lp, hq, d), k.reshape(b * lp, hkv, d), v.reshape(b * lp, hkv, d), tiles,
        jnp.zeros((1, 1), jnp.int32), kv_mode="contiguous", causal=causal, scale=scale,
        softcap=softcap, config=config, interpret=interpret)
    return out.reshape(b, lp, hq, d)[:, :l]
