"""A checkpoint's multi-token-prediction (MTP) module as a speculative proposer
(`--speculative-config '{"method": "mtp", "num_speculative_tokens": k}'`; vLLM's names `mtp`,
`deepseek_mtp` and `qwen3_next_mtp`): DeepSeek-V3's (`num_nextn_predict_layers` >= 1) and
Qwen3-Next's (model/qwen3_next.py), one computation in two checkpoint layouts
(families.MTPLayout).

DeepSeek keeps the module as checkpoint layer L = num_hidden_layers (`model.layers.L.*`):
`enorm`, `hnorm`, `eh_proj` [H, 2 H], a full decoder layer (MLA + MoE, the target's
`DecoderLayer`) and `shared_head.{norm,head}`. Qwen3-Next keeps it under `mtp.*`:
`pre_fc_norm_embedding`, `pre_fc_norm_hidden`, `fc` [H, 2 H], `layers.0` (a full-attention layer
of the family: gated attention + MoE with a shared expert) and `norm`, with the target's LM head.
At position t it reads token t + 1 and the target's final-normed hidden state of position t (what
vLLM's deepseek_mtp and qwen3_next_mtp read) and predicts token t + 2:

    e = embed(token) (DeepSeek: zero at position 0, as vLLM masks it)
    x = eh_proj [enorm(e), hnorm(h)]
    s = x + attn(input_norm(x)) ; s = s + mlp(post_attn_norm(s))     (the decoder layer)
    logits = head(norm(s)),   the next draft step's h: s (DeepSeek's), norm(s) (Qwen3-Next's)

It runs in the EAGLE proposer's machinery (spec_decode/eagle.py: the target writes the streams
of every step it runs, the module's one-layer paged cache lives in the target's block ids, a
catch-up pass, then a chain of k steps, the same module each step: vLLM's and TensorRT-LLM's
"MTP Eagle" mode for k above the checkpoint's one module). Only the first MTP module is used.
The embedding is the target's (both share it; a copy under the module is not kept). The norms
are the target's kind (Qwen3-Next's (1 + w), ModelConfig.norm_offset).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp

from jaxinfer.errors import ConfigError
from jaxinfer.model import families
from jaxinfer.model.config import ModelConfig
from jaxinfer.model.families import MTPLayout
from jaxinfer.model.gemm_rows import Rows, dot, plain_rows
from jaxinfer.model.norm_rope import RMSNorm, rope_tables
from jaxinfer.model.tensor_sources import Checkpoint
from jaxinfer.model.transformer import DecoderLayer
from jaxinfer.model.weights import load_safetensors, safetensors_files


@dataclasses.dataclass(frozen=True)
class MTPConfig:
    """The module as a one-layer model: `layer` (the target's config, one full-attention layer,
    MoE where the checkpoint's is) sizes its paged cache; its input stream is the target's
    final-normed hidden state; `layout` says where the families differ."""
    layer: ModelConfig
    target_layers: int
    layout: MTPLayout = MTPLayout()

    @property
    def aux_layers(self) -> tuple[int]:
        return (self.target_layers,)  # forward_aux: the final-normed hidden

    @property
    def stream_width(self) -> int:
        return self.layer.hidden_size

    def fuse(self, p: dict, streams: jax.Array, rows: Rows = plain_rows) -> jax.Array:
        return streams  # one stream, read as is (hnorm is part of the step): no product


    def step(self, p: dict, embed, ids, hidden, positions, kv, md, kernels):
        """One module application over ragged rows (paged: kv is its one layer's pair).
        -> (f32 logits [..., V], the stream [..., H] for the next step, the new kv tuple)"""
        c = self.layer
        dtype = p["eh_proj"].dtype

        def norm(w, x):
            return RMSNorm(c.rms_norm_eps, dtype, offset=c.norm_offset).apply(
                {"params": {"weight": w}}, x)

        e = embed[ids].astype(dtype)
        if self.layout.masks_position_0:
            e = jnp.where((positions == 0)[..., None], 0, e)
        x = dot(jnp.concatenate([norm(p["enorm"], e), norm(p["hnorm"], hidden.astype(dtype))],
                                axis=-1), p["eh_proj"], kernels.gemm_rows)
        cos, sin = rope_tables(c, positions)
        x, delta, new_kv = DecoderLayer(c, kernels, dtype, c.layer_is_moe(0)).apply(
            {"params": p["layers_0"]}, x, None, cos, sin, kv[0], md)
        stream = x + delta
        normed = norm(p["final_norm"]["weight"], stream)
        logits = dot(normed, p["lm_head"]["kernel"], kernels.gemm_rows,
                     preferred_element_type=jnp.float32)
        return logits, normed if self.layout.chains_normed else stream, (new_kv,)


def mtp_config(target: ModelConfig, moe: bool) -> MTPConfig:
    """The module as a one-layer model of the target's family (`moe`: its MLP is the family's
    MoE, as the checkpoint says)."""
    layer = dataclasses.replace(target, num_layers=1, moe_layers=(moe,), mtp_layers=0,
                                layer_windows=(), layer_states=())
    return MTPConfig(layer, target.num_layers, families.family(target.architecture).mtp)


class _ModuleView(Checkpoint):
    """The checkpoint's MTP module as a one-layer model's tensors: its decoder layer as layer 0,
    its norm and LM head (or the target's) as the final norm and LM head, the target's
    embedding; its own enorm / hnorm / eh_proj apart (`own`: role -> checkpoint name)."""

    def __init__(self, base: Checkpoint, layout: MTPLayout, target_layers: int):
        self.prefix = layout.prefix.format(layers=target_layers)
        roles = dict(layout.own)
        self.base, self.alias, self.own = base, {}, {}
        for name in base.names():
            if not name.startswith(self.prefix):
                continue
            rest = name[len(self.prefix):]
            if rest.split(".")[0] in roles:
                self.own[roles[rest.split(".")[0]]] = name
            elif rest == layout.norm:
                self.alias["model.norm.weight"] = name
            elif rest == layout.head:
                self.alias["lm_head.weight"] = name
            elif rest.startswith(layout.layer) and rest != "embed_tokens.weight":
                self.alias["model.layers.0." + rest[len(layout.layer):]] = name
        if layout.head is None and "lm_head.weight" in base.dtypes:
            self.alias["lm_head.weight"] = "lm_head.weight"
        self.alias["model.embed_tokens.weight"] = "model.embed_tokens.weight"
        self.dtypes = {new: base.dtypes[old] for new, old in self.alias.items()}
        self.raw = {}

    def names(self) -> list[str]:
        return list(self.alias)

    def file_of(self, name: str):
        return self.base.file_of(self.alias[name])

    def shape(self, name: str) -> tuple[int, ...]:
        return self.base.shape(self.alias[name])

    def read(self, name: str, index) -> jax.Array:
        return self.base.read(self.alias[name], index)


def load_mtp(model_dir: str, target: ModelConfig, dtype):
    """The first MTP module of the checkpoint in `model_dir` as an EAGLE-style proposer."""
    from jaxinfer.spec_decode.eagle import EagleProposer
    if not target.mtp_layers:
        raise ConfigError("--speculative-config method mtp: the model has no multi-token-"
                          "prediction layer (config.json num_nextn_predict_layers is 0)")
    layout = families.family(target.architecture).mtp
    base = Checkpoint(safetensors_files(Path(model_dir)))
    view = _ModuleView(base, layout, target.num_layers)
    missing = [view.prefix + name for name, role in layout.own if role not in view.own]
    if "lm_head.weight" not in view.alias:
        missing.append(view.prefix + layout.head if layout.head else "lm_head.weight")
    if missing:
        raise ConfigError(f"--speculative-config method mtp: '{model_dir}' has no {missing[0]} "
                          f"tensor (num_nextn_predict_layers says the MTP module is there)")
    # A MoE layer's router says which MLP the module's layer has.
    cfg = mtp_config(target, "model.layers.0.mlp.gate.weight" in view.alias)
    params = load_safetensors(model_dir, cfg.layer, dtype, progress=False, checkpoint=view)
    params.pop("embed")
    for name, full in view.own.items():
        w = base.read(full, (slice(None),) * len(base.shape(full)))
        params[name] = jnp.asarray(w.T if name == "eh_proj" else w, dtype)
    return EagleProposer(cfg, params)
