"""The Pallas weight-only kernel (`pallas_kernels/weight_only_matmul.py`) as an op XLA's SPMD
partitioner can split.

A `pallas_call` is a custom call the partitioner knows nothing about: given tensor-parallel weights
it would gather every shard onto every device in each step. Under `custom_partitioning` each device
runs the kernel on its own shard instead:

- column-parallel weights [out, in] split over `out` (q, k, v, gate, up): each device computes its
  output channels; the output stays split like the weight;
- row-parallel weights split over `in` (o, down): each device multiplies its slice of the inputs
  and the float32 partial sums are all-reduced, then cast (the scale is per output channel, so
  scaling each partial is the same as scaling the sum);
- the LM head (a bf16 Dense kernel [in, out] split over the vocabulary): like column-parallel.

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


def _plan(arg_shapes, w_kn: bool):
    """(rows axis, output-channel axis, reduction axis) of the partitioned call."""
    x, w = arg_shapes[0].sharding, arg_shapes[1].sharding
    rows = _axis(x, 0)
    n, k = (_axis(w, 1), _axis(w, 0)) if w_kn else (_axis(w, 0), _axis(w, 1))
    if n is not None and k is not None:
        k = None  # a weight split both ways: keep the output channels split, gather the inputs
    return rows, n, k


def _op(w_kn: bool, scaled: bool):
    """The custom-partitioned kernel call for one weight layout, with or without scales."""

    def call(out_dtype, interpret, x, w, *scale):
        return weight_only_matmul(x, w, scale[0] if scaled else None, out_dtype=out_dtype,
                                  w_kn=w_kn, interpret=interpret)

    def partition(out_dtype, interpret, mesh, arg_shapes, result_shape):
        rows, n, k = _plan(arg_shapes, w_kn)

        def local(x, w, *scale):
            if k is None:
                return call(out_dtype, interpret, x, w, *scale)
            return jax.lax.psum(call(jnp.float32, interpret, x, w, *scale), k).astype(out_dtype)

        shard = lambda *spec: NamedSharding(mesh, P(*spec))  # noqa: E731
        args = (shard(rows, k), shard(k, n) if w_kn else shard(n, k)) + ((shard(n),) if scaled else ())
        return mesh, local, shard(rows, n), args

    def infer(out_dtype, interpret, mesh, arg_shapes, result_shape):
        rows, n, _ = _plan(arg_shapes, w_kn)
        return NamedSharding(mesh, P(rows, n))

    op = custom_partitioning(call, static_argnums=(0, 1))
    rule = ("m k, k n" if w_kn else "m k, n k, n" if scaled else "m k, n k") + " -> m n"
    op.def_partition(partition=partition, infer_sharding_from_operands=infer, sharding_rule=rule,
                     reduction_factors=("k",))
    return op


_SCALED = _op(w_kn=False, scaled=True)  # quantized linears: w [N, K], scale [N]
_DENSE = _op(w_kn=True, scaled=False)  # a Flax Dense kernel [K, N] (the LM head)


def weight_only(x: jax.Array, w: jax.Array, scale: jax.Array | None, out_dtype,
                w_kn: bool = False) -> jax.Array:
    """x [..., K] @ (w [N, K] * scale[:, None]).T -> [..., N] through the kernel, or x @ w [K, N]
    with `w_kn` and no scale; interpreted off the GPU (CPU tests)."""
    interpret = jax.devices()[0].platform != "gpu"
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if w_kn:
        if scale is not None:
            raise ValueError("w_kn weights are unscaled (16-bit)")
        y = _DENSE(jnp.dtype(out_dtype), interpret, x2, w)
    else:
        y = _SCALED(jnp.dtype(out_dtype), interpret, x2, w, scale)
    return y.reshape(*lead, y.shape[-1])
