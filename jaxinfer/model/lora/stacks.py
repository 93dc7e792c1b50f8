"""The device side of LoRA: every adapter slot's weights stacked per layer and projection.

`params["lora"]` mirrors the module tree of the params: `layers_{i}/{attn,mlp}/{name}` holds
A [max_loras + 1, in, P * R] and B [max_loras + 1, P * R, out] (R = max_lora_rank, padded with
zeros; the adapter's scale folded into B). Slot 0 is all zeros: the rows of no adapter. `name` is
the projection as the params store it, so a fused projection (fused_projections.py: `qkv_proj`,
`gate_up_proj`) gets its P parts' A matrices side by side (one shrink feeds the fused matrix) and
their B matrices block-diagonal. Every supported projection has a stack whether or not a loaded
adapter targets it, so a new adapter never changes a shape (no recompilation).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.model.config import ModelConfig
from jaxinfer.model.fused_projections import GROUPS
from jaxinfer.model.lora.peft import LoRAAdapter, layer_projections, projection_shape

LORA = "lora"  # the params key of the stacks


def lora_layout(cfg: ModelConfig, params: dict) -> dict[tuple[str, str, str], tuple[str, ...]]:
    """(layer, module, stored projection) -> the adapter projections it holds, in output order."""
    layout = {}
    for i in range(cfg.num_layers):
        layer = f"layers_{i}"
        for proj in layer_projections(cfg, i):
            module = "attn" if proj in GROUPS["attn"][1] + ("o_proj",) else "mlp"
            fused, parts = GROUPS[module]
            if proj in parts and fused in params[layer].get(module, {}):
                layout.setdefault((layer, module, fused), parts)
            else:
                layout[(layer, module, proj)] = (proj,)
    return layout


def stack_width(parts: int, rank: int, pow2: bool) -> int:
    """The rank columns of a stack of `parts` projections: P * R, or with `pow2` (the Pallas
    kernels' dot needs it) the next power of two >= 16; part p's columns start at p * (W // P)."""
    width = parts * rank
    return max(16, 1 << (width - 1).bit_length()) if pow2 else width


def _leaf_shape(cfg: ModelConfig, parts: tuple[str, ...], rank: int,
                pow2: bool) -> tuple[tuple, tuple]:
    fan_in = projection_shape(cfg, parts[0])[0]
    out = sum(projection_shape(cfg, p)[1] for p in parts)
    width = stack_width(len(parts), rank, pow2)
    return (fan_in, width), (width, out)


def empty_stacks(cfg: ModelConfig, params: dict, max_loras: int, max_rank: int, dtype,
                 sharding=None, pow2: bool = False) -> dict:
    """Zeroed stacks for `max_loras` adapter slots (+ slot 0) of rank up to `max_rank`; `pow2`:
    widths rounded up for the Pallas kernels (`stack_width`)."""
    tree: dict = {}
    for (layer, module, name), parts in lora_layout(cfg, params).items():
        a, b = _leaf_shape(cfg, parts, max_rank, pow2)
        tree.setdefault(layer, {}).setdefault(module, {})[name] = {
            "A": jax.ShapeDtypeStruct((max_loras + 1, *a), dtype),
            "B": jax.ShapeDtypeStruct((max_loras + 1, *b), dtype)}
    return jax.jit(lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), tree),
                   out_shardings=sharding)()


def slot_arrays(adapter: LoRAAdapter | None, cfg: ModelConfig, stacks: dict) -> dict:
    """One slot's host arrays for `adapter` (None: zeros), laid out like `stacks`' leaves."""
    out: dict = {}
    for layer, modules in stacks.items():
        i = int(layer.removeprefix("layers_"))
        for module, names in modules.items():
            for name, leaf in names.items():
                a_full = np.zeros(leaf["A"].shape[1:], np.float32)
                b_full = np.zeros(leaf["B"].shape[1:], np.float32)
                parts = GROUPS[module][1] if name == GROUPS[module][0] else (name,)
                rank = a_full.shape[1] // len(parts)  # (stack_width's part stride)
                col = 0
                for p, proj in enumerate(parts):
                    width = projection_shape(cfg, proj)[1]
                    ab = adapter.weights.get((i, proj)) if adapter is not None else None
                    if ab is not None:
                        a, b = ab
                        r = a.shape[1]
                        a_full[:, p * rank:p * rank + r] = a
                        b_full[p * rank:p * rank + r, col:col + width] = b * adapter.scaling
                    col += width
                out.setdefault(layer, {}).setdefault(module, {})[name] = {"A": a_full, "B": b_full}
    return out


@functools.partial(jax.jit, donate_argnums=0)
def _write(stacks: dict, slot: jax.Array, arrays: dict) -> dict:
    return jax.tree.map(lambda s, v: s.at[slot].set(v.astype(s.dtype)), stacks, arrays)


def write_slot(stacks: dict, slot: int, arrays: dict) -> dict:
    """`stacks` with slot `slot` replaced by `arrays` (slot_arrays' host tree), in place: the
    stacks are donated, and the slot index is an argument, so every slot shares one compilation."""
    return _write(stacks, jnp.int32(slot), arrays)
