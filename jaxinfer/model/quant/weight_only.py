"""The Pallas weight-only kernel (`pallas_kernels/weight_only_matmul.py`) as an op XLA's SPMD
partitioner can split.

A `pallas_call` is a custom call the partitioner knows nothing about: given tensor-parallel weights
it would gather every shard onto every device in each step. Under `custom_partitioning` each device
runs the kernel on its own shard instead:

- column-parallel weights [out, in] split over `out` (q, k, v, gate, up): each device computes its
  output channels; the output stays split like the weight;
- row-parallel weights split over `in` (o, down): each device multiplies its slice of the inputs
  and the float32 partial sums are all-reduced, then cast (the scale is per output channel, so
  scaling each partial is the same as scaling the sum).

On one device (and inside `shard_map`) JAX inlines the kernel as it is.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from pallas_kernels.weight_only_matmul import weight_only_matmul


def _axis(sharding, dim: int):
    spec = tuple(getattr(sharding, "spec", ()))
    return spec[dim] if dim < len(spec) else None


def _plan(arg_shapes):
    """(rows axis, output-channel axis, reduction axis) of the partitioned call."""
    x, w = arg_shapes[0].sharding, arg_shapes[1].sharding
    rows, n, k = _axis(x, 0), _axis(w, 0), _axis(w, 1)
    if n is not None and k is not None:
        k = None  # a weight split both ways: keep the output channels split, gather the inputs
    return rows, n, k


def _call(out_dtype, interpret, x, w, scale):
    return weight_only_matmul(x, w, scale, out_dtype=out_dtype, interpret=interpret)


def _partition(out_dtype, interpret, mesh, arg_shapes, result_shape):
    rows, n, k = _plan(arg_shapes)

    def local(x, w, scale):
        if k is None:
            return _call(out_dtype, interpret, x, w, scale)
        return jax.lax.psum(_call(jnp.float32, interpret, x, w, scale), k).astype(out_dtype)

    shard = lambda *spec: NamedSharding(mesh, P(*spec))  # noqa: E731
    return mesh, local, shard(rows, n), (shard(rows, k), shard(n, k), shard(n))


def _infer(out_dtype, interpret, mesh, arg_shapes, result_shape):
    rows, n, _ = _plan(arg_shapes)
    return NamedSharding(mesh, P(rows, n))


_partitioned = custom_partitioning(_call, static_argnums=(0, 1))
_partitioned.def_partition(partition=_partition, infer_sharding_from_operands=_infer,
                           sharding_rule="m k, n k, n -> m n", reduction_factors=("k",))


def weight_only(x: jax.Array, w: jax.Array, scale: jax.Array, out_dtype) -> jax.Array:
    """x [..., K] @ (w [N, K] * scale[:, None]).T -> [..., N] through the kernel; interpreted off
    the GPU (CPU tests)."""
    interpret = jax.devices()[0].platform != "gpu"
    lead = x.shape[:-1]
    y = _partitioned(jnp.dtype(out_dtype), interpret, x.reshape(-1, x.shape[-1]), w, scale)
    return y.reshape(*lead, w.shape[0])
