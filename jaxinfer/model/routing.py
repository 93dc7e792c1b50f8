"""The MoE router's choice: from router logits [T, E] to each token's k experts and their weights.

- Mixtral / Qwen3-MoE: top-k of the softmax, renormalized when `norm_topk_prob`;
- gpt-oss (`topk_then_softmax`): softmax over the top-k logits;
- DeepSeek (deepseek.py): softmax (V2) or sigmoid (V3) scores; V3 chooses by scores plus a
  learned correction bias but weighs by the scores alone; group-limited top-k keeps only the
  `topk_group` best of `n_group` expert groups (a group's score: its best expert's for softmax
  scoring, as V2's group_limited_greedy; the sum of its two best biased scores for sigmoid, as
  V3); weights times `routed_scaling_factor`.

`Router` is the kernel table's routing slot: `route` (and the sort in `routed_experts`), or at few
tokens the fused kernel (pallas_kernels/moe/routing_kernel.py), which also hands the experts their
dispatch (rows per expert, each row's place in the expert-sorted order) so no sort runs.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxinfer.model.config import ModelConfig
from pallas_kernels.moe.routing_kernel import MAX_TOKENS, RoutingSpec, fits, fused_route


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


def with_shared(weights: jax.Array, experts: jax.Array, num_experts: int,
                shared: int) -> tuple[jax.Array, jax.Array]:
    """`route`'s choice with `shared` always-on experts (ids num_experts ..) after each token's k,
    weight 1: the shared experts stored as extra experts of the stacks (model/shared_experts.py)."""
    if not shared:
        return weights, experts
    t = experts.shape[0]
    ids = jnp.broadcast_to(num_experts + jnp.arange(shared, dtype=experts.dtype), (t, shared))
    return (jnp.concatenate([weights, jnp.ones((t, shared), weights.dtype)], axis=1),
            jnp.concatenate([experts, ids], axis=1))


def routing_spec(cfg: ModelConfig, shared: int = 0) -> RoutingSpec:
    """The fused kernel's statement of `route`'s rule for this config (with `with_shared`'s
    `shared` always-on experts)."""
    return RoutingSpec(k=cfg.num_experts_per_tok, scoring=cfg.router_scoring,
                       topk_then_softmax=cfg.topk_then_softmax,
                       bias=cfg.score_correction_bias, n_group=cfg.n_group,
                       topk_group=cfg.topk_group, norm_topk_prob=cfg.norm_topk_prob,
                       norm_eps=1e-20 if cfg.mla else 0.0,
                       scaling=cfg.routed_scaling_factor, shared=shared)


class Dispatch(NamedTuple):
    """The rows' expert-sorted layout: group_sizes int32[E], rank int32[T * k] (row t * k + j's
    place in the rows sorted stably by expert)."""
    group_sizes: jax.Array
    rank: jax.Array


class Routed(NamedTuple):
    weights: jax.Array  # f32[T, k]
    experts: jax.Array  # int32[T, k]
    dispatch: Dispatch | None  # None: `routed_experts` sorts


@dataclasses.dataclass(frozen=True)
class Router:
    """The kernel table's routing slot: with `fused`, the Pallas kernel for steps of at most
    `max_tokens` tokens whose tokens x routed experts fit one program's shared memory (`fits`:
    its tiles' bound, which the interpreter, `interpret`, CPU tests, keeps too); else `route`.
    `shared`: always-on experts stored after the routed ones (`with_shared`)."""
    fused: bool = False
    interpret: bool = False
    max_tokens: int = MAX_TOKENS

    def __call__(self, cfg: ModelConfig, logits: jax.Array,
                 score_bias: jax.Array | None = None, shared: int = 0) -> Routed:
        t, e = logits.shape
        if not self.fused or t > self.max_tokens or not fits(t, e):
            weights, experts = route(cfg, logits, score_bias)
            return Routed(*with_shared(weights, experts, cfg.num_experts, shared), None)
        weights, experts, sizes, rank = fused_route(logits, routing_spec(cfg, shared), score_bias,
                                                    interpret=self.interpret)
        return Routed(weights, experts, Dispatch(sizes, rank))
