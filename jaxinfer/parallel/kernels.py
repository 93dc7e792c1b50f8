"""The kernel table under tensor parallelism: the slots whose kernels see sharded operands run per
device under `shard_map` (attention over each device's heads, the routed experts over its experts
or their slices, then an all-reduce, the fixed-state layers' steps over each device's state-space
heads); every other slot (the add + norm, quantized matmuls, ...)
runs on the replicated activations as on one device and is kept as it is."""

from __future__ import annotations

import dataclasses

from jaxinfer.model.kernel_table import KernelTable
from jaxinfer.model.ssm_kernels import StateHeads
from jaxinfer.parallel.attention import ShardedAttention
from jaxinfer.parallel.experts import ShardedExperts
from jaxinfer.parallel.sharding import ShardingPlan
from jaxinfer.parallel.state_heads import ShardedStateHeads


def shard_kernels(kernels: KernelTable, plan: ShardingPlan | None) -> KernelTable:
    """The table a replica's model calls: `kernels` on one device, else with its attention, routed
    experts and fixed-state steps over the plan's mesh."""
    if plan is None or plan.tp == 1:
        return kernels
    return dataclasses.replace(kernels, attention=ShardedAttention(kernels.attention, plan),
                               routed_experts=ShardedExperts(plan, kernels.routed_experts),
                               state_heads=ShardedStateHeads(plan=plan))


def unsharded(kernels: KernelTable) -> KernelTable:
    """`kernels` before `shard_kernels` (a draft model re-shards the target's over its own plan)."""
    attention, experts = kernels.attention, kernels.routed_experts
    return dataclasses.replace(
        kernels, attention=attention.inner if isinstance(attention, ShardedAttention) else attention,
        routed_experts=experts.inner if isinstance(experts, ShardedExperts) else experts,
        state_heads=StateHeads())
