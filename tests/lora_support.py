"""Shared pieces of the LoRA tests: random PEFT adapters and the base weights with one merged in."""

from __future__ import annotations

import jax
import numpy as np

from jaxinfer.model.lora.peft import LoRAAdapter, layer_projections, projection_shape


def random_adapter(cfg, rank: int, seed: int, scale: float = 0.3, alpha: float | None = None,
                   projs: tuple[str, ...] | None = None) -> LoRAAdapter:
    """An adapter on every supported projection (or `projs`) of every layer, A and B random (PEFT
    starts B at zero; a trained one is not), lora_alpha = 2 r unless given."""
    rng = np.random.default_rng(seed)
    weights = {}
    for layer in range(cfg.num_layers):
        for proj in layer_projections(cfg, layer):
            if projs is not None and proj not in projs:
                continue
            fan_in, fan_out = projection_shape(cfg, proj)
            weights[(layer, proj)] = (rng.normal(0, scale, (fan_in, rank)).astype(np.float32),
                                      rng.normal(0, scale, (rank, fan_out)).astype(np.float32))
    alpha = 2.0 * rank if alpha is None else alpha
    return LoRAAdapter(f"adapter{seed}", rank, alpha / rank, weights)


def merged(params: dict, adapter: LoRAAdapter) -> dict:
    """`params` (unfused, unquantized) with W + s·A·B in every projection the adapter targets."""
    out = jax.tree.map(np.asarray, params)
    for (layer, proj), (a, b) in adapter.weights.items():
        module = "attn" if proj in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
        leaf = out[f"layers_{layer}"][module][proj]
        leaf["kernel"] = (leaf["kernel"] + adapter.scaling * (a @ b)).astype(leaf["kernel"].dtype)
    return out
