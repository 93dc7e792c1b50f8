"""The engine's side of the host KV tier (`--kv-offload`, docs/kv_cache.md "Host tier"): sizing
it, handing each step's copies to the worker's store before the step's dispatch, and keeping
host copies across `sleep`. Mixed into `LLMEngine`; the bookkeeping is core/kv_cache/host_tier.py
and core/kv_loads.py, the bytes worker/kv/host_store.py."""

from __future__ import annotations

import logging

from jaxinfer.core.kv_cache.cache_config import CacheConfig
from jaxinfer.core.kv_cache.host_tier import HostTier
from jaxinfer.errors import ConfigError
from jaxinfer.worker.kv.host_store import HostKVStore

log = logging.getLogger(__name__)

GIB = 1 << 30


def host_tier_for(cfg, cache: CacheConfig, kv_dtype, groups) -> HostTier | None:
    """The host tier's bookkeeping for --kv-offload (None when off): as many blocks as
    --kv-host-gib holds, a block being every layer's K and V of all the replica's heads.

    No group that frees blocks (from_engine_args turns --hybrid-kv-cache off for the tier: a
    prefix node holds one block per group, and a windowed group's may be freed); state-space
    layers' groups are carried as their prefix nodes' snapshots (core/kv_cache/host_offload.py).
    A draft model's or EAGLE-3 head's state over the target's block ids (its KV, the stream
    cache) is not offloaded: a block loaded from the host holds
    another block's, which lowers acceptance and never changes outputs (verification is exact),
    as a device prefix hit on a block computed without speculation does."""
    if not cache.kv_offload:
        return None
    if groups.frees_token_blocks:
        raise ConfigError(f"--kv-offload keeps whole prefix blocks ({cfg.architecture}'s KV "
                          f"groups free blocks out of a window): pass --no-hybrid-kv-cache")
    slots = int(cache.kv_host_gib * GIB // groups.page_bytes(cache.block_size, kv_dtype))
    log.info("host KV tier: %d blocks (%.1f GiB, %d tokens of prefix)", slots, cache.kv_host_gib,
             slots * cache.block_size)
    return HostTier(max(slots, 1))


class KVTierMixin:
    host_kv: HostKVStore | None = None  # the host tier's bytes (None: --no-kv-offload)

    def _init_kv_tier(self) -> None:
        loads = self.scheduler.loads  # (None: no host tier)
        if loads is not None:
            host = loads.host
            self.host_kv = HostKVStore(host.num_slots, self.runner.kv_cache)
            log.info("host KV tier: pinning %.1f GiB of host memory",
                     host.num_slots * self.host_kv.block_bytes / GIB)
            seconds = self.host_kv.reserve()
            log.info("host KV tier: pinned in %.1f s", seconds)
            self._host_metrics = self.metrics.host_kv()

    def _move_kv(self, sched) -> None:
        """The step's host-tier copies, dispatched ahead of the step on the thread that dispatches
        steps (so in step order)."""
        store, transfers = self.host_kv, sched.kv_transfers
        if store is None:
            return
        if transfers:
            self.runner.update_kv_cache_in_step_order(
                lambda cache: store.apply(cache, transfers))
        for seconds in store.take_copy_seconds():
            self._host_metrics.load_seconds.observe(seconds)
        loads = self.scheduler.loads
        self._host_metrics.update(loads.host.num_used_slots, hit_tokens=loads.host_hit_tokens,
                                  bytes_to_host=store.bytes_to_host,
                                  bytes_to_device=store.bytes_to_device)

    def _offload_for_sleep(self) -> None:
        """Copy every cached device block to the host tier and wait for the copies, so `sleep`
        can free the device cache and a later prompt still finds its prefix (on the host)."""
        if self.host_kv is None:
            return
        transfers = self.scheduler.loads.offload_cached()
        if transfers is not None:
            self.runner.replace_kv_cache(lambda cache: self.host_kv.apply(cache, transfers))
        self.host_kv.flush()  # (earlier offloads' device pieces too)

    def _drop_host_kv(self) -> None:
        """New weights: the host copies are stale (the scheduler's reset forgot their names)."""
        if self.host_kv is not None:
            self.host_kv.drop()
