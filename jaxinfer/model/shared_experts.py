"""Shared experts (DeepSeek V2/V3: one always-on SwiGLU MLP of n_shared x moe_intermediate_size)
stored as n_shared extra experts of the routed stacks, so one grouped matmul runs routed and
shared rows and no separate MLP's three matmuls run per MoE layer.

The MLP of width S * F is exactly the sum of S experts of width F: SwiGLU acts per intermediate
column, so splitting gate/up's columns and down's rows into S slices of F and summing the slices'
outputs gives the same result. The router then sends every token to experts E .. E + S - 1 with
weight 1 (`routing.with_shared`, or the fused kernel's `RoutingSpec.shared`).

Checkpoints, initialisation and sharding keep the separate MLP; `fuse_shared_experts` rewrites a
loaded tree and the model runs whichever layout its params have (`stacked_shared`), as
fused_projections.py does for q/k/v. Only plain (unquantized, unbiased) trees are rewritten: a
quantized shared MLP stores [out, in] weights with per-row scales that the stacks' layout lacks.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

SHARED = "shared_experts"
STACKS = ("w_gate", "w_up", "w_down")


def _stacked(moe: dict, donate: bool) -> dict | None:
    """The MoE layer's params with its shared MLP moved into the stacks, or None where it has
    no plain shared MLP."""
    shared = moe.get(SHARED)
    parts = ("gate_proj", "up_proj", "down_proj")
    if shared is None or set(shared) != set(parts) or any(
            set(shared[p]) != {"kernel"} for p in parts) or not all(s in moe for s in STACKS):
        return None
    e, h, f = moe["w_gate"].shape
    width = shared["gate_proj"]["kernel"].shape[1]
    if width % f:
        return None
    s = width // f
    xp = np if isinstance(moe["w_gate"], np.ndarray) else jnp
    gate = xp.transpose(shared["gate_proj"]["kernel"].reshape(h, s, f), (1, 0, 2))  # [S, H, F]
    up = xp.transpose(shared["up_proj"]["kernel"].reshape(h, s, f), (1, 0, 2))
    down = shared["down_proj"]["kernel"].reshape(s, f, h)  # [S, F, H]
    out = {k: v for k, v in moe.items() if k != SHARED}
    for name, extra in zip(STACKS, (gate, up, down)):
        out[name] = xp.concatenate([moe[name], extra.astype(moe[name].dtype)], axis=0)
        if donate and xp is jnp:  # one stack's copy above the model at a time
            moe[name].delete()
    if donate and xp is jnp:
        for part in shared.values():
            part["kernel"].delete()
    return out


def fuse_shared_experts(params: dict, *, donate: bool = False) -> dict:
    """`params` with every MoE layer's plain shared MLP stored as extra experts after the routed
    ones (a new tree; other leaves are shared). Layers without one are left as they are.
    `donate`: delete the replaced device buffers as each stack is rewritten."""
    out = dict(params)
    for name, layer in params.items():
        if not name.startswith("layers_") or "moe" not in layer:
            continue
        moe = _stacked(layer["moe"], donate)
        if moe is not None:
            out[name] = {**layer, "moe": moe}
    return out


def stackable(cfg) -> bool:
    """Whether the model's MoE layers run their shared experts from the stacks: transformer.MoE
    does (`stacked_shared`); a family's own MoE layer (families.Family.moe: Llama 4's) reads the
    checkpoint's layout only. None (no config): the shared MoE."""
    from jaxinfer.model.families import family
    fam = cfg and family(cfg.architecture)
    return fam is None or fam.moe is None


def has_shared_mlp(params: dict) -> bool:
    """Whether some MoE layer of `params` holds its shared experts as a separate MLP."""
    return any(SHARED in layer.get("moe", {}) for name, layer in params.items()
               if name.startswith("layers_"))


def stacked_shared(module, n_shared: int) -> bool:
    """Whether `module` (the MoE layer) runs its shared experts from its stacks: the config has
    them and the loaded params hold no separate MLP (never while initialising, which declares the
    checkpoint layout)."""
    return bool(n_shared) and not module.is_initializing() and not module.has_variable(
        "params", SHARED)
