"""A step's host inputs onto a replica's device(s) in one transfer per device.

A step carries a dozen small numpy arrays (token ids, positions, slot mapping, block tables, the
sampling constants). Placed one by one, by `jax.device_put` of the tree or by a jit's own
per-argument placement, each becomes its own host-to-device copy (one per device under TP), each
with its fixed host cost, on the critical path of a batch-1 decode. `put_tree` packs every leaf's
bytes into one int32 buffer (all step inputs are 4-byte types), places that buffer once and cuts it
back into the leaves on the device with one jitted call, whose outputs are then already-placed
arguments for the step. (On the CPU, at batch 1: 0.62 ms for `jax.device_put` of the 17 leaves,
0.24 ms packed; issue 26 measured 1.9 ms for the former on the H200.)

An ordinary step goes further (`pack_split_step_inputs`): its forward program takes the packed
buffer itself and cuts its own inputs from the front (`unpack_model_inputs`), handing the rest of
the buffer, the sampler's inputs, on to the sampler program, which cuts those
(`unpack_sampling_inputs`): two dispatches, not an unpacking call, a forward and a sampler. The
two stay apart so that the forward, the costly compile, is compiled once per bucket and the
sampler once per row count and sampler variant, as their layouts vary. The decode loop takes one
packed buffer too (`pack_step_inputs`). `put_tree` stays for the programs that take a batch of
placed arrays (the speculative steps, an EAGLE-3 head's steps).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

# (offset, shape, dtype name) per leaf of the packed buffer; a static part of the unpack jit.
Layout = tuple[tuple[int, tuple[int, ...], str], ...]


# Every leaf starts on a 256-byte boundary. Inside a program that takes the packed buffer, XLA:GPU
# hands a leaf's slice to a kernel as a view into the buffer, and a Mosaic GPU kernel refuses an
# operand that is not 256-byte aligned ("Input buffer 4 is not 256-byte aligned": every packed
# step failed so on an H100).
ALIGN = 64  # int32s


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def packed_size(leaves) -> int:
    """The int32s `pack` takes for `leaves` (each leaf's start aligned, the end too)."""
    return sum(_aligned(int(np.size(leaf))) for leaf in leaves)


def pack(leaves: list[np.ndarray], size: int = 0) -> tuple[np.ndarray, Layout]:
    """4-byte leaves -> one int32 buffer (zero-padded to `size` int32s if longer), each leaf at
    an ALIGN boundary, and the layout that cuts it back."""
    layout, offset = [], 0
    for leaf in leaves:
        if leaf.dtype.itemsize != 4:
            raise TypeError(f"pack takes 4-byte arrays; got {leaf.dtype}")
        layout.append((offset, leaf.shape, leaf.dtype.name))
        offset += _aligned(leaf.size)
    buf = np.empty(max(offset, size), np.int32)
    end = 0
    for (start, _, _), leaf in zip(layout, leaves):
        buf[end:start] = 0
        end = start + leaf.size
        buf[start:end] = leaf.reshape(-1).view(np.int32)
    buf[end:] = 0
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
    """How a program cuts its packed buffer back into its inputs: their tree (the _APART
    sampling fields None) and each leaf's place. Static, a part of the executable's key."""
    treedef: jax.tree_util.PyTreeDef
    layout: Layout


@dataclasses.dataclass(frozen=True)
class SplitPacking:
    """An ordinary step's packed buffer, read by two programs: the forward's inputs at its front
    (`model`: the StepBatch but its sampling and emit_slot), then the sampler's (`sample`:
    (SamplingTensors but the _APART fields, emit_slot), offsets from the tail's start). The tail
    is zero-padded to one length per row count in every sampler variant (the largest variant's),
    so the forward, which hands the tail on uncut, has one signature per bucket."""
    model: StepPacking
    sample: StepPacking


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
    sharding = _replicated(plan)
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


def _placed(buf, apart, plan):
    """The packed buffer and the _APART arrays placed as `place_step_inputs` places its arrays:
    one transfer for the buffer (per device under TP), the _APART ones apart; left numpy on a
    one-device replica off the default device (its dispatch places them there)."""
    if _on_non_default_device(plan):
        return buf, apart
    return jax.device_put((buf, apart), _replicated(plan))


def _replicated(plan):
    return None if plan is None or plan.tp == 1 else plan.replicated


def _specs(buf, apart, plan):
    """Shape-and-sharding specs of what `_placed` gives (device arrays keep their own)."""
    def spec(a):
        where = a.sharding if isinstance(a, jax.Array) and a.committed else (
            None if isinstance(a, jax.Array) else _replicated(plan))
        return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=where)
    return spec(buf), jax.tree_util.tree_map(spec, apart)


def pack_step_inputs(batch, plan):
    """A decode loop's inputs: -> (one int32 buffer of every host array but the _APART ones,
    those by name, the StepPacking), placed (`_placed`)."""
    buf, apart, packing = _packed(batch)
    return *_placed(buf, apart, plan), packing


def packed_step_specs(batch, plan):
    """What `pack_step_inputs` gives for `batch`, as shape-and-sharding specs to lower against."""
    buf, apart, packing = _packed(batch)
    return *_specs(buf, apart, plan), packing


def _split_packed(batch, tail: int):
    """-> (host int32 buffer: the forward's inputs, then the sampler's padded to `tail` int32s;
    the _APART arrays by name; SplitPacking), nothing placed."""
    rest, apart = _split_apart(batch, host_only=False)
    model, model_tree = jax.tree_util.tree_flatten(
        dataclasses.replace(rest, sampling=None, emit_slot=None))
    sample, sample_tree = jax.tree_util.tree_flatten((rest.sampling, rest.emit_slot))
    if not all(isinstance(leaf, np.ndarray) for leaf in model + sample):
        raise TypeError("pack_split_step_inputs takes a batch of host arrays")
    model_size = packed_size(model)
    if packed_size(sample) > tail:
        raise ValueError(f"the sampler's inputs exceed the step's tail of {tail} int32s")
    buf, layout = pack(model + sample, model_size + tail)
    sample_layout = tuple((offset - model_size, shape, dtype)
                          for offset, shape, dtype in layout[len(model):])
    return buf, apart, SplitPacking(StepPacking(model_tree, layout[:len(model)]),
                                    StepPacking(sample_tree, sample_layout))


def sampling_inputs_size(batch) -> int:
    """How many int32s the sampler's inputs of `batch` take in a split-packed buffer."""
    rest, _ = _split_apart(batch, host_only=False)
    return packed_size(jax.tree_util.tree_leaves((rest.sampling, rest.emit_slot)))


def pack_split_step_inputs(batch, plan, tail: int):
    """An ordinary step's inputs: -> (one int32 buffer, the forward's inputs then the sampler's
    padded to `tail` int32s; the _APART arrays by name; the SplitPacking), placed (`_placed`)."""
    buf, apart, packing = _split_packed(batch, tail)
    return *_placed(buf, apart, plan), packing


def split_step_specs(batch, plan, tail: int):
    """What `pack_split_step_inputs` gives for `batch` as specs to lower the forward against, and
    the sampler's: -> (buffer spec, _APART specs, SplitPacking, tail spec)."""
    buf, apart, packing = _split_packed(batch, tail)
    buf_spec, apart_specs = _specs(buf, apart, plan)
    tail_spec = jax.ShapeDtypeStruct((tail,), jnp.int32, sharding=buf_spec.sharding)
    return buf_spec, apart_specs, packing, tail_spec


def _constrained(leaves, sharding):
    """Each array's sharding inside a program (replicated under TP; left to XLA, the partitioner
    may split an input and gather it back)."""
    if sharding is None:
        return leaves
    return [jax.lax.with_sharding_constraint(leaf, sharding) for leaf in leaves]


def unpack_step_inputs(buf: jax.Array, apart: dict, packing: StepPacking,
                       sharding: jax.sharding.Sharding | None = None):
    """Inside a decode loop: the StepBatch `pack_step_inputs` packed."""
    batch = jax.tree_util.tree_unflatten(packing.treedef,
                                         _constrained(unpack(buf, packing.layout), sharding))
    if apart:
        batch = dataclasses.replace(batch, sampling=dataclasses.replace(batch.sampling, **apart))
    return batch


def unpack_model_inputs(buf: jax.Array, packing: StepPacking,
                        sharding: jax.sharding.Sharding | None = None):
    """Inside an ordinary step's forward: -> (its StepBatch, no sampling or emit_slot; the
    buffer's tail, the sampler's inputs, uncut)."""
    offset, shape, _ = packing.layout[-1]
    end = _aligned(offset + int(np.prod(shape, dtype=np.int64)))
    batch = jax.tree_util.tree_unflatten(packing.treedef,
                                         _constrained(unpack(buf, packing.layout), sharding))
    tail, = _constrained([buf[end:]], sharding)
    return batch, tail


def unpack_sampling_inputs(tail: jax.Array, apart: dict, packing: StepPacking,
                           sharding: jax.sharding.Sharding | None = None):
    """Inside an ordinary step's sampler: -> (SamplingTensors, emit_slot) from the tail the
    forward handed on and the _APART arrays."""
    sampling, emit_slot = jax.tree_util.tree_unflatten(
        packing.treedef, _constrained(unpack(tail, packing.layout), sharding))
    if apart:
        sampling = dataclasses.replace(sampling, **apart)
    return sampling, emit_slot
