"""The host tier's bytes: host arrays of several blocks each, and the copies between them and the
device cache.

The bookkeeping (which prefix is in which slot, LRU, pins) is `jaxinfer/core/kv_cache/host_tier.py`;
the scheduler hands this store each step's `KVTransfers` (core/kv_loads.py), and `apply` makes
them before the step is dispatched, on the thread that dispatches steps (in the same order):

1. offloads, as *runs* (a released request's prefix: core/kv_cache/host_offload.py): each run is
   cut into power-of-two *pieces* (100 blocks: 64 + 32 + 4); one jitted gather per piece reads its
   blocks out of the cache into one device array of a row per block (model/kv_block_rows.py: `[n,
   layers, heads, block_size, K and V widths]`), and a copier thread moves the pieces to host
   memory (`pinned_host` where the backend has it) once each gather has run. The step's thread
   never waits: a device -> host `device_put` of a piece not yet computed blocks its caller until
   the queued steps ahead of it have run (measured on the H200: 130-280 ms of dispatch at a time),
   which on the step's thread emptied the host/device overlap at every release. Until its copy is
   made a slot names its device piece, which a load then reads as it is. A slot names (its piece's
   array, row); a piece lives while any slot names it.
   *Why a block is never overwritten before its copy has read it:* the gather is dispatched before
   the step that writes into the reused block, and that step takes the cache donated. JAX orders
   executions on one device in dispatch order, and a donated buffer is only reused once every
   computation already enqueued that reads it has finished (PJRT waits for the buffer's usage
   events before handing its memory to the donating computation), so the gather always reads
   the old content (tests/test_kv_host_tier.py checks this with a donated overwrite dispatched
   right after the gather).
2. loads: one batched `jax.device_put` of every host piece the step's loads read (each piece once
   and whole: one large contiguous copy; rows no load needs are skipped by the scatter), then one
   jitted scatter per piece writes its rows into their device blocks, cache donated (in place),
   ahead of the step's forward (core/kv_loads.py: why not waited for apart). A timer thread waits
   on each step's batch only to time the copy (`copy_seconds`: dispatch to done, which includes
   the compute queued ahead of it).

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

import queue
import threading
import time
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.core.kv_cache.host_tier import MAX_PIECE_BLOCKS, piece_sizes
from jaxinfer.errors import ConfigError
from jaxinfer.model.kv_block_rows import gather_rows, row_bytes, scatter_rows
from jaxinfer.model.transformer import KVCache


class KVTierStore(Protocol):
    """What the engine needs of a tier below the device cache, slot-addressed like `HostKVStore`
    (the bookkeeping, HostTier, is the same for any tier). A disk or remote tier implements it
    with its reads into pinned host memory made ahead (a load is planned only for blocks the
    tier holds; a slow tier would prefetch on a host match and let the sequence wait for the
    fetch before its step), then the same device_put; not built yet."""

    def apply(self, kv_cache: KVCache, transfers) -> KVCache: ...

    def flush(self) -> None: ...

    def drop(self) -> None: ...


_gather = jax.jit(gather_rows)
_scatter = jax.jit(scatter_rows, donate_argnums=0)


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
    """`num_slots` host blocks and the copies to and from them; see the module docstring."""

    def __init__(self, num_slots: int, kv_cache: KVCache):
        self.num_slots = num_slots
        # slot -> (a piece's array, row): the device piece until the copier has made its host
        # copy, then the host array. A piece stays alive while any slot names it.
        self._slots: list[tuple[jax.Array, int] | None] = [None] * num_slots
        self._lock = threading.Lock()  # _slots: the copier swaps entries the step's thread sets
        k = kv_cache[0][0]
        self._devices = sorted(k.sharding.device_set, key=lambda d: d.id)
        self.host_kind = host_memory_kind(self._devices[0])
        self.block_bytes = row_bytes(kv_cache)
        # Counters for metrics and benchmarks.
        self.bytes_to_host = 0
        self.bytes_to_device = 0  # blocks loaded (what the loads needed)
        self.bytes_copied_to_device = 0  # whole host pieces copied (>= bytes_to_device)
        self.host_copies = 0  # device_put calls' arrays, both ways
        # Per step's batched load copy, dispatch -> the copy done (a timer thread waits on it).
        self.copy_seconds: list[float] = []
        self._timed = 0  # copy_seconds already taken by take_copy_seconds
        self._timer: queue.SimpleQueue | None = None
        self._copier: queue.Queue | None = None

    def reserve(self) -> float:
        """Pin the tier's host memory now, by allocating it and letting it go; the seconds taken.
        The runtime's pinned-host pool grows on demand and keeps what it grew: on the H200 growing
        costs ~1 s per GB, up to 6 s in one call, while reusing freed pinned memory takes 0.7 ms
        per 18 MiB copy (git show 42b733b:tools/probe_h2d_order.py), and a growth in the
        middle of serving stalled the steps (the first H200 multi-turn run). Per device: each
        holds its own heads' share."""
        t0, devices = time.perf_counter(), self._devices
        per_device = self.num_slots * self.block_bytes // len(devices)
        chunk = min(max(MAX_PIECE_BLOCKS * self.block_bytes // len(devices), 1 << 29), per_device)
        held = []
        for device in devices:
            sharding = jax.sharding.SingleDeviceSharding(device, memory_kind=self.host_kind)
            for _ in range(-(-per_device // chunk)):
                block = jnp.zeros(chunk, jnp.uint8, device=device)
                held.append(jax.device_put(block, sharding))
                del block
        jax.block_until_ready(held)
        del held
        return time.perf_counter() - t0

    def slot_array(self, slot: int) -> jax.Array | None:
        """The array holding `slot`'s block (a piece of several blocks), or None."""
        entry = self._slots[slot]
        return None if entry is None else entry[0]

    def host_arrays(self) -> list[jax.Array]:
        """Every live piece, once each (after `flush`: all in host memory)."""
        return list({id(a): a for a, _ in filter(None, self._slots)}.values())

    # ---- the step's transfers -----------------------------------------------------------
    def apply(self, kv_cache: KVCache, transfers) -> KVCache:
        """Make a step's KVTransfers (dispatch only); the cache to run on (donated by scatters)."""
        if transfers.offloads:
            self._offload(kv_cache, transfers.offloads)
        if transfers.loads:
            kv_cache = self._load(kv_cache, transfers.loads)
        return kv_cache

    def _offload(self, kv_cache: KVCache, runs: list[list[tuple[int, int]]]) -> None:
        """Each run (a prefix's consecutive blocks) as power-of-two pieces: one gather each into
        one device array, handed to the copier for host memory."""
        pieces = []
        for run in runs:
            i = 0
            for size in piece_sizes(len(run)):
                chunk = run[i:i + size]
                i += size
                piece = _gather(kv_cache, np.asarray([b for b, _ in chunk], np.int32))
                pieces.append((piece, [s for _, s in chunk]))
                self.bytes_to_host += len(chunk) * self.block_bytes
        with self._lock:
            for piece, piece_slots in pieces:
                for row, slot in enumerate(piece_slots):
                    self._slots[slot] = (piece, row)
        if self._copier is None:
            self._copier = queue.Queue()
            threading.Thread(target=self._copy_to_host, args=(self._copier,),
                             name="jaxinfer-kv-offload", daemon=True).start()
        self._copier.put(pieces)

    def _copy_to_host(self, work: queue.Queue) -> None:
        """The copier thread: each batch of pieces to host memory once computed, then each slot
        still naming its device piece names the host copy."""
        while True:
            pieces = work.get()
            try:
                arrays = [p for p, _ in pieces]
                jax.block_until_ready(arrays)
                host = jax.device_put(arrays, [a.sharding.with_memory_kind(self.host_kind)
                                               for a in arrays])
                with self._lock:  # (host_copies too: both threads add to it)
                    self.host_copies += len(host)
                    for (piece, piece_slots), copy in zip(pieces, host):
                        for row, slot in enumerate(piece_slots):
                            entry = self._slots[slot]
                            if entry is not None and entry[0] is piece:
                                self._slots[slot] = (copy, row)
            except Exception:  # (the slots keep their device pieces: loads still read them)
                pass
            finally:
                del pieces
                work.task_done()

    def _load(self, kv_cache: KVCache, loads: list[tuple[list[int], list[int]]]) -> KVCache:
        """One batched device_put of every piece the loads read (each once, whole: a piece is
        one contiguous copy), then one scatter per piece into the loads' device blocks."""
        dst: dict[int, tuple[jax.Array, np.ndarray]] = {}
        with self._lock:
            for slots, blocks in loads:
                for slot, block in zip(slots, blocks):
                    array, row = self._slots[slot]
                    entry = dst.get(id(array))
                    if entry is None:
                        entry = dst[id(array)] = (array, np.full(array.shape[0], -1, np.int32))
                    entry[1][row] = block
                self.bytes_to_device += len(slots) * self.block_bytes
        pieces = [(a, to) for a, to in dst.values() if (to >= 0).any()]
        if not pieces:
            return kv_cache
        arrays = [a for a, _ in pieces]
        on_host = [a for a in arrays if a.sharding.memory_kind != "device"]
        now = time.perf_counter()
        device = jax.device_put(arrays, [a.sharding.with_memory_kind("device") for a in arrays])
        self.bytes_copied_to_device += sum(a.shape[0] for a in on_host) * self.block_bytes
        with self._lock:
            self.host_copies += len(on_host)
        if on_host:
            self._time_copy(device, now)
        for array, (_, to) in zip(device, pieces):
            kv_cache = _scatter(kv_cache, array, to)
        return kv_cache

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

    def take_copy_seconds(self) -> list[float]:
        """Each step's load copy time (dispatch -> done) since the last call."""
        n = len(self.copy_seconds)
        out, self._timed = self.copy_seconds[self._timed:n], n
        return out

    def warmup(self, kv_cache: KVCache) -> KVCache:
        """Compile the gather and scatter of every piece size (the scatters write nowhere): the
        cache to run on."""
        n = 1
        while n <= MAX_PIECE_BLOCKS:
            rows = _gather(kv_cache, np.zeros(n, np.int32))
            kv_cache = _scatter(kv_cache, rows, np.full(n, -1, np.int32))
            n *= 2
        return jax.block_until_ready(kv_cache)

    def flush(self) -> None:
        """Wait until every offload so far is in host memory (before `sleep` frees the device)."""
        if self._copier is not None:
            self._copier.join()
        jax.block_until_ready(self.host_arrays())

    def drop(self) -> None:
        """Forget every host block (the weights changed: their KV is stale)."""
        with self._lock:
            self._slots = [None] * self.num_slots
