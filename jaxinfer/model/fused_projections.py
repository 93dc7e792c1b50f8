"""Projections that read the same input, stored as one matrix: q/k/v as `qkv_proj`, gate/up as
`gate_up_proj`, a Mamba-2 mixer's z/x/B/C/dt as `in_proj` (output features concatenated in that
order), and biased experts' gate/up stacks as `w_gate_up` [E, H, 2F] (gpt-oss: the grouped
matmul's SwiGLU epilogue lacks their activation, so gate and up run as plain calls, and one call
twice as wide streams the same bytes with one launch and twice the work units of each).

At decode batch sizes each projection is a matrix-vector product bound by reading its weight, and
one wide matmul streams the weights faster than three or two narrow ones: the narrow k/v reads are
too short to reach full bandwidth, and every matmul pays a launch and a tail (batch 1 on the H200:
benchmarks/RESULTS.md). Checkpoints, initialisation and tensor-parallel sharding keep the separate
projections; `fuse_projections` rewrites a loaded tree and the model runs whichever layout its
params have (`project`). A tree split over several devices stays unfused: a column split of the
fused matrix would not give each device its own heads' q, k and v (or z, x and dt).
"""

from __future__ import annotations

import itertools
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.model.quant.layers import EXPERT_PROJS, FUSED_EXPERT_PROJS, scale_name
from jaxinfer.model.shared_experts import fuse_shared_experts, stackable

# module name in a layer -> (fused projection, the projections it replaces, in output order)
GROUPS = {"attn": ("qkv_proj", ("q_proj", "k_proj", "v_proj")),
          "mlp": ("gate_up_proj", ("gate_proj", "up_proj")),
          "mamba": ("in_proj", ("in_proj_z", "in_proj_x", "in_proj_b", "in_proj_c", "in_proj_dt"))}

# A biased MoE layer's fused leaf -> the leaves it replaces, concatenated on their last axis.
_GATE_UP, _PARTS = FUSED_EXPERT_PROJS[0], EXPERT_PROJS[:2]
EXPERT_GROUPS = {_GATE_UP: _PARTS,
                 scale_name(_GATE_UP): tuple(scale_name(p) for p in _PARTS),
                 "gate_up_bias": ("gate_bias", "up_bias")}


def _out_axis(leaf: str) -> int:
    """The output-feature axis of a projection's leaf: nn.Dense's kernel is [in, out]; a quantized
    linear's weight [out, in], its scales and every bias [out]."""
    return 1 if leaf == "kernel" else 0


def _concat(parts: list, axis: int, donate: bool):
    if all(isinstance(p, np.ndarray) for p in parts):
        return np.concatenate(parts, axis=axis)
    out = jnp.concatenate(parts, axis=axis)
    if donate:
        for p in parts:
            p.delete()
    return out


def _fuse_expert_gate_up(moe: dict, donate: bool) -> dict:
    """A biased MoE layer's params with gate and up (stacks, scales, biases) fused."""
    if "gate_bias" not in moe or _PARTS[0] not in moe:
        return moe
    moe = dict(moe)
    for fused, parts in EXPERT_GROUPS.items():
        if all(p in moe for p in parts):
            moe[fused] = _concat([moe.pop(p) for p in parts], -1, donate)
    return moe


def fuse_projections(params: dict, *, donate: bool = False) -> dict:
    """`params` with every layer's q/k/v and gate/up projections fused, and its biased experts'
    gate/up stacks (a new tree; other leaves are shared). Already fused or absent groups are
    left as they are. `donate`: delete the separate projections' device buffers once fused, so
    the peak memory stays one layer's projections above the model's."""
    out = dict(params)
    for name, layer in params.items():
        if not name.startswith("layers_"):
            continue
        layer = dict(layer)
        if "moe" in layer:
            layer["moe"] = _fuse_expert_gate_up(layer["moe"], donate)
        for module, (fused, parts) in GROUPS.items():
            sub = layer.get(module)
            if sub is None or not all(p in sub for p in parts):
                continue
            sub = dict(sub)
            group = [sub.pop(p) for p in parts]
            sub[fused] = {leaf: _concat([g[leaf] for g in group], _out_axis(leaf), donate)
                          for leaf in group[0]}
            layer[module] = sub
        out[name] = layer
    return out


def is_fused(params: dict) -> bool:
    fused = [(module, name) for module, (name, _) in GROUPS.items()] + [("moe", _GATE_UP)]
    return any(name in layer.get(module, {}) for key, layer in params.items()
               if key.startswith("layers_") for module, name in fused)


def fuse_for_serving(params: dict, platform, cfg=None) -> dict:
    """The tree an engine serves on `platform` (kernel_table.Platform): fused (the loaded buffers
    donated) when every leaf lives on one GPU, where the fused q/k/v and gate/up matmuls are
    measured faster (gpt-oss's fused expert stack is not yet timed end to end:
    docs/kernels/grouped_matmul.md), and the shared experts stored in the expert stacks
    (shared_experts.py: one grouped call); else
    as loaded (a tree sharded over several devices; the CPU, where XLA's matmuls have no such
    tail). `cfg`: the model's config, whose family may run an MoE layer of its own that reads
    only the checkpoint's layout (shared_experts.stackable)."""
    devices = {d for leaf in jax.tree.leaves(params) for d in leaf.sharding.device_set}
    if len(devices) == 1 and platform.gpu:
        if stackable(cfg):
            params = fuse_shared_experts(params, donate=True)
        return fuse_projections(params, donate=True)
    return params


def project(module, dense: Callable, x: jax.Array, parts: Sequence[tuple[str, int]],
            fused: str, adapt: Callable | None = None) -> list[jax.Array]:
    """The outputs of the projections `parts` ((name, features), in fused order) of `x`: one
    matmul when `module`'s params hold them fused as `fused`, else one each. `dense(features,
    name=...)` makes a projection layer; `adapt(name, x, y)` adds to a projection's output what
    else belongs to it (the LoRA delta, lora/delta.py), before a fused output is split."""
    adapt = adapt or (lambda name, x, y: y)
    if module.has_variable("params", fused):
        y = adapt(fused, x, dense(sum(f for _, f in parts), name=fused)(x))
        return jnp.split(y, list(itertools.accumulate(f for _, f in parts))[:-1], axis=-1)
    return [adapt(n, x, dense(f, name=n)(x)) for n, f in parts]
