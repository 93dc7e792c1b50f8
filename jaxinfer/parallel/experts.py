"""Routed experts under tensor parallelism: the kernel table's one-device routed-experts kernel
(`RoutedExperts`) per device under `shard_map`, in one of
two layouts (`ShardingPlan.expert_layout`), then one all-reduce of the [T, H] result.

  "tp"  tensor parallelism inside every expert: each device holds F/N of every expert's
        intermediate size (w_gate/w_up split over their output, w_down over its input) and computes
        every routed row on its slice; the result is a partial sum, as after a dense MLP.
  "ep"  expert parallelism: each device holds E/N whole experts and computes the rows routed to
        them; rows routed to other devices' experts contribute zero.

Activations are replicated over ``tp`` between layers (the row-parallel all-reduces leave them so),
so every device routes every token itself (the router is replicated) and neither layout needs an
all-to-all: the one all-reduce that follows replaces the token exchange. "tp" keeps every device's
work equal whatever the routing; "ep" keeps each expert's matmuls whole (F, not F/N, wide: fewer,
fuller tiles for the grouped-matmul kernel) and is balanced only on average.

The Mosaic grouped-matmul kernel is a custom call that XLA's SPMD partitioner cannot split; under
`shard_map` it runs on each device's shard like on one device.
"""

from __future__ import annotations

import dataclasses

import jax
from jax.sharding import PartitionSpec as P

from jaxinfer.model.experts import RoutedExperts
from jaxinfer.parallel.sharding import (TP, ShardingPlan, expert_bias_specs,
                                       expert_scale_specs, expert_specs)


@dataclasses.dataclass(frozen=True)
class ShardedExperts:
    """`inner` over the replica's mesh: same call, replicated inputs and output."""
    plan: ShardingPlan
    inner: RoutedExperts

    def __call__(self, x, experts, weights, w, scales=None, *, glu=None, biases=None,
                 dispatch=None):
        # The fused router's dispatch sorts all experts' rows; each device re-sorts its own.
        del dispatch
        layout = self.plan.expert_layout
        held = self.plan.cfg.num_experts // self.plan.tp if layout == "ep" else None

        def local(x, experts, weights, w, scales, biases):
            first = jax.lax.axis_index(TP) * held if held else 0
            out = self.inner(x, experts, weights, w, scales or None, first, glu=glu,
                             biases=biases or None)
            return jax.lax.psum(out, TP)

        # 8-bit stacks' scales and gpt-oss's gate/up biases split like the stacks' outputs; an
        # absent one is an empty tuple (an empty pytree).
        args = (x, experts, weights, tuple(w), tuple(scales or ()), tuple(biases or ()))
        specs = (P(), P(), P(), expert_specs(layout),
                 expert_scale_specs(layout) if scales is not None else (),
                 expert_bias_specs(layout) if biases is not None else ())
        return jax.shard_map(local, mesh=self.plan.mesh, in_specs=specs, out_specs=P(),
                             check_vma=False)(*args)
