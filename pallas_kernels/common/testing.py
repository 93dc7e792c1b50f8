"""Random inputs for the kernels' tests and benchmarks (one generator, so both exercise the same
kind of batch)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def random_paged_batch(rng: np.random.Generator, *, hq: int, hkv: int, d: int, block_size: int,
                       q_lens: list[int], prefixes: list[int], dtype=jnp.bfloat16,
                       extra_tokens: int = 0, spare_blocks: int = 5) -> tuple:
    """A ragged prefill batch over a shuffled paged cache: sequence s has prefixes[s] tokens already
    cached and q_lens[s] new ones; `extra_tokens` padding tokens follow the last sequence.
    Returns the prefill arguments (q, k_cache, v_cache, query_start_loc, seq_lens, block_tables)."""
    s = len(q_lens)
    ctx = [a + b for a, b in zip(q_lens, prefixes)]
    m = max(-(-c // block_size) for c in ctx) + 1
    nb = s * m + spare_blocks
    tables = rng.permutation(nb)[: s * m].reshape(s, m).astype(np.int32)
    ks = jax.random.split(jax.random.key(int(rng.integers(1 << 30))), 3)

    def normal(key, shape):
        return jax.random.normal(key, shape, jnp.float32).astype(dtype)

    k_cache = normal(ks[0], (hkv, nb, block_size, d))
    v_cache = normal(ks[1], (hkv, nb, block_size, d))
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q = normal(ks[2], (int(qsl[-1]) + extra_tokens, hq, d))
    return q, k_cache, v_cache, jnp.asarray(qsl), jnp.asarray(ctx, jnp.int32), jnp.asarray(tables)


def ragged_group_sizes(rng: np.random.Generator, groups: int, total: int, kind: str) -> np.ndarray:
    """Group sizes (rows per expert) summing to `total`: "random" cuts with a third of the groups
    emptied (their rows dropped, so the sum may be less), or "hot": every row in one group."""
    if kind == "hot":
        sizes = np.zeros(groups, np.int64)
        sizes[rng.integers(groups)] = total
        return sizes
    cuts = np.sort(rng.integers(0, total + 1, groups - 1))
    sizes = np.diff(np.concatenate([[0], cuts, [total]]))
    sizes[rng.choice(groups, max(1, groups // 3), replace=False)] = 0  # empty experts
    return sizes


def random_ragged_batch(rng: np.random.Generator, lens: list[int], num_slots: int, *,
                        extra_tokens: int = 0, dead: int = 0) -> tuple:
    """A ragged batch for the recurrent-layer kernels (pallas_kernels/ssm/batch.py): sequences
    of `lens` tokens packed in order, `extra_tokens` padding tokens after them, each live sequence
    in its own random slot of `num_slots`, the last `dead` sequences marked padding (slot -1), and
    a random half continuing from their slot (has_initial_state). Returns (num_tokens,
    cu_seqlens, slots, has_initial_state) with jnp arrays."""
    s = len(lens)
    if s - dead > num_slots:
        raise ValueError(f"{s - dead} live sequences do not fit {num_slots} slots")
    slots = rng.permutation(num_slots)[:s].astype(np.int32)
    slots[s - dead:] = -1
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    init = rng.random(s) < 0.5
    return (int(cu[-1]) + extra_tokens, jnp.asarray(cu), jnp.asarray(slots), jnp.asarray(init))
