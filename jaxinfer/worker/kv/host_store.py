"""The host tier's bytes: host arrays of several blocks each, and the copies between them and the
device cache.

The bookkeeping (which prefix is in which slot, LRU, pins) is `jaxinfer/core/kv_cache/host_tier.py`;
the scheduler hands this store each step's `KVTransfers` (core/kv_loads.py), and `apply` makes
them before the step is dispatched, on the thread that dispatches steps (in the same order):

1. offloads, as *runs* (a released request's prefix: core/kv_cache/host_offload.py): each run is
   cut into power-of-two *pieces* (100 blocks: 64 + 32 + 4); one jitted gather per piece reads
   its blocks out of the cache into one device array `[n, layers, 2 (K, V), heads, block_size,
   head_dim]`, and one batched `jax.device_put` starts every piece's copy into host memory
   (`pinned_host` where the backend has it: DMA, while the steps run). Nothing waits. A slot then
   names (its piece's host array, row); a piece lives while any slot names it.
   *Why a block is never overwritten before its copy has read it:* the gather is dispatched before
   the step that writes into the reused block, and that step takes the cache donated. JAX orders
   executions on one device in dispatch order, and a donated buffer is only reused once every
   computation already enqueued that reads it has finished (PJRT waits for the buffer's usage
   events before handing its memory to the donating computation), so the gather always reads
   the old content (tests/test_kv_host_tier.py checks this with a donated overwrite dispatched
   right after the gather).
2. load cancels: drop a cancelled copy's device buffers.
3. load starts: one batched `jax.device_put` of every host piece the step's loads read, each piece
   once and whole (one large contiguous copy; rows a load does not need are skipped by its
   scatter); the buffers wait here, keyed by sequence id, until `landed()` sees them ready
   (`is_ready()`, no sync) and the scheduler sends the scatter. A timer thread waits on each
   step's batch only to time the copy itself (`copy_seconds`; seen-landed waits for the poll).
4. load scatters: one jitted scatter per piece a load read writes its rows into their device
   blocks, cache donated (in place), before the step that first reads them.

Why pieces: one host array per block made a restore one small copy per block (2 MiB at
Llama-3-8B shape), each with its own fixed cost: 22.9 GB/s where one pinned array of the same
bytes copies at 51 GB/s on an H200 (benchmarks/results/kv_tiers_h200.json). A prefix written
through at release comes back as the few pieces it went out as.

An fp8 cache copies its 1-byte elements as they are: its K/V scales are per layer and fixed for
the engine's life (kv_scales.py), so nothing per block travels with them. Under tensor
parallelism the cache's head axis is sharded: the gathered pieces keep that sharding, their host
copies too (`with_memory_kind`), so each device offloads and reloads its own heads.

Piece sizes are powers of two up to MAX_PIECE_BLOCKS (`piece_sizes`, shared with the tier's
bookkeeping, which evicts a piece as a whole), so a few shapes compile (warmup).

A further tier (local disk, a remote store) would sit behind the same four operations on slots:
see `KVTierStore` and docs/kv_cache.md.
"""

from __future__ import annotations

import functools
import queue
import threading
import time
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.core.kv_cache.host_tier import MAX_PIECE_BLOCKS, piece_sizes
from jaxinfer.errors import ConfigError
from jaxinfer.model.transformer import KVCache


class KVTierStore(Protocol):
    """What the engine needs of a tier below the device cache, slot-addressed like `HostKVStore`
    (the bookkeeping, HostTier, is the same for any tier). A disk or remote tier implements it
    with its own `landed` readiness (a file read or network fetch into pinned host memory, then
    the same device_put), not built yet."""

    def apply(self, kv_cache: KVCache, transfers) -> KVCache: ...

    def landed(self) -> list[str]: ...

    def wait_any(self) -> None: ...

    def drop(self) -> None: ...


@jax.jit
def _gather(kv_cache: KVCache, ids: jax.Array) -> jax.Array:
    """Blocks `ids` of every layer as one array [n, layers, 2, heads, block_size, head_dim]."""
    stacked = jnp.stack([jnp.stack((k[:, ids], v[:, ids])) for k, v in kv_cache])
    return jnp.moveaxis(stacked, 3, 0)


@functools.partial(jax.jit, donate_argnums=0)
def _scatter(kv_cache: KVCache, rows: jax.Array, ids: jax.Array) -> KVCache:
    """Row i of `rows` ([n, layers, 2, heads, block_size, head_dim]) into block ids[i] of every
    layer; ids[i] < 0: nowhere (a row the load does not need, or padding)."""
    stacked = jnp.moveaxis(rows, 0, 3)  # [layers, 2, heads, n, block_size, head_dim]
    num_blocks = kv_cache[0][0].shape[1]
    # Skipped rows go to distinct out-of-range blocks (dropped), so the indices stay unique.
    dst = jnp.where(ids < 0, num_blocks + jnp.arange(ids.shape[0]), ids)
    return tuple((k.at[:, dst].set(stacked[i, 0], mode="drop", unique_indices=True),
                  v.at[:, dst].set(stacked[i, 1], mode="drop", unique_indices=True))
                 for i, (k, v) in enumerate(kv_cache))


def host_memory_kind(device) -> str:
    """'pinned_host' where the device offers it (GPU, TPU, and jax's CPU client), else
    'unpinned_host'; ConfigError when the backend has no host memory space."""
    kinds = {m.kind for m in device.addressable_memories()}
    for kind in ("pinned_host", "unpinned_host"):
        if kind in kinds:
            return kind
    raise ConfigError(f"--kv-offload: the {device.platform} backend has no host memory space "
                      f"(memory kinds: {sorted(kinds)})")


class HostKVStore:
    """`num_slots` host blocks and the copies in flight; see the module docstring."""

    def __init__(self, num_slots: int, kv_cache: KVCache):
        self.num_slots = num_slots
        # slot -> (host array of a piece, row): a piece stays alive while any slot names it.
        self._slots: list[tuple[jax.Array, int] | None] = [None] * num_slots
        k = kv_cache[0][0]
        self.host_kind = host_memory_kind(next(iter(k.sharding.device_set)))
        num_layers = len(kv_cache)
        self.block_bytes = num_layers * 2 * k.nbytes // k.shape[1]
        # seq id -> (per loaded block (device array, row), dispatch time; -1 once seen landed).
        self._loads: dict[str, tuple[list[tuple[jax.Array, int]], float]] = {}
        # Counters for metrics and benchmarks.
        self.bytes_to_host = 0
        self.bytes_to_device = 0  # blocks loaded (what the loads needed)
        self.bytes_copied_to_device = 0  # whole pieces copied (>= bytes_to_device)
        self.host_copies = 0  # device_put calls' arrays, both ways
        self.load_seconds = 0.0  # dispatch -> seen landed, summed over loads
        self.loads_landed = 0
        # Per step's batched load copy, dispatch -> the copy done (a timer thread waits on it:
        # the copy's own time, where seen-landed is bounded below by the poll, once a step).
        self.copy_seconds: list[float] = []
        self._timer: queue.SimpleQueue | None = None
        self._recent_seconds: list[float] = []  # per landed load, until take_load_seconds

    def slot_array(self, slot: int) -> jax.Array | None:
        """The host array holding `slot`'s block (a piece of several blocks), or None."""
        entry = self._slots[slot]
        return None if entry is None else entry[0]

    def host_arrays(self) -> list[jax.Array]:
        """Every live host piece, once each."""
        return list({id(a): a for a, _ in filter(None, self._slots)}.values())

    # ---- the step's transfers -----------------------------------------------------------
    def apply(self, kv_cache: KVCache, transfers) -> KVCache:
        """Make a step's KVTransfers (dispatch only); the cache to run on (donated by scatters)."""
        if transfers.offloads:
            self._offload(kv_cache, transfers.offloads)
        for sid in transfers.load_cancels:
            self._loads.pop(sid, None)
        if transfers.load_starts:
            self._start_loads(transfers.load_starts)
        for sid, ids in transfers.load_scatters:
            rows, _ = self._loads.pop(sid)
            kv_cache = self._scatter_rows(kv_cache, rows, ids)
        return kv_cache

    def _offload(self, kv_cache: KVCache, runs: list[list[tuple[int, int]]]) -> None:
        """Each run (a prefix's consecutive blocks) as power-of-two pieces: one gather each into
        one device array, then one batched device_put of every piece to the host."""
        pieces, slots = [], []
        for run in runs:
            i = 0
            for size in piece_sizes(len(run)):
                chunk = run[i:i + size]
                i += size
                pieces.append(_gather(kv_cache, np.asarray([b for b, _ in chunk], np.int32)))
                slots.append([s for _, s in chunk])
        host = jax.device_put(pieces, [p.sharding.with_memory_kind(self.host_kind)
                                       for p in pieces])
        for array, piece_slots in zip(host, slots):
            for row, slot in enumerate(piece_slots):
                self._slots[slot] = (array, row)
            self.bytes_to_host += len(piece_slots) * self.block_bytes
        self.host_copies += len(host)

    def _start_loads(self, starts: list[tuple[str, list[int]]]) -> None:
        """One batched device_put of every host piece the step's loads read (each piece once,
        whole: a piece is one contiguous copy; rows a load does not need are skipped later)."""
        arrays: dict[int, jax.Array] = {}
        for _, slots in starts:
            for s in slots:
                array, _ = self._slots[s]
                arrays.setdefault(id(array), array)
        host = list(arrays.values())
        now = time.perf_counter()
        device = dict(zip(arrays, jax.device_put(
            host, [a.sharding.with_memory_kind("device") for a in host])))
        for sid, slots in starts:
            rows = [(device[id(self._slots[s][0])], self._slots[s][1]) for s in slots]
            self._loads[sid] = (rows, now)
            self.bytes_to_device += len(slots) * self.block_bytes
        self.bytes_copied_to_device += sum(a.shape[0] for a in host) * self.block_bytes
        self.host_copies += len(host)
        self._time_copy(list(device.values()), now)

    def _time_copy(self, arrays: list[jax.Array], t0: float) -> None:
        if self._timer is None:
            self._timer = queue.SimpleQueue()
            threading.Thread(target=self._copy_timer, args=(self._timer, self.copy_seconds),
                             name="jaxinfer-kv-load-timer", daemon=True).start()
        self._timer.put((arrays, t0))

    @staticmethod
    def _copy_timer(work: queue.SimpleQueue, seconds: list[float]) -> None:
        while True:
            arrays, t0 = work.get()
            try:
                jax.block_until_ready(arrays)
                seconds.append(time.perf_counter() - t0)
            except Exception:  # (a failed copy surfaces where its scatter uses it)
                pass
            del arrays  # (the buffers are the scatter's to free, not this thread's to keep)

    @staticmethod
    def _scatter_rows(kv_cache: KVCache, rows: list[tuple[jax.Array, int]],
                      ids: list[int]) -> KVCache:
        """A landed load into its device blocks: one scatter per piece it read."""
        dst: dict[int, tuple[jax.Array, np.ndarray]] = {}
        for (array, row), block in zip(rows, ids):
            entry = dst.get(id(array))
            if entry is None:
                entry = dst[id(array)] = (array, np.full(array.shape[0], -1, np.int32))
            entry[1][row] = block
        for array, to in dst.values():
            if (to >= 0).any():
                kv_cache = _scatter(kv_cache, array, to)
        return kv_cache

    def warmup(self, kv_cache: KVCache) -> KVCache:
        """Compile the gather and scatter of every piece size (the scatters write nowhere): the
        cache to run on."""
        n = 1
        while n <= MAX_PIECE_BLOCKS:
            rows = _gather(kv_cache, np.zeros(n, np.int32))
            kv_cache = _scatter(kv_cache, rows, np.full(n, -1, np.int32))
            n *= 2
        return jax.block_until_ready(kv_cache)

    # ---- readiness, polled by the engine -------------------------------------------------
    def landed(self) -> list[str]:
        """Sequences whose host -> device copy has landed (no sync); each is reported once."""
        out, now = [], time.perf_counter()
        for sid, (rows, t0) in self._loads.items():
            if t0 >= 0 and all(a.is_ready() for a, _ in rows):
                out.append(sid)
                self.load_seconds += now - t0
                self.loads_landed += 1
                self._recent_seconds.append(now - t0)
        for sid in out:  # (the buffers stay until the scatter takes them)
            self._loads[sid] = (self._loads[sid][0], -1.0)
        return out

    def take_load_seconds(self) -> list[float]:
        """Each load's copy time (dispatch -> seen landed) since the last call."""
        out, self._recent_seconds = self._recent_seconds, []
        return out

    @property
    def num_loading(self) -> int:
        return sum(t0 >= 0 for _, t0 in self._loads.values())

    def wait_any(self) -> None:
        """Block until some copy in flight lands (the engine has nothing else to run)."""
        pending = [[a for a, _ in rows] for rows, t0 in self._loads.values() if t0 >= 0]
        if pending:
            jax.block_until_ready(pending[0])

    def drop(self) -> None:
        """Forget every host block (the weights changed: their KV is stale)."""
        self._slots = [None] * self.num_slots
