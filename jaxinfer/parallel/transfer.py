"""A step's host inputs onto a replica's device(s) in one transfer per device.

A step carries a dozen small numpy arrays (token ids, positions, slot mapping, block tables, the
sampling constants). Placed one by one, by `jax.device_put` of the tree or by a jit's own
per-argument placement, each becomes its own host-to-device copy (one per device under TP), each
with its fixed host cost, on the critical path of a batch-1 decode. `put_tree` packs every leaf's
bytes into one int32 buffer (all step inputs are 4-byte types), places that buffer once and cuts it
back into the leaves on the device with one jitted call, whose outputs are then already-placed
arguments for the step. (On the CPU, at batch 1: 0.62 ms for `jax.device_put` of the 17 leaves,
0.24 ms packed; issue 26 measured 1.9 ms for the former on the H200.)

An ordinary step goes further (`pack_step_inputs`): its one executable (step_programs.fused_step,
compiled per bucket and sampler variant) takes the packed buffer itself and cuts it inside
(`unpack_step_inputs`), so the step is one dispatch, not an unpacking call, a forward and a
sampler. `put_tree` stays for the programs that take a batch of placed arrays (the decode loop,
the speculative steps, a step that reads its hidden states).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

# (offset, shape, dtype name) per leaf of the packed buffer; a static part of the unpack jit.
Layout = tuple[tuple[int, tuple[int, ...], str], ...]


def pack(leaves: list[np.ndarray]) -> tuple[np.ndarray, Layout]:
    """4-byte leaves -> one int32 buffer and the layout that cuts it back."""
    layout, offset = [], 0
    for leaf in leaves:
        if leaf.dtype.itemsize != 4:
            raise TypeError(f"pack takes 4-byte arrays; got {leaf.dtype}")
        layout.append((offset, leaf.shape, leaf.dtype.name))
        offset += leaf.size
    buf = np.empty(offset, np.int32)
    for (start, _, _), leaf in zip(layout, leaves):
        buf[start:start + leaf.size] = leaf.reshape(-1).view(np.int32)
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
def _unpack_fn(layout: Layout, sharding: jax.sharding.Sharding | None):
    if sharding is None:  # uncommitted in, uncommitted out
        return jax.jit(functools.partial(unpack, layout=layout))
    # Output shardings pinned: left to XLA, the partitioner may split a leaf and gather it back.
    return jax.jit(functools.partial(unpack, layout=layout), out_shardings=sharding)


def put_tree(tree, sharding: jax.sharding.Sharding | None):
    """Every numpy leaf of `tree` placed with `sharding` (replicated) in one transfer per device,
    or with None on the default device, uncommitted (as a jit's own placement leaves its numpy
    arguments: the compiled steps key on that); other leaves (None, device arrays) are kept as
    they are."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    host = [i for i, leaf in enumerate(leaves) if isinstance(leaf, np.ndarray)]
    if not host:
        return tree
    buf, layout = pack([leaves[i] for i in host])
    placed = _unpack_fn(layout, sharding)(jax.device_put(buf, sharding))
    for i, arr in zip(host, placed):
        leaves[i] = arr
    return jax.tree_util.tree_unflatten(treedef, leaves)


@dataclasses.dataclass(frozen=True)
class StepPacking:
    """How a fused step's program cuts its packed buffer back into the StepBatch: the batch's
    tree (its _APART sampling fields None) and each leaf's place. Static: one per bucket and
    sampler variant, a part of the executable's key."""
    treedef: jax.tree_util.PyTreeDef
    layout: Layout


# Step inputs placed apart from the packed buffer: large (a [S, max_model_len] token history, a
# [S, V/32] bitmask: packing them is one more host copy), and the history is a host array only in
# steps with a penalty request (else a device-resident one), which would give those steps a
# layout, and an unpacking jit to compile, of their own.
_APART = ("history", "token_bitmask")


def place_step_inputs(batch, plan):
    """A step's host arrays onto the replica's device(s): one transfer per device of all but
    the _APART ones (`put_tree`). (Handed to the step's executables as numpy, each array takes the
    dispatch's own per-argument placement: on the H200 that dispatch took 6.1 ms of host time for
    a 256-row decode step, against 1.7 ms with the inputs already on the device.) One unpacking
    jit per layout, i.e. per step bucket and sampler variant: the bucket compiler runs each once
    (`BucketCompiler`), so a step compiles none. A one-device replica on another device than the
    default one (data parallelism, a disaggregated decode side) gets its numpy arrays placed by
    the dispatch, on its own device."""
    if _on_non_default_device(plan):
        return batch
    sharding = None if plan is None or plan.tp == 1 else plan.replicated
    batch, apart = _split_apart(batch, host_only=True)
    batch = put_tree(batch, sharding)
    if apart:
        batch = dataclasses.replace(batch, sampling=dataclasses.replace(
            batch.sampling, **jax.device_put(apart, sharding)))
    return batch


def _on_non_default_device(plan) -> bool:
    """A one-device replica on another device than the default one (data parallelism, a
    disaggregated decode side): its dispatches place numpy arguments on its own device."""
    return plan is not None and plan.tp == 1 and plan.mesh.devices.flat[0] != jax.devices()[0]


def _split_apart(batch, host_only: bool):
    """-> (batch with its _APART sampling fields None, those fields by name; None ones left out,
    and with `host_only` device-resident ones too, which then stay in the batch)"""
    sampling = batch.sampling
    if sampling is None:
        return batch, {}
    kind = np.ndarray if host_only else (np.ndarray, jax.Array)
    apart = {f: getattr(sampling, f) for f in _APART if isinstance(getattr(sampling, f), kind)}
    return dataclasses.replace(batch, sampling=dataclasses.replace(
        sampling, **dict.fromkeys(apart))), apart


def _packed(batch):
    """-> (host int32 buffer, the _APART arrays by name, StepPacking), nothing placed."""
    rest, apart = _split_apart(batch, host_only=False)
    leaves, treedef = jax.tree_util.tree_flatten(rest)
    if not all(isinstance(leaf, np.ndarray) for leaf in leaves):
        raise TypeError("pack_step_inputs takes a batch of host arrays")
    buf, layout = pack(leaves)
    return buf, apart, StepPacking(treedef, layout)


def pack_step_inputs(batch, plan):
    """A fused step's inputs: -> (one int32 buffer of every host array but the _APART ones,
    those by name, the StepPacking). Both placed as `place_step_inputs` places its arrays: one
    transfer for the buffer (per device under TP), the _APART ones apart; left numpy on a
    one-device replica off the default device (its dispatch places them there)."""
    buf, apart, packing = _packed(batch)
    if _on_non_default_device(plan):
        return buf, apart, packing
    sharding = None if plan is None or plan.tp == 1 else plan.replicated
    return *jax.device_put((buf, apart), sharding), packing


def packed_step_specs(batch, plan):
    """What `pack_step_inputs` gives for `batch`, as shape-and-sharding specs to lower a fused
    step against (device arrays keep their own sharding)."""
    buf, apart, packing = _packed(batch)
    sharding = None if plan is None or plan.tp == 1 else plan.replicated

    def spec(a):
        where = a.sharding if isinstance(a, jax.Array) and a.committed else (
            None if isinstance(a, jax.Array) else sharding)
        return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=where)
    return spec(buf), jax.tree_util.tree_map(spec, apart), packing


def unpack_step_inputs(buf: jax.Array, apart: dict, packing: StepPacking,
                       sharding: jax.sharding.Sharding | None = None):
    """Inside a fused step: the StepBatch `pack_step_inputs` packed. `sharding`: each array's
    (replicated under TP; left to XLA, the partitioner may split an input and gather it back)."""
    leaves = unpack(buf, packing.layout)
    if sharding is not None:
        leaves = [jax.lax.with_sharding_constraint(leaf, sharding) for leaf in leaves]
    batch = jax.tree_util.tree_unflatten(packing.treedef, leaves)
    if apart:
        batch = dataclasses.replace(batch, sampling=dataclasses.replace(batch.sampling, **apart))
    return batch
