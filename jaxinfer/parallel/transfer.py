"""A step's host inputs onto a replica's mesh in one transfer per device.

A step carries a dozen small numpy arrays (token ids, positions, slot mapping, block tables, the
sampling constants). Handed to a multi-device jit as numpy, each one takes jax's per-argument
placement path and becomes one host-to-device copy per device: a few dozen small copies per step,
each with its fixed host cost, on the critical path of a batch-1 decode. `put_tree` packs every
leaf's bytes into one int32 buffer (all step inputs are 4-byte types), places that buffer once
(replicated: one copy per device) and cuts it back into the leaves on the device with one jitted
call, whose outputs are then already-placed arguments for the step.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

# (offset, shape, dtype name) per leaf of the packed buffer; a static part of the unpack jit.
Layout = tuple[tuple[int, tuple[int, ...], str], ...]


def pack(leaves: list[np.ndarray]) -> tuple[np.ndarray, Layout]:
    """4-byte leaves -> one int32 buffer and the layout that cuts it back."""
    layout, parts, offset = [], [], 0
    for leaf in leaves:
        if leaf.dtype.itemsize != 4:
            raise TypeError(f"pack takes 4-byte arrays; got {leaf.dtype}")
        layout.append((offset, leaf.shape, leaf.dtype.name))
        parts.append(np.ascontiguousarray(leaf).reshape(-1).view(np.int32))
        offset += leaf.size
    buf = np.concatenate(parts) if parts else np.zeros(0, np.int32)
    return buf, tuple(layout)


def unpack(buf: jax.Array, layout: Layout) -> list[jax.Array]:
    """The leaves `pack` packed, from the buffer (traced or not)."""
    out = []
    for offset, shape, dtype in layout:
        size = int(np.prod(shape, dtype=np.int64))
        flat = jax.lax.bitcast_convert_type(buf[offset:offset + size], jnp.dtype(dtype))
        out.append(jnp.reshape(flat, shape))
    return out


@functools.lru_cache(maxsize=256)
def _unpack_fn(layout: Layout, sharding: jax.sharding.Sharding):
    # Output shardings pinned: left to XLA, the partitioner may split a leaf and gather it back.
    return jax.jit(functools.partial(unpack, layout=layout), out_shardings=sharding)


def put_tree(tree, sharding: jax.sharding.Sharding):
    """Every numpy leaf of `tree` placed with `sharding` (replicated) in one transfer per device;
    other leaves (None, device arrays) are kept as they are."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    host = [i for i, leaf in enumerate(leaves) if isinstance(leaf, np.ndarray)]
    if not host:
        return tree
    buf, layout = pack([leaves[i] for i in host])
    placed = _unpack_fn(layout, sharding)(jax.device_put(buf, sharding))
    for i, arr in zip(host, placed):
        leaves[i] = arr
    return jax.tree_util.tree_unflatten(treedef, leaves)


def place_step_inputs(batch, plan):
    """A step's host arrays onto the replica's mesh (tensor parallelism) in one transfer per
    device; on the default device, one `jax.device_put` of the whole tree. (Handed to the step's
    executables as numpy, each array takes the dispatch's own per-argument placement: on the H200
    that dispatch took 6.1 ms of host time for a 256-row decode step, against 1.7 ms with the
    inputs already on the device and 1.2 ms for the device_put of all of them, waited for.) A
    one-device replica on another device (data parallelism, a disaggregated decode side) gets its
    numpy arrays placed by the dispatch, on its own device."""
    if plan is None or plan.tp == 1:
        if plan is None or plan.mesh.devices.flat[0] == jax.devices()[0]:
            return jax.device_put(batch)  # uncommitted, as the dispatch would place it
        return batch
    return put_tree(batch, plan.replicated)
