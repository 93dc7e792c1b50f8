"""The transformer: one functional Flax (linen) model for every supported family.

`forward` is a pure function of (params, token ids, positions, KV cache, attention metadata) that
returns (logits, updated KV cache), so the engine jits it with the cache donated. Family differences
(biases, q/k norm, tied embeddings, MoE layers; Gemma's (1 + w) sandwich norms, GeGLU, scaled
embeddings and soft-caps; sliding windows, chunks, sinks, partial and per-layer rope; gpt-oss's
experts) are `ModelConfig` fields (families.py says which family sets which); a family with
layers of its own (glm4_moe.py, llama4.py) composes them from these and swaps them in through its
`Family` (the attention of each layer, the MoE). Every kernel (attention, the
add + norm, experts, quantized matmuls, LoRA) comes from the kernel table the caller passes
(kernel_table.py).

Shapes: T tokens of a flat (ragged) batch; H hidden; Hq / Hkv heads; D head_dim; E experts.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxinfer.errors import ConfigError
from jaxinfer.model import families
from jaxinfer.model.config import ModelConfig
from jaxinfer.model.fused_projections import project
from jaxinfer.model.gemm_rows import Dense
from jaxinfer.model.kernel_table import REFERENCE_KERNELS, KernelTable
from jaxinfer.model.lora.stacks import LORA
from jaxinfer.model.quant.layers import expert_weights, linear
from jaxinfer.model.kv_specs import (ChunkedLocalAttentionSpec, FixedStateSpec,
                                     FullAttentionSpec, KVCacheSpec, MLAAttentionSpec,
                                     SlidingWindowSpec)
from jaxinfer.model.mla import MLAttention
from jaxinfer.model.norm_rope import RMSNorm, apply_rope, rope_tables
from jaxinfer.model.shared_experts import stacked_shared
from jaxinfer.model.ssm_kernels import ShapeOnlyGatedDeltaNetKernels, ShapeOnlyMamba2Kernels
from pallas_kernels.attention.metadata import AttentionMetadata
from pallas_kernels.moe.grouped_matmul import ClampedSwiGLU

# Per layer (k_cache, v_cache) in the head-major paged layout [num_kv_heads, num_blocks, block_size,
# head_dim]; a tuple so it is a pytree that jit can donate. Allocated by the worker.
KVCache = tuple[tuple[jax.Array, jax.Array], ...]

Params = dict


class Attention(nn.Module):
    cfg: ModelConfig
    kernels: KernelTable
    dtype: jnp.dtype
    window: int | None = None  # this layer's sliding window; None: full attention
    chunk: int | None = None  # this layer's attention chunk (chunked local); None: not chunked
    layer: int = 0  # which layer (a family's attention may differ per layer)

    @nn.compact
    def __call__(self, x, cos, sin, kv=None, md=None, lora_slot=None, positions=None):
        """Paged path: x [T, H] with kv=(k_cache, v_cache) and md. Dense path (training):
        x [B, L, H] with kv=None, causal within each row. `lora_slot` i32[T]: each token's LoRA
        slot (None: no LoRA). `positions` (x's leading shape): unused here, read by a family's
        attention (Llama 4's temperature tuning)."""
        cfg = self.cfg
        q, k, v = self.qkv(x, lora_slot)
        if cfg.qk_norm:  # Qwen3, Gemma 3: RMSNorm over head_dim, per head, before RoPE
            q = RMSNorm(cfg.rms_norm_eps, self.dtype, offset=cfg.norm_offset, name="q_norm")(q)
            k = RMSNorm(cfg.rms_norm_eps, self.dtype, offset=cfg.norm_offset, name="k_norm")(k)
        self.sow_kv(k, v)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out, new_kv = self.attend(q, k, v, kv, md)
        return self.output(out, lora_slot), new_kv

    # The steps of __call__, which a family's attention (families.py) composes with its own.

    def qkv(self, x, lora_slot=None):
        """q [..., Hq, D], k and v [..., Hkv, D] of x [..., H]."""
        cfg, d = self.cfg, self.cfg.head_dim
        dense = linear(cfg, self.dtype, self.kernels)
        adapt = functools.partial(self.kernels.lora_delta, self, lora_slot)
        q, k, v = project(self, functools.partial(dense, use_bias=cfg.qkv_bias), x,
                          (("q_proj", cfg.num_heads * d), ("k_proj", cfg.num_kv_heads * d),
                           ("v_proj", cfg.num_kv_heads * d)), "qkv_proj", adapt)
        return (q.reshape(*x.shape[:-1], cfg.num_heads, d),
                k.reshape(*x.shape[:-1], cfg.num_kv_heads, d),
                v.reshape(*x.shape[:-1], cfg.num_kv_heads, d))

    def sow_kv(self, k, v):
        """What the KV cache will hold, before RoPE, for fp8 scale calibration (kv_scales.py); a
        no-op unless applied with mutable "intermediates". Sown here, not captured from the
        projections, so fused (qkv_proj) and split layouts calibrate alike."""
        self.sow("intermediates", "k", k)
        self.sow("intermediates", "v", v)

    def attend(self, q, k, v, kv=None, md=None):
        """-> (attention output [..., Hq, D], the new (k_cache, v_cache) or None): the paged
        kernels with kv and md, else the dense causal path; this layer's window or chunk."""
        cfg = self.cfg
        variant = dict(scale=cfg.score_scale, softcap=cfg.attn_softcap, window=self.window)
        if self.chunk is not None:
            variant["chunk"] = self.chunk
        if cfg.attn_sinks:  # gpt-oss: one logit per query head in the softmax denominator
            sinks = self.param("sinks", nn.initializers.zeros, (cfg.num_heads,), self.dtype)
            variant["sinks"] = sinks.astype(jnp.float32)
        if kv is None:
            return self.kernels.dense_attention(q, k, v, **variant), None
        attention = self.kernels.attention
        k_cache, v_cache = attention.write_kv(*kv, k, v, md.slot_mapping)
        return attention(q, k_cache, v_cache, md, **variant), (k_cache, v_cache)

    def output(self, out, lora_slot=None):
        """o_proj of the heads' outputs [..., Hq, D] -> [..., H]."""
        cfg = self.cfg
        dense = linear(cfg, self.dtype, self.kernels)
        adapt = functools.partial(self.kernels.lora_delta, self, lora_slot)
        out = out.reshape(*out.shape[:-2], cfg.num_heads * cfg.head_dim)
        return adapt("o_proj", out, dense(cfg.hidden_size, use_bias=cfg.o_bias, name="o_proj")(out))


ACTIVATIONS = {"silu": nn.silu, "gelu_tanh": functools.partial(nn.gelu, approximate=True)}


class MLP(nn.Module):
    """Gated MLP: down(act(gate(x)) * up(x)), SwiGLU (silu) or GeGLU (Gemma: gelu, tanh
    approximation); gate and up may be stored fused (fused_projections)."""
    cfg: ModelConfig
    dtype: jnp.dtype
    kernels: KernelTable = REFERENCE_KERNELS

    @nn.compact
    def __call__(self, x, lora_slot=None):
        dense = functools.partial(linear(self.cfg, self.dtype, self.kernels),
                                  use_bias=self.cfg.mlp_bias)
        adapt = functools.partial(self.kernels.lora_delta, self, lora_slot)
        f = self.cfg.intermediate_size
        gate, up = project(self, dense, x, (("gate_proj", f), ("up_proj", f)), "gate_up_proj",
                           adapt)
        h = ACTIVATIONS[self.cfg.hidden_act](gate) * up
        return adapt("down_proj", h, dense(self.cfg.hidden_size, name="down_proj")(h))


class MoE(nn.Module):
    """Top-k routed SwiGLU experts. Routing (top-k, renormalisation) happens here; the routed rows go
    through the kernel table's `routed_experts`: `routed_experts` on one device, its `shard_map`
    over the replica's mesh under tensor parallelism (jaxinfer/parallel/kernels.py).

    gpt-oss: the router has a bias and the weights are a softmax over the top-k logits; the
    experts have biases and the clamped SwiGLU (`ClampedSwiGLU`). Gate/up biases go in with the
    routed rows; the down bias is added here, weighted by the routing weights, once per token
    (inside, a tensor-parallel partial sum would add it once per device)."""
    cfg: ModelConfig
    dtype: jnp.dtype
    kernels: KernelTable = REFERENCE_KERNELS

    @nn.compact
    def __call__(self, x):
        cfg = self.cfg
        e, h = cfg.num_experts, cfg.hidden_size
        lead = x.shape[:-1]
        x = x.reshape(-1, h)
        router = self.param("router", nn.initializers.lecun_normal(), (h, e), self.dtype)
        # Shared experts stored after the routed ones (model/shared_experts.py): the router sends
        # every token to them too, weight 1, and the one grouped call runs them.
        in_stacks = cfg.n_shared_experts if stacked_shared(self, cfg.n_shared_experts) else 0
        experts_w, scales = expert_weights(
            self, dataclasses.replace(cfg, num_experts=e + in_stacks), self.dtype)

        logits = self.kernels.gemm_rows(
            lambda x: jnp.dot(x, router, preferred_element_type=jnp.float32), x, x.shape[0],
            h * e)  # [T, E]
        if cfg.router_bias:
            logits = logits + self.param("router_bias", nn.initializers.zeros, (e,),
                                         self.dtype).astype(jnp.float32)
        # DeepSeek-V3's e_score_correction_bias stays float32 whatever the model dtype (HF keeps
        # it so: _keep_in_fp32_modules_strict): its values differ between experts by less than
        # bf16 resolves, and they decide the routing.
        score_bias = (self.param("score_bias", nn.initializers.zeros, (e,), jnp.float32)
                      if cfg.score_correction_bias else None)
        weights, experts, dispatch = self.kernels.routing(cfg, logits, score_bias,
                                                          in_stacks)  # [T, k + in_stacks]
        extra = {} if dispatch is None else {"dispatch": dispatch}
        if cfg.expert_bias:
            f = cfg.moe_intermediate_size
            zeros = nn.initializers.zeros
            if self.has_variable("params", "gate_up_bias"):  # beside a fused gate/up stack
                extra["biases"] = (self.param("gate_up_bias", zeros, (e, 2 * f), self.dtype),)
            else:
                extra["biases"] = (self.param("gate_bias", zeros, (e, f), self.dtype),
                                   self.param("up_bias", zeros, (e, f), self.dtype))
            b_down = self.param("down_bias", zeros, (e, h), self.dtype)
        if cfg.swiglu_clamp:
            extra["glu"] = ClampedSwiGLU(*cfg.swiglu_clamp)
        out = self.kernels.routed_experts(x, experts, weights, experts_w, scales, **extra)
        if cfg.expert_bias:
            down = jnp.einsum("tkh,tk->th", b_down[experts].astype(jnp.float32), weights)
            out = (out.astype(jnp.float32) + down).astype(x.dtype)
        if cfg.n_shared_experts and not in_stacks:  # DeepSeek: an always-on MLP beside them
            shared = dataclasses.replace(
                cfg, intermediate_size=cfg.n_shared_experts * cfg.moe_intermediate_size)
            out = out + MLP(shared, self.dtype, self.kernels, name="shared_experts")(x)
        return out.reshape(*lead, h)


def _attention(cfg: ModelConfig, spec: KVCacheSpec, kernels: KernelTable,
               dtype: jnp.dtype, layer: int) -> nn.Module:
    """The attention module a layer of this KV-cache spec runs (kv_specs.py): the spec picks the
    kernels and their window or chunk; a family with attention of its own (families.py) swaps
    its module in for `Attention`."""
    if isinstance(spec, MLAAttentionSpec):
        return MLAttention(cfg, kernels, dtype, name="attn")
    family = families.family(cfg.architecture)
    if isinstance(spec, FixedStateSpec) and family.state_layer is not None:
        return family.state_layer(cfg, kernels, dtype, layer=layer,
                                  name=family.state_layer_name)
    module = family.attention or Attention
    if type(spec) in (FullAttentionSpec, SlidingWindowSpec):
        return module(cfg, kernels, dtype, spec.window, layer=layer, name="attn")
    if type(spec) is ChunkedLocalAttentionSpec:
        return module(cfg, kernels, dtype, chunk=spec.attention_chunk, layer=layer, name="attn")
    raise ConfigError(f"{cfg.architecture}: no attention kernel runs {spec.label} layers yet "
                      f"(docs/feature_matrix.md)")


class DecoderLayer(nn.Module):
    cfg: ModelConfig
    kernels: KernelTable
    dtype: jnp.dtype
    moe: bool
    kv_spec: KVCacheSpec | None = None  # this layer's (None: the config's first layer's)
    layer: int = 0

    @nn.compact
    def __call__(self, x, delta, cos, sin, kv=None, md=None, lora_slot=None, positions=None):
        """-> (residual stream, this layer's MLP output, new KV): the stream after the layer is
        their sum, which the next norm adds (`delta`: the previous layer's MLP output, None in the
        first layer), so the table's add + norm kernel does both."""
        cfg = self.cfg
        norm = functools.partial(RMSNorm, cfg.rms_norm_eps, self.dtype,
                                 self.kernels.add_rms_norm, cfg.norm_offset)
        if delta is None:
            h = norm(name="input_norm")(x)
        else:
            x, h = norm(name="input_norm")(x, delta)
        spec = self.kv_spec or cfg.layer_kv_specs()[0]
        attn_out, new_kv = _attention(cfg, spec, self.kernels, self.dtype, self.layer)(
            h, cos, sin, kv, md, lora_slot, positions)
        attn_out = _times(attn_out, cfg.residual_multiplier)
        if cfg.sandwich_norms:  # Gemma: attention and MLP outputs are normed before the add
            attn_out = norm(name="post_attn_norm")(attn_out)
            x, h = norm(name="pre_ff_norm")(x, attn_out)
        else:
            x, h = norm(name="post_attn_norm")(x, attn_out)
        if self.moe:
            moe = families.family(cfg.architecture).moe or MoE
            out = moe(cfg, self.dtype, self.kernels, name="moe")(h)
        else:
            out = MLP(cfg, self.dtype, self.kernels, name="mlp")(h, lora_slot)
        out = _times(out, cfg.residual_multiplier)
        if cfg.sandwich_norms:
            out = norm(name="post_ff_norm")(out)
        return x, out, new_kv


class Transformer(nn.Module):
    cfg: ModelConfig
    kernels: KernelTable = REFERENCE_KERNELS
    dtype: jnp.dtype = jnp.bfloat16

    @nn.compact
    def __call__(self, token_ids, positions, kv_cache=None, md=None, logits_indices=None,
                 return_hidden: bool = False, lora_slot=None):
        cfg = self.cfg
        embed = nn.Embed(cfg.vocab_size, cfg.hidden_size, dtype=self.dtype, param_dtype=self.dtype,
                         name="embed")
        x, delta = embed(token_ids), None
        if cfg.embed_scale:  # Gemma: sqrt(hidden) rounded to the embedding dtype, as HF does
            x = x * jnp.asarray(math.sqrt(cfg.hidden_size), self.dtype)
        x = _times(x, cfg.embedding_multiplier)
        ropes = {rope: rope_tables(cfg, positions, rope)
                 for rope in {cfg.layer_rope(i) for i in range(cfg.num_layers)}}
        # One K/V array pair per cache slot; with KV groups layers of different groups share a
        # slot (md.kv_layout), each writing only its own group's blocks.
        new_cache = None if kv_cache is None else list(kv_cache)
        kv_specs = cfg.layer_kv_specs()
        for i in range(cfg.num_layers):
            slot, layer_md = (i, md) if md is None else md.for_layer(i)
            kv = None if kv_cache is None else new_cache[slot]
            kernels = self.kernels.for_layer(i)
            cos, sin = ropes[cfg.layer_rope(i)]
            if self.is_mutable_collection("aux"):  # EAGLE-3's streams entering layers (forward_aux)
                self.sow("aux", f"layer_{i}", x if delta is None else x + delta)
            with jax.named_scope(f"layer_{i}"):
                x, delta, layer_kv = DecoderLayer(cfg, kernels, self.dtype, cfg.layer_is_moe(i),
                                                  kv_specs[i], i, name=f"layers_{i}")(
                    x, delta, cos, sin, kv, layer_md, lora_slot, positions)
            if new_cache is not None:
                new_cache[slot] = layer_kv
        _, hidden = RMSNorm(cfg.rms_norm_eps, self.dtype, self.kernels.add_rms_norm,
                            cfg.norm_offset, name="final_norm")(x, delta)
        if self.is_mutable_collection("aux"):  # "entering" the layer after the last: what an MTP
            # module reads (DeepSeek-V3's, spec_decode/mtp.py: the final-normed hidden, as vLLM)
            self.sow("aux", f"layer_{cfg.num_layers}", hidden)
        x = hidden if logits_indices is None else hidden[logits_indices]
        if cfg.tie_word_embeddings:
            logits = _tied_head(x, embed.embedding)
        else:
            logits = _dense_head(cfg, self.dtype, self.kernels, "lm_head")(x).astype(jnp.float32)
        logits = _final_logits(cfg, logits)
        new_kv = None if kv_cache is None else tuple(new_cache)
        if return_hidden:
            return logits, new_kv, hidden
        return logits, new_kv


def _times(x: jax.Array, multiplier: float) -> jax.Array:
    """x times a config multiplier (Granite's muP ones), in x's dtype; x itself at 1."""
    return x if multiplier == 1.0 else x * jnp.asarray(multiplier, x.dtype)


def _final_logits(cfg: ModelConfig, logits: jax.Array) -> jax.Array:
    """The head's float32 logits divided by Granite's logits_scaling, then Gemma 2's soft-cap
    cap * tanh(logits / cap)."""
    if cfg.logits_scaling != 1.0:
        logits = logits / cfg.logits_scaling
    cap = cfg.final_softcap
    return logits if cap is None else cap * jnp.tanh(logits / cap)


def _tied_head(x: jax.Array, embedding: jax.Array) -> jax.Array:
    return jnp.dot(x, embedding.T, preferred_element_type=jnp.float32)


def _dense_head(cfg: ModelConfig, dtype, kernels: KernelTable = REFERENCE_KERNELS,
                name: str | None = None) -> nn.Dense:
    return Dense(cfg.vocab_size, use_bias=False, dtype=dtype, param_dtype=dtype,
                 rows=kernels.gemm_rows, name=name)


def lm_head(params: Params, cfg: ModelConfig, hidden: jax.Array) -> jax.Array:
    """float32 logits of final-normed hidden states [N, H] -> [N, V], the same computation as the
    head inside `forward` (for rows whose logits `forward` did not produce: prompt logprobs)."""
    if cfg.tie_word_embeddings:
        return _final_logits(cfg, _tied_head(hidden, params["embed"]["embedding"]))
    dtype = params["embed"]["embedding"].dtype
    logits = _dense_head(cfg, dtype).apply({"params": params["lm_head"]}, hidden)
    return _final_logits(cfg, logits.astype(jnp.float32))


def forward(params: Params, cfg: ModelConfig, token_ids: jax.Array, positions: jax.Array,
            kv_cache: KVCache, md: AttentionMetadata, kernels: KernelTable = REFERENCE_KERNELS,
            logits_indices: jax.Array | None = None, return_hidden: bool = False,
            lora_slot: jax.Array | None = None):
    """One step over a flat ragged batch. token_ids, positions: int32[T]. Returns float32 logits for
    every token (or only at `logits_indices`) and the updated cache; with `return_hidden` also the
    final-normed hidden states of every token [T, H] (for `lm_head` on other rows). With LoRA
    stacks in `params["lora"]` (lora/stacks.py), `lora_slot` i32[T] gives each token's adapter
    slot (0: none)."""
    dtype = params["embed"]["embedding"].dtype
    model = Transformer(cfg, kernels, dtype)
    variables, lora_slot = _variables(params, kernels, lora_slot)
    return model.apply(variables, token_ids, positions, kv_cache, md, logits_indices,
                       return_hidden, lora_slot)


def _variables(params: Params, kernels: KernelTable, lora_slot: jax.Array | None):
    """The flax variables of `params` (LoRA stacks apart) and the slots as the table's LoRA delta
    takes them."""
    variables = {"params": {k: v for k, v in params.items() if k != LORA}}
    if LORA in params:
        variables["lora"] = params[LORA]
        if lora_slot is not None:
            num_slots = jax.tree.leaves(params[LORA])[0].shape[0]
            lora_slot = kernels.lora_delta.step_slots(lora_slot, num_slots)
    return variables, lora_slot


def forward_aux(params: Params, cfg: ModelConfig, token_ids: jax.Array, positions: jax.Array,
                kv_cache: KVCache | None, md: AttentionMetadata | None,
                kernels: KernelTable = REFERENCE_KERNELS, logits_indices: jax.Array | None = None,
                lora_slot: jax.Array | None = None, *, layers: tuple[int, ...]):
    """`forward` (kv_cache None: the dense causal path, token_ids [B, L]) that also returns the
    residual streams entering `layers`, concatenated: [..., len(layers) * H] (an EAGLE-3 head's
    input; the same pass, no second forward). Layer `cfg.num_layers` is the final-normed hidden
    state (an MTP module's input)."""
    dtype = params["embed"]["embedding"].dtype
    variables, lora_slot = _variables(params, kernels, lora_slot)
    if kv_cache is None:
        positions = jnp.broadcast_to(jnp.arange(token_ids.shape[-1]), token_ids.shape)
    (logits, kv), state = Transformer(cfg, kernels, dtype).apply(
        variables, token_ids, positions, kv_cache, md, logits_indices, False, lora_slot,
        mutable=["aux"])
    aux = jnp.concatenate([state["aux"][f"layer_{i}"][0] for i in layers], axis=-1)
    return logits, kv, aux


def train_forward(params: Params, cfg: ModelConfig, tokens: jax.Array,
                  kernels: KernelTable = REFERENCE_KERNELS) -> jax.Array:
    """Dense causal forward without a cache, for training: tokens int32[B, L] -> logits [B, L, V].
    Attention runs `kernels.dense_attention` (the jnp reference unless
    `dense_fused.with_fused_dense`)."""
    dtype = params["embed"]["embedding"].dtype
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    logits, _ = Transformer(cfg, kernels, dtype).apply({"params": params}, tokens, positions)
    return logits


def param_shapes(cfg: ModelConfig, dtype=jnp.bfloat16) -> Params:
    """The parameter pytree's shapes and dtypes, derived from the modules themselves. Traced once
    per (config, dtype) in a process: a large model's trace takes seconds (Qwen3-Next-80B's
    ~4 s on a CPU), and `jaxinfer memory`, the planners and the weight loaders each ask again.
    Each call gets its own containers (the leaves are immutable)."""
    return jax.tree_util.tree_map(lambda leaf: leaf, _traced_param_shapes(cfg, jnp.dtype(dtype)))


# The reference kernels, the state-space layers' scans as zeros of their shapes (no parameters of
# their own): half of a hybrid's trace was their chunked references.
SHAPE_KERNELS = dataclasses.replace(REFERENCE_KERNELS, mamba2=ShapeOnlyMamba2Kernels(),
                                    gdn=ShapeOnlyGatedDeltaNetKernels())


@functools.lru_cache(maxsize=16)
def _traced_param_shapes(cfg: ModelConfig, dtype: jnp.dtype) -> Params:
    model = Transformer(cfg, SHAPE_KERNELS, dtype)
    tokens = jnp.zeros((1, 1), jnp.int32)
    return jax.eval_shape(lambda: model.init(jax.random.key(0), tokens, tokens))["params"]


def init_params(cfg: ModelConfig, rng: jax.Array, dtype=jnp.bfloat16, std: float = 0.02,
                shardings=None) -> Params:
    """Random weights of the real shapes (normal(std); norms at 1), made on the device leaf by leaf
    so an 8B model never needs host memory (`--load-format dummy`). `shardings` (a pytree of
    Shardings like the params): each leaf is generated directly into its shards."""
    shapes = param_shapes(cfg, dtype)
    makers = _leaf_makers(cfg, shapes, rng, std, shardings)
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(shapes),
                                        [make() for make in makers.values()])


def dummy_leaf_makers(cfg: ModelConfig, rng: jax.Array, dtype=jnp.bfloat16, std: float = 0.02,
                      shardings=None) -> dict[tuple[str, ...], Callable[[], jax.Array]]:
    """init_params' leaves, not yet made: per param path (its keys) the call that makes that leaf
    as init_params does. Quantizing dummy weights on load makes and quantizes them one at a time,
    so the unquantized tree never exists whole (an FP8 model fits a device its bf16 form does
    not: Qwen3-Next-80B on an H200)."""
    return _leaf_makers(cfg, param_shapes(cfg, dtype), rng, std, shardings)


def _leaf_makers(cfg, shapes, rng, std, shardings) -> dict[tuple[str, ...], Callable]:
    leaves, _ = jax.tree_util.tree_flatten_with_path(shapes)
    keys = jax.random.split(rng, len(leaves))
    places = (jax.tree_util.tree_leaves(shardings) if shardings is not None
              else [None] * len(leaves))

    def make(path, leaf, key, place):
        name = jax.tree_util.keystr(path)
        if "norm" in name:  # Gemma's norms scale by (1 + w)
            return jnp.full(leaf.shape, 0.0 if cfg.norm_offset else 1.0, leaf.dtype, device=place)
        if "bias" in name:
            return jnp.zeros(leaf.shape, leaf.dtype, device=place)
        return _normal(key, leaf.shape, leaf.dtype, std, place)

    return {tuple(k.key for k in path): functools.partial(make, path, leaf, key, place)
            for (path, leaf), key, place in zip(leaves, keys, places)}


def _normal(key, shape, dtype, std, sharding=None):
    return _normal_fn(shape, dtype, std, sharding)(key)


@functools.lru_cache(maxsize=None)
def _normal_fn(shape, dtype, std, sharding):
    return jax.jit(lambda key: (jax.random.normal(key, shape, jnp.float32) * std).astype(dtype),
                   out_shardings=sharding)
