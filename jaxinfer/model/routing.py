"""The MoE router's choice: from router logits [T, E] to each token's k experts and their weights.

- Mixtral / Qwen3-MoE: top-k of the softmax, renormalized when `norm_topk_prob`;
- gpt-oss (`topk_then_softmax`): softmax over the top-k logits;
- DeepSeek (deepseek.py): softmax (V2) or sigmoid (V3) scores; V3 chooses by scores plus a
  learned correction bias but weighs by the scores alone; group-limited top-k keeps only the
  `topk_group` best of `n_group` expert groups (a group's score: its best expert's for softmax
  scoring, as V2's group_limited_greedy; the sum of its two best biased scores for sigmoid, as
  V3); weights times `routed_scaling_factor`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxinfer.model.config import ModelConfig


def route(cfg: ModelConfig, logits: jax.Array,
          score_bias: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """logits f32[T, E] -> (weights f32[T, k], experts i32[T, k])."""
    k = cfg.num_experts_per_tok
    if cfg.topk_then_softmax:
        top, experts = jax.lax.top_k(logits, k)
        return jax.nn.softmax(top, axis=-1), experts
    if cfg.router_scoring == "sigmoid":
        scores = jax.nn.sigmoid(logits)
    else:
        scores = jax.nn.softmax(logits, axis=-1)
    choice = scores if score_bias is None else scores + score_bias.astype(jnp.float32)
    if cfg.n_group > 1:
        choice = _keep_best_groups(cfg, choice)
    _, experts = jax.lax.top_k(choice, k)
    weights = jnp.take_along_axis(scores, experts, axis=-1)
    if cfg.norm_topk_prob:
        denominator = weights.sum(-1, keepdims=True)
        weights = weights / (denominator + 1e-20 if cfg.mla else denominator)
    return weights * cfg.routed_scaling_factor, experts


def _keep_best_groups(cfg: ModelConfig, choice: jax.Array) -> jax.Array:
    """`choice` with the experts outside each token's topk_group best groups masked out: to 0
    for softmax scores (HF's V2: top-k then never picks them while others are positive), to -inf
    for sigmoid (V3)."""
    t, e = choice.shape
    grouped = choice.reshape(t, cfg.n_group, e // cfg.n_group)
    if cfg.router_scoring == "sigmoid":
        group_scores = jax.lax.top_k(grouped, 2)[0].sum(-1)
        masked = -jnp.inf
    else:
        group_scores = grouped.max(-1)
        masked = 0.0
    _, best = jax.lax.top_k(group_scores, cfg.topk_group)  # [T, topk_group]
    keep = jnp.zeros((t, cfg.n_group), bool).at[jnp.arange(t)[:, None], best].set(True)
    return jnp.where(keep[:, :, None], grouped, masked).reshape(t, e)
