"""The host tier's bytes: one host array per slot, and the copies between them and the device cache.

The bookkeeping (which prefix is in which slot, LRU, pins) is `jaxinfer/core/kv_cache/host_tier.py`;
the scheduler hands this store each step's `KVTransfers` (core/kv_loads.py), and `apply` makes
them before the step is dispatched, on the thread that dispatches steps (in the same order):

1. offloads: one jitted gather reads the evicted blocks out of the cache into fresh device arrays,
   one per block, `[layers, 2 (K, V), heads, block_size, head_dim]`; `jax.device_put` starts their
   copy into host memory (`pinned_host` where the backend has it: the DMA engines copy it while
   the steps run). Neither waits. The slot then holds the copy's host array.
   *Why a block is never overwritten before its copy has read it:* the gather is dispatched before
   the step that writes into the reused block, and that step takes the cache donated. JAX orders
   executions on one device in dispatch order, and a donated buffer is only reused once every
   computation already enqueued that reads it has finished (PJRT waits for the buffer's usage
   events before handing its memory to the donating computation), so the gather always reads
   the old content (tests/test_kv_host_tier.py checks this with a donated overwrite dispatched
   right after the gather).
2. load cancels: drop a cancelled copy's device buffers.
3. load starts: `jax.device_put` of the slots' host arrays onto the device (sharded like the cache);
   the buffers wait here, keyed by sequence id, until `landed()` sees them ready (`is_ready()`,
   no sync) and the scheduler sends the scatter.
4. load scatters: one jitted scatter writes the landed buffers into their device blocks, cache
   donated (in place), before the step that first reads them.

An fp8 cache copies its 1-byte elements as they are: its K/V scales are per layer and fixed for
the engine's life (kv_scales.py), so nothing per block travels with them. Under tensor
parallelism the cache's head axis is sharded: the gathered per-block arrays keep that sharding,
their host copies too (`with_memory_kind`), so each device offloads and reloads its own heads.

Counts are padded to powers of two (padding reads block 0 and writes nowhere), so a few shapes
compile.

A further tier (local disk, a remote store) would sit behind the same four operations on slots:
see `KVTierStore` and docs/kv_cache.md.
"""

from __future__ import annotations

import functools
import time
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np

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


def _bucket(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


@jax.jit
def _gather(kv_cache: KVCache, ids: jax.Array) -> tuple[jax.Array, ...]:
    """Blocks `ids` of every layer: one array per block, [layers, 2, heads, block_size, head_dim]."""
    stacked = jnp.stack([jnp.stack((k[:, ids], v[:, ids])) for k, v in kv_cache])
    stacked = jnp.moveaxis(stacked, 3, 0)  # [n, layers, 2, heads, block_size, head_dim]
    return tuple(stacked[i] for i in range(ids.shape[0]))


@functools.partial(jax.jit, donate_argnums=0)
def _scatter(kv_cache: KVCache, blocks: tuple[jax.Array, ...], ids: jax.Array) -> KVCache:
    stacked = jnp.stack(blocks, axis=3)  # [layers, 2, heads, n, block_size, head_dim]
    num_blocks = kv_cache[0][0].shape[1]
    # Padding goes to distinct out-of-range blocks (dropped), so the indices stay unique.
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

    def __init__(self, num_slots: int, kv_cache: KVCache, max_blocks_per_call: int = 256):
        self.num_slots = num_slots
        self._slots: list[jax.Array | None] = [None] * num_slots
        self.max_blocks_per_call = _bucket(max_blocks_per_call)
        k = kv_cache[0][0]
        self.host_kind = host_memory_kind(next(iter(k.sharding.device_set)))
        num_layers = len(kv_cache)
        self.block_bytes = num_layers * 2 * k.nbytes // k.shape[1]
        # seq id -> (device buffers, dispatch time): host -> device copies not seen landed.
        self._loads: dict[str, tuple[list[jax.Array], float]] = {}
        self._pad_block: jax.Array | None = None  # a device block to pad scatters with
        # Counters for metrics and benchmarks.
        self.bytes_to_host = 0
        self.bytes_to_device = 0
        self.load_seconds = 0.0  # dispatch -> seen landed, summed over loads
        self.loads_landed = 0
        self._recent_seconds: list[float] = []  # per landed load, until take_load_seconds

    def slot_array(self, slot: int) -> jax.Array | None:
        return self._slots[slot]

    # ---- the step's transfers -----------------------------------------------------------
    def apply(self, kv_cache: KVCache, transfers) -> KVCache:
        """Make a step's KVTransfers (dispatch only); the cache to run on (donated by scatters)."""
        if transfers.offloads:
            self._offload(kv_cache, transfers.offloads)
        for sid in transfers.load_cancels:
            self._loads.pop(sid, None)
        for sid, slots in transfers.load_starts:
            arrays = [self._slots[s] for s in slots]
            device = [a.sharding.with_memory_kind("device") for a in arrays]
            self._loads[sid] = (jax.device_put(arrays, device), time.perf_counter())
            self.bytes_to_device += len(slots) * self.block_bytes
        for sid, ids in transfers.load_scatters:
            buffers, _ = self._loads.pop(sid)
            kv_cache = self._scatter(kv_cache, buffers, ids)
        return kv_cache

    def _offload(self, kv_cache: KVCache, pairs: list[tuple[int, int]]) -> None:
        step = self.max_blocks_per_call
        for i in range(0, len(pairs), step):
            chunk = pairs[i:i + step]
            ids = np.zeros(_bucket(len(chunk)), np.int32)
            ids[:len(chunk)] = [b for b, _ in chunk]
            blocks = _gather(kv_cache, ids)[:len(chunk)]
            host = jax.device_put(list(blocks),
                                  [b.sharding.with_memory_kind(self.host_kind) for b in blocks])
            for (_, slot), array in zip(chunk, host):
                self._slots[slot] = array
            self.bytes_to_host += len(chunk) * self.block_bytes

    def _scatter(self, kv_cache: KVCache, buffers: list[jax.Array], ids: list[int]) -> KVCache:
        step = self.max_blocks_per_call
        for i in range(0, len(ids), step):
            part, chunk = buffers[i:i + step], ids[i:i + step]
            n = _bucket(len(chunk))
            if self._pad_block is None:
                self._pad_block = jnp.zeros_like(part[0])
            padded = np.full(n, -1, np.int32)
            padded[:len(chunk)] = chunk
            kv_cache = _scatter(kv_cache, tuple(part) + (self._pad_block,) * (n - len(part)),
                                padded)
        return kv_cache

    def warmup(self, kv_cache: KVCache) -> KVCache:
        """Compile the gather and scatter of every padded count (the scatters write nowhere):
        the cache to run on."""
        n = 1
        while n <= self.max_blocks_per_call:
            blocks = _gather(kv_cache, np.zeros(n, np.int32))
            kv_cache = _scatter(kv_cache, blocks, np.full(n, -1, np.int32))
            n *= 2
        return jax.block_until_ready(kv_cache)

    # ---- readiness, polled by the engine -------------------------------------------------
    def landed(self) -> list[str]:
        """Sequences whose host -> device copy has landed (no sync); each is reported once."""
        out, now = [], time.perf_counter()
        for sid, (buffers, t0) in self._loads.items():
            if t0 >= 0 and all(b.is_ready() for b in buffers):
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
        pending = [bufs for bufs, t0 in self._loads.values() if t0 >= 0]
        if pending:
            jax.block_until_ready(pending[0])

    def drop(self) -> None:
        """Forget every host block (the weights changed: their KV is stale)."""
        self._slots = [None] * self.num_slots
