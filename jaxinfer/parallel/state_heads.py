"""The fixed-state layers (Gated DeltaNet, Mamba-2) under tensor parallelism: each device runs the
layer's step on its own state-space heads under `shard_map`, keeping their states in its head shard
of the cache pages.

A state lives in the pages of the layer's cache arrays (model/state_pages.py), which are split over
KV heads like every attention layer's, in shares by KV head. So each device lays the states of its
heads (its share of the conv channels, its heads' recurrent or SSM states) over its own shard of
the state's pages, as the shares of its heads, in the layout the pages have at every TP size: no
page is gathered, the disaggregated hand-over copies pages between TP sizes as they are, and a
state's pages stay whole blocks for the scheduler, the prefix cache's snapshots and copy-on-write,
which copy every device's shard of a block. A device's share is 1/tp of the state and at least
1/tp of each page (1/tp where tp divides the KV heads, a whole head's where each device stores
one), so it spans no more pages than the scheduler holds for the state (FixedStateSpec.state_pages).

The mixer's projections around the step are sharded by their params (sharding.py: in-projections
column-parallel by head, out_proj row-parallel); the step sees single-device shapes, so the Pallas
kernels (pallas_kernels/ssm) run per device as the attention kernels do.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
from jax.sharding import PartitionSpec as P

from jaxinfer.model.ssm_kernels import StateHeads
from jaxinfer.parallel.sharding import TP, ShardingPlan


def _spec(axis: int | None) -> P:
    return P() if axis is None else P(*(None,) * axis, TP)


@dataclasses.dataclass(frozen=True)
class ShardedStateHeads(StateHeads):
    """`StateHeads` over the plan's tp devices: `run` under shard_map, each argument split along
    its axis."""
    plan: ShardingPlan = None

    @property
    def count(self) -> int:
        return self.plan.tp

    def index(self):
        return jax.lax.axis_index(TP)

    def gather(self, x, axis: int):
        return jax.lax.all_gather(x, TP, axis=axis, tiled=True)

    def own(self, x, axis: int):
        size = x.shape[axis] // self.plan.tp
        return jax.lax.dynamic_slice_in_dim(x, self.index() * size, size, axis)

    def run(self, step, args: tuple, axes: tuple, out_axes: tuple):
        # check_vma off: the Pallas kernels' outputs carry no varying-axis annotations.
        return jax.shard_map(functools.partial(step, self), mesh=self.plan.mesh,
                             in_specs=tuple(map(_spec, axes)),
                             out_specs=tuple(map(_spec, out_axes)), check_vma=False)(*args)
