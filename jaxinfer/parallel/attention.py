"""The attention seam under tensor parallelism: an `AttentionBackend` whose kernels run per device
under `shard_map`, each on its own query heads and its own KV heads of the cache.

Attention needs no communication: query head h reads KV head h // (Hq / Hkv), and the head axis is
split into contiguous, aligned groups over ``tp``. When tp exceeds the KV heads, the new K/V arrive
replicated (the projections are replicated) and each device keeps the one KV head its query heads
read, before writing its cache shard. The wrapped backend (Mosaic / Triton kernels on a GPU, the
jnp reference on a CPU) sees ordinary single-device shapes.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
from jax.sharding import PartitionSpec as P

from jaxinfer.parallel.sharding import TP, ShardingPlan, attention_specs
from pallas_kernels.attention.backend import AttentionBackend


@dataclasses.dataclass(frozen=True)
class ShardedAttention:
    """Same interface as `AttentionBackend` (write_kv, __call__, name); hashable, so it is a static
    part of the jitted step and its mesh a part of every compile-cache key."""
    inner: AttentionBackend
    plan: ShardingPlan

    @property
    def name(self) -> str:
        return f"{self.inner.name}/tp{self.plan.tp}"

    def _own_kv_head(self, x: jax.Array) -> jax.Array:
        """[T, Hkv, D] replicated -> [T, 1, D]: the KV head this device's query heads read."""
        idx = jax.lax.axis_index(TP) * self.plan.cfg.num_kv_heads // self.plan.tp
        return jax.lax.dynamic_slice_in_dim(x, idx, 1, axis=1)

    def for_layer(self, i: int) -> "ShardedAttention":
        return dataclasses.replace(self, inner=self.inner.for_layer(i))

    def write_kv(self, k_cache, v_cache, k, v, slot_mapping):
        specs = attention_specs(self.plan)
        if v_cache.shape[-1] == 0:  # MLA's empty V cache: kept out of shard_map (XLA's CPU
            # partitioner crashes on zero-size operands), nothing to write
            return self._write_k(k_cache, k, slot_mapping, specs), v_cache

        def local(kc, vc, k, v, slots):
            if self.plan.kv_replicated:
                k, v = self._own_kv_head(k), self._own_kv_head(v)
            return self.inner.write_kv(kc, vc, k, v, slots)

        cache, new = specs["cache"], specs["kv_new"]
        return _shard_map(local, self.plan, (cache, cache, new, new, P()), (cache, cache))(
            k_cache, v_cache, k, v, slot_mapping)

    def _write_k(self, k_cache, k, slot_mapping, specs):
        def local(kc, k, slots):
            if self.plan.kv_replicated:
                k = self._own_kv_head(k)
            return self.inner.write_kv(kc, kc[..., :0], k, k[..., :0], slots)[0]

        return _shard_map(local, self.plan, (specs["cache"], specs["kv_new"], P()),
                          specs["cache"])(k_cache, k, slot_mapping)

    def __call__(self, q, k_cache, v_cache, md, *, scale: float, softcap: float | None = None,
                 window: int | None = None, sinks: jax.Array | None = None,
                 chunk: int | None = None):
        specs = attention_specs(self.plan)
        local = functools.partial(self.inner.__call__, scale=scale, softcap=softcap, window=window,
                                  chunk=chunk)
        in_specs = (specs["q"], specs["cache"], specs["cache"], specs["md"])
        if sinks is None:
            return _shard_map(local, self.plan, in_specs, specs["q"])(q, k_cache, v_cache, md)
        # Sinks are per query head: each device takes those of its own heads.
        def with_sinks(q, kc, vc, md, sinks):
            return local(q, kc, vc, md, sinks=sinks)

        return _shard_map(with_sinks, self.plan, (*in_specs, specs["sinks"]), specs["q"])(
            q, k_cache, v_cache, md, sinks)


def _shard_map(fn, plan: ShardingPlan, in_specs, out_specs):
    # check_vma off: the Pallas kernels' outputs carry no varying-axis annotations.
    return jax.shard_map(fn, mesh=plan.mesh, in_specs=in_specs, out_specs=out_specs,
                         check_vma=False)
