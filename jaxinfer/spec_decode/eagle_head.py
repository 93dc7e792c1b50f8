"""An EAGLE-3 head: its configuration, weights in the HF format vLLM and SGLang serve, and the
one-layer forward shared by the proposer (paged KV) and training (the training-time test).

The head reads three residual streams of the target (entering layers low / middle / high,
vLLM's `eagle_aux_hidden_state_layer_ids`, default (2, L // 2, L - 3)), fused by `fc`
[3 Ht -> H]. Its one decoder layer takes concat(input_norm(embed(token)), hidden_norm(hidden))
of width 2 H into attention (q/k/v from 2 H), adds the attention output to `hidden` (the
residual), then the MLP; `norm` of the sum gives the logits over its draft vocabulary
(`lm_head` [H -> Vd]) and the sum itself is the hidden input of the next draft step. A draft
token i is the target token i + d2t[i] (HF's `d2t` offsets).

HF tensors (optionally under `model.`; `layers.0.` is accepted for `midlayer.`): fc.weight,
midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight,
midlayer.self_attn.{q,k,v,o}_proj.weight, midlayer.mlp.{gate,up,down}_proj.weight, norm.weight,
lm_head.weight, d2t (int64 [Vd]), t2d (bool [V]), embed_tokens.weight (absent: the target's).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.errors import ConfigError
from jaxinfer.model.config import ModelConfig, config_from_dict
from jaxinfer.model.gemm_rows import Rows, dot, plain_rows
from jaxinfer.model.transformer import apply_rope, rope_tables

NORMS = ("input_norm", "hidden_norm", "post_attn_norm", "norm")
# our name -> HF name (a Linear's [out, in] weight is stored transposed here: x @ w)
_HF = {"fc": "fc.weight", "embed": "embed_tokens.weight", "lm_head": "lm_head.weight",
       "norm": "norm.weight", "input_norm": "midlayer.input_layernorm.weight",
       "hidden_norm": "midlayer.hidden_norm.weight",
       "post_attn_norm": "midlayer.post_attention_layernorm.weight",
       **{f"{p}_proj": f"midlayer.self_attn.{p}_proj.weight" for p in "qkvo"},
       **{f"{p}_proj": f"midlayer.mlp.{p}_proj.weight" for p in ("gate", "up", "down")}}
_LINEAR = {"fc", "lm_head", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
           "down_proj"}


@dataclasses.dataclass(frozen=True)
class Eagle3Config:
    layer: ModelConfig               # the head's decoder layer (num_layers 1; its rope, heads)
    draft_vocab_size: int
    target_hidden_size: int
    aux_layers: tuple[int, int, int]  # target layers whose input streams are fused

    @property
    def hidden_size(self) -> int:
        return self.layer.hidden_size

    # The proposer's interface (spec_decode/eagle.py; spec_decode/mtp.py's MTPConfig has it too).
    @property
    def stream_width(self) -> int:
        return 3 * self.target_hidden_size

    def fuse(self, p: dict, streams: jax.Array, rows: Rows = plain_rows) -> jax.Array:
        return fuse(p, streams, rows)

    def step(self, p: dict, embed, ids, hidden, positions, kv, md, kernels):
        """One head step over ragged rows with its paged cache `kv` (one layer's pair).
        -> (f32 logits over the target's vocabulary, the stream, the new kv tuple)"""
        out = {}

        def attend(q, k, v):
            k_cache, v_cache = kernels.attention.write_kv(*kv[0], k, v, md.slot_mapping)
            out["kv"] = ((k_cache, v_cache),)
            return kernels.attention(q, k_cache, v_cache, md, scale=self.layer.score_scale)
        normed, stream = layer(p, self, embed, ids, hidden, positions, attend, kernels.gemm_rows)
        return target_logits(p, normed, embed.shape[0], kernels.gemm_rows), stream, out["kv"]


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """vLLM's (2, L // 2, L - 3), clamped into a small target's layers."""
    return (min(2, num_layers - 1), num_layers // 2, max(num_layers - 3, 0))


def eagle3_config(raw: dict, target: ModelConfig) -> Eagle3Config:
    """From the head's config.json (a Llama config, architectures LlamaForCausalLMEagle3)."""
    layer_raw = dict(raw, architectures=["LlamaForCausalLM"], model_type="llama",
                     num_hidden_layers=1)
    layer = config_from_dict(layer_raw)
    if layer.vocab_size != target.vocab_size:
        raise ConfigError(f"speculative model: the EAGLE-3 head's vocab_size {layer.vocab_size} "
                          f"differs from the target's {target.vocab_size}")
    eagle = raw.get("eagle_config") or {}
    aux = eagle.get("eagle_aux_hidden_state_layer_ids") or default_aux_layers(target.num_layers)
    if len(aux) != 3 or not all(0 <= int(i) < target.num_layers for i in aux):
        raise ConfigError(f"speculative model: eagle_aux_hidden_state_layer_ids {aux!r} must be "
                          f"3 layers of the target's {target.num_layers}")
    return Eagle3Config(layer, int(raw.get("draft_vocab_size") or layer.vocab_size),
                        int(raw.get("target_hidden_size") or layer.hidden_size),
                        tuple(int(i) for i in aux))


def hf_config(cfg: Eagle3Config, target_raw: dict) -> dict:
    """config.json of a head for a target whose config.json is `target_raw`."""
    c = cfg.layer
    return {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
            "vocab_size": c.vocab_size, "draft_vocab_size": cfg.draft_vocab_size,
            "hidden_size": c.hidden_size, "target_hidden_size": cfg.target_hidden_size,
            "intermediate_size": c.intermediate_size, "num_hidden_layers": 1,
            "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads,
            "head_dim": c.head_dim, "hidden_act": "silu", "rms_norm_eps": c.rms_norm_eps,
            "rope_theta": target_raw.get("rope_theta", c.rope.theta),
            "max_position_embeddings": c.max_position_embeddings,
            "tie_word_embeddings": False, "torch_dtype": "bfloat16",
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(cfg.aux_layers)}}


def init_head(cfg: Eagle3Config, seed: int = 0, dtype=jnp.float32, std: float = 0.02,
              with_embed: bool = False) -> dict:
    """Random weights (norms at 1; d2t: the first Vd target tokens)."""
    c = cfg.layer
    h, f, d = c.hidden_size, c.intermediate_size, c.head_dim
    shapes = {"fc": (3 * cfg.target_hidden_size, h), "q_proj": (2 * h, c.num_heads * d),
              "k_proj": (2 * h, c.num_kv_heads * d), "v_proj": (2 * h, c.num_kv_heads * d),
              "o_proj": (c.num_heads * d, h), "gate_proj": (h, f), "up_proj": (h, f),
              "down_proj": (f, h), "lm_head": (h, cfg.draft_vocab_size)}
    if with_embed:
        shapes["embed"] = (c.vocab_size, h)
    rng = np.random.default_rng(seed)  # on the host: one small array each, no compilations
    p = {n: jnp.asarray(rng.standard_normal(s, np.float32) * std, dtype)
         for n, s in shapes.items()}
    p.update({n: jnp.ones((h,), dtype) for n in NORMS})
    p["d2t"] = jnp.zeros((cfg.draft_vocab_size,), jnp.int32)
    return p


def load_head(model_dir: str, target: ModelConfig, dtype) -> tuple[Eagle3Config, dict]:
    """The head of `model_dir` (config.json + *.safetensors), refused (ConfigError naming the
    directory) when its shapes do not fit the target."""
    from safetensors.numpy import load_file
    path = Path(model_dir)
    if not (path / "config.json").is_file():
        raise ConfigError(f"--speculative-config model {model_dir!r}: no config.json there")
    cfg = eagle3_config(json.loads((path / "config.json").read_text()), target)
    raw: dict[str, np.ndarray] = {}
    for f in sorted(path.glob("*.safetensors")):
        raw.update(load_file(f))
    names = {k.removeprefix("model.").replace("layers.0.", "midlayer."): v for k, v in raw.items()}
    params = {}
    for ours, theirs in _HF.items():
        if theirs not in names:
            if ours == "embed":
                continue
            raise ConfigError(f"--speculative-config model {model_dir!r}: tensor {theirs} "
                              f"is missing")
        w = names[theirs]
        params[ours] = jnp.asarray(w.T if ours in _LINEAR else w, dtype)
    vd = cfg.draft_vocab_size
    d2t = names.get("d2t", np.zeros(vd, np.int64))
    params["d2t"] = jnp.asarray(d2t, jnp.int32)
    expect = jax.eval_shape(lambda: init_head(cfg, with_embed="embed" in params))
    bad = [n for n, a in expect.items() if params[n].shape != a.shape]
    ids = np.arange(vd) + np.asarray(d2t)
    if bad or ids.min() < 0 or ids.max() >= target.vocab_size:
        raise ConfigError(f"--speculative-config model {model_dir!r}: shapes of "
                          f"{', '.join(bad) or 'd2t'} do not fit the target")
    if "embed" not in params and cfg.hidden_size != target.hidden_size:
        raise ConfigError(f"--speculative-config model {model_dir!r}: no embed_tokens and a "
                          f"hidden size unlike the target's")
    return cfg, params


def save_head(params: dict, cfg: Eagle3Config, target_raw: dict, out_dir: str | Path) -> None:
    """The head in the HF format (config.json + model.safetensors, bf16 weights)."""
    import ml_dtypes
    from safetensors.numpy import save_file
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for ours, theirs in _HF.items():
        if ours in params:
            w = np.asarray(jnp.asarray(params[ours], jnp.float32))
            tensors[theirs] = np.ascontiguousarray(w.T if ours in _LINEAR else w
                                                   ).astype(ml_dtypes.bfloat16)
    d2t = np.asarray(params["d2t"], np.int64)
    tensors["d2t"] = d2t
    t2d = np.zeros(cfg.layer.vocab_size, bool)
    t2d[np.arange(len(d2t)) + d2t] = True
    tensors["t2d"] = t2d
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf_config(cfg, target_raw), indent=2) + "\n")


def rms(x, w, eps):
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf * w.astype(jnp.float32)).astype(x.dtype)


def fuse(p: dict, aux: jax.Array, rows: Rows = plain_rows) -> jax.Array:
    """The target's three streams [..., 3 Ht] -> the head's hidden input [..., H]. `rows`: the
    kernel table's `gemm_rows` (every product of the head goes through it)."""
    return dot(aux.astype(p["fc"].dtype), p["fc"], rows)


def layer(p: dict, cfg: Eagle3Config, embed_table, tokens, hidden, positions,
          attend: Callable, rows: Rows = plain_rows) -> tuple[jax.Array, jax.Array]:
    """The head's decoder layer. tokens [...], hidden [..., H] (fused streams or the previous
    step's output), positions [...]; `attend(q, k, v)` (q [..., Hq, D], k/v [..., Hkv, D]) is the
    caller's attention (paged or training-time-test). -> (final-normed [..., H], the stream
    [..., H] that is the next step's hidden input)."""
    c = cfg.layer
    dtype = p["o_proj"].dtype
    embeds = embed_table[tokens].astype(dtype)
    hidden = hidden.astype(dtype)
    x = jnp.concatenate([rms(embeds, p["input_norm"], c.rms_norm_eps),
                         rms(hidden, p["hidden_norm"], c.rms_norm_eps)], axis=-1)
    lead = x.shape[:-1]
    if "qkv_proj" in p:  # the serving layout (`fuse_projections`)
        nq, nk = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        q, k, v = jnp.split(dot(x, p["qkv_proj"], rows), [nq, nq + nk], axis=-1)
    else:
        q, k, v = (dot(x, p[f"{n}_proj"], rows) for n in "qkv")
    q = q.reshape(*lead, c.num_heads, c.head_dim)
    k = k.reshape(*lead, c.num_kv_heads, c.head_dim)
    v = v.reshape(*lead, c.num_kv_heads, c.head_dim)
    cos, sin = rope_tables(c, positions)
    out = attend(apply_rope(q, cos, sin), apply_rope(k, cos, sin), v)
    stream = dot(out.reshape(*lead, -1).astype(dtype), p["o_proj"], rows) + hidden
    h = rms(stream, p["post_attn_norm"], c.rms_norm_eps)
    if "gate_up_proj" in p:
        gate, up = jnp.split(dot(h, p["gate_up_proj"], rows), 2, axis=-1)
    else:
        gate, up = dot(h, p["gate_proj"], rows), dot(h, p["up_proj"], rows)
    stream = stream + dot(jax.nn.silu(gate) * up, p["down_proj"], rows)
    return rms(stream, p["norm"], c.rms_norm_eps), stream


def fuse_projections(p: dict) -> dict:
    """The serving layout: q/k/v as one `qkv_proj` and gate/up as one `gate_up_proj` (a chain step
    is one token a row: one product reads the weights of two or three, as the target's
    `model/fused_projections.py` does). Training and the HF files keep them apart."""
    p = dict(p)
    p["qkv_proj"] = jnp.concatenate([p.pop(f"{n}_proj") for n in "qkv"], axis=1)
    p["gate_up_proj"] = jnp.concatenate([p.pop("gate_proj"), p.pop("up_proj")], axis=1)
    return p


def draft_logits(p: dict, normed: jax.Array, rows: Rows = plain_rows) -> jax.Array:
    """f32 logits over the draft vocabulary [..., Vd] (the product in the weights' dtype: XLA:CPU
    has no bf16 x bf16 -> f32 dot inside a loop; q only has to be the distribution proposals are
    drawn from, which it is at any precision)."""
    return dot(normed, p["lm_head"], rows).astype(jnp.float32)


def target_logits(p: dict, normed: jax.Array, vocab_size: int,
                  rows: Rows = plain_rows) -> jax.Array:
    """f32 logits over the target's vocabulary, -inf outside the draft vocabulary (d2t)."""
    small = draft_logits(p, normed, rows)
    ids = jnp.arange(small.shape[-1]) + p["d2t"]
    full = jnp.full((*small.shape[:-1], vocab_size), -jnp.inf, jnp.float32)
    return full.at[..., ids].set(small)
