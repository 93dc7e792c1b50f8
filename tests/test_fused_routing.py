"""The fused MoE router (pallas_kernels/moe/routing_kernel.py, interpreted) against the unfused
reference (`route`, then `sorted_dispatch`'s stable sort by expert) for every routing kind in the
tree, on random logits and on constructed ties: the same experts in the same order (equal scores:
the lower expert index first, as `jax.lax.top_k`), the same weights, the same rows per expert and
the same place of every row in the sorted order (the dispatch is identical, not just equivalent),
so the same grouped-matmul tile table."""

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.model.config import load_config
from jaxinfer.model.experts import routed_experts, sorted_dispatch
from jaxinfer.model.routing import Router, route, routing_spec, with_shared
from pallas_kernels.moe.grouped_matmul_mosaic import padded_rows, tile_table
from pallas_kernels.moe.routing_kernel import (MAX_TOKENS, SHARED_MEMORY_BUDGET, TOKEN_LIMIT, fits,
                                              fused_route, shared_memory_bytes)

FIXTURES = Path(__file__).parent / "fixtures" / "models"
QWEN3_MOE = load_config(FIXTURES / "qwen3_moe")
V2 = load_config(FIXTURES / "deepseek_v2")
V3 = load_config(FIXTURES / "deepseek_v3")


def _moe(base, **changes):
    return dataclasses.replace(base, **changes)


KINDS = {
    # Qwen3-MoE / Mixtral: top-k of the softmax, renormalised.
    "softmax_topk_norm": _moe(QWEN3_MOE, num_experts=16, num_experts_per_tok=4),
    # Qwen2-MoE style: top-k of the softmax as is.
    "softmax_topk": _moe(QWEN3_MOE, num_experts=12, num_experts_per_tok=3, norm_topk_prob=False),
    # gpt-oss: softmax over the top-k logits.
    "topk_then_softmax": _moe(QWEN3_MOE, num_experts=32, num_experts_per_tok=4,
                              topk_then_softmax=True),
    # DeepSeek-V2: group-limited greedy softmax, scaled.
    "v2_group_limited": _moe(V2, num_experts=20, num_experts_per_tok=6, n_group=4, topk_group=2,
                             norm_topk_prob=False, routed_scaling_factor=16.0),
    # DeepSeek-V3 / GLM-4.5 noaux_tc: sigmoid, correction bias for the choice, groups by top-2 sum.
    "v3_sigmoid_groups_bias": _moe(V3, num_experts=32, num_experts_per_tok=8, n_group=8,
                                   topk_group=4, routed_scaling_factor=2.5),
    # Top-1 sigmoid (Llama 4's routed expert beside its shared one).
    "sigmoid_top1": _moe(QWEN3_MOE, num_experts=16, num_experts_per_tok=1,
                         router_scoring="sigmoid", norm_topk_prob=False),
}


def _bias(cfg, key):
    if not cfg.score_correction_bias:
        return None
    return jax.random.normal(key, (cfg.num_experts,), jnp.float32) * 0.1


def _assert_same(cfg, logits, bias=None, shared=0):
    spec = routing_spec(cfg, shared)
    # The grouped matmul's tile table is a function of the rows per expert: identical too.
    rows = padded_rows(logits.shape[0] * (spec.k + shared), 64)

    @jax.jit  # each side one compile: most of an interpreted test's time
    def fused(logits, bias):
        weights, experts, sizes, rank = fused_route(logits, spec, bias, interpret=True)
        return weights, experts, sizes, rank, tile_table(sizes, rows, 64)

    @jax.jit
    def reference(logits, bias):
        weights, experts = with_shared(*route(cfg, logits, bias), cfg.num_experts, shared)
        sizes, _, rank = sorted_dispatch(experts, cfg.num_experts + shared)
        return weights, experts, sizes, rank, tile_table(sizes, rows, 64)

    weights, experts, sizes, rank, tiles = fused(logits, bias)
    ref_weights, ref_experts, ref_sizes, ref_rank, ref_tiles = reference(logits, bias)
    np.testing.assert_array_equal(np.asarray(experts), np.asarray(ref_experts))
    np.testing.assert_allclose(np.asarray(weights), np.asarray(ref_weights), rtol=2e-6, atol=1e-7)
    np.testing.assert_array_equal(np.asarray(sizes), np.asarray(ref_sizes))
    np.testing.assert_array_equal(np.asarray(rank), np.asarray(ref_rank))
    np.testing.assert_array_equal(np.asarray(tiles), np.asarray(ref_tiles))


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("tokens", [1, 7, 64])
def test_random_logits_route_and_dispatch_as_the_reference(kind, tokens):
    cfg = KINDS[kind]
    k1, k2 = jax.random.split(jax.random.key(tokens))
    logits = jax.random.normal(k1, (tokens, cfg.num_experts), jnp.float32) * 3.0
    _assert_same(cfg, logits, _bias(cfg, k2))


@pytest.mark.parametrize("kind", ["v2_group_limited", "v3_sigmoid_groups_bias", "sigmoid_top1"])
@pytest.mark.parametrize("shared", [1, 2])
def test_shared_experts_join_every_token_after_its_routed_ones(kind, shared):
    """Shared experts stored as experts E .. E + S - 1: every token's k routed rows, then its S
    shared rows of weight 1, in the same dispatch as the reference's sort."""
    cfg = KINDS[kind]
    k1, k2 = jax.random.split(jax.random.key(shared))
    logits = jax.random.normal(k1, (9, cfg.num_experts), jnp.float32)
    _assert_same(cfg, logits, _bias(cfg, k2), shared)
    _, experts, sizes, _ = fused_route(logits, routing_spec(cfg, shared), _bias(cfg, k2),
                                       interpret=True)
    assert np.asarray(sizes)[cfg.num_experts:].tolist() == [9] * shared


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_ties_go_to_the_lower_expert_index(kind):
    cfg = KINDS[kind]
    e = cfg.num_experts
    rows = [np.zeros(e),                                   # every expert tied
            np.full(e, 5.0),
            np.tile([1.0, 1.0, 0.0, 2.0], e // 4 + 1)[:e],  # repeated values inside and across groups
            np.arange(e)[::-1] % 3,                         # ties favouring high indices by value
            np.where(np.arange(e) % 2, 40.0, -40.0)]        # saturated sigmoid / softmax underflow
    logits = jnp.asarray(np.stack(rows), jnp.float32)
    bias = None if not cfg.score_correction_bias else jnp.zeros((e,), jnp.float32)
    _assert_same(cfg, logits, bias)


def test_equal_group_scores_keep_the_lower_groups():
    """Every group scores the same (a repeated block of values): both keep groups 0 .. topk_group-1."""
    cfg = KINDS["v3_sigmoid_groups_bias"]
    size = cfg.num_experts // cfg.n_group
    block = np.linspace(-1.0, 1.0, size)
    logits = jnp.asarray(np.tile(block, (3, cfg.n_group)), jnp.float32)
    weights, experts, _, _ = fused_route(logits, routing_spec(cfg),
                                         jnp.zeros((cfg.num_experts,)), interpret=True)
    assert int(np.max(np.asarray(experts))) < cfg.topk_group * size
    _assert_same(cfg, logits, jnp.zeros((cfg.num_experts,)))


def test_most_tokens_one_expert_and_the_largest_step():
    """Adversarial load: every token's logits favour the same experts (one group holds all rows),
    at the kernel's token limit."""
    with pytest.raises(ValueError, match="at most"):
        fused_route(jnp.zeros((TOKEN_LIMIT + 1, 8)), routing_spec(KINDS["softmax_topk_norm"]))
    cfg = KINDS["softmax_topk_norm"]
    noise = jax.random.normal(jax.random.key(3), (TOKEN_LIMIT, cfg.num_experts)) * 1e-3
    logits = noise + jnp.arange(cfg.num_experts, dtype=jnp.float32) * 0.5
    _assert_same(cfg, logits)


def test_router_slot_hands_the_experts_an_identical_dispatch():
    """Through the kernel table's slot: the fused router's dispatch gives `routed_experts` the
    reference's output; past its token limit the slot routes by `route` and the sort."""
    cfg = KINDS["softmax_topk_norm"]
    e, h, f, t = cfg.num_experts, 16, 32, 24
    keys = jax.random.split(jax.random.key(5), 5)
    x = jax.random.normal(keys[0], (t, h), jnp.float32)
    logits = jax.random.normal(keys[1], (t, e), jnp.float32)
    w = tuple(jax.random.normal(k, s, jnp.float32) * 0.2
              for k, s in zip(keys[2:], [(e, h, f), (e, h, f), (e, f, h)]))
    fused = Router(fused=True, interpret=True)(cfg, logits)
    assert fused.dispatch is not None
    ref_weights, ref_experts = route(cfg, logits)
    got = routed_experts(x, fused.experts, fused.weights, w, dispatch=fused.dispatch)
    want = routed_experts(x, ref_experts, ref_weights, w)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    assert Router(fused=True, interpret=True, max_tokens=8)(cfg, logits).dispatch is None
    assert Router()(cfg, logits).dispatch is None


# DeepSeek families at their real expert counts (the kernel's tiles: 64 experts a tile).
SHAPED = {
    # DeepSeek-V2-Lite: greedy softmax top-6, unscaled.
    "softmax_greedy": lambda e: _moe(V2, num_experts=e, num_experts_per_tok=6, n_group=1,
                                     topk_group=1, norm_topk_prob=False,
                                     routed_scaling_factor=1.0),
    # DeepSeek-V2: group-limited greedy softmax (8 groups, the best 3), scaled.
    "softmax_groups": lambda e: _moe(V2, num_experts=e, num_experts_per_tok=6, n_group=8,
                                     topk_group=3, norm_topk_prob=False,
                                     routed_scaling_factor=16.0),
    # DeepSeek-V3: sigmoid + correction bias, the best 4 of 8 groups by top-2 sums, top-8.
    "sigmoid_groups_bias": lambda e: _moe(V3, num_experts=e, num_experts_per_tok=8, n_group=8,
                                          topk_group=4, routed_scaling_factor=2.5),
}


def _tied_logits(key, tokens, experts):
    """Random logits whose even rows are rounded to halves: ties inside and across groups and
    tiles, among the best too; odd rows continuous."""
    x = jax.random.normal(key, (tokens, experts), jnp.float32) * 3.0
    return jnp.where((jnp.arange(tokens) % 2 == 0)[:, None], jnp.round(x * 2.0) / 2.0, x)


@pytest.mark.parametrize("tokens, experts, kind, shared", [
    # Each routing function at each token count and expert count once (a Latin square).
    (1, 64, "sigmoid_groups_bias", 0), (1, 128, "softmax_groups", 0),
    (1, 256, "softmax_greedy", 0), (7, 64, "softmax_greedy", 2),
    (7, 128, "sigmoid_groups_bias", 0), (7, 256, "softmax_groups", 0),
    (64, 64, "softmax_groups", 0), (64, 128, "softmax_greedy", 0),
    (64, 256, "sigmoid_groups_bias", 1),  # DeepSeek-V3 as served on one GPU
    (37, 160, "softmax_groups", 2),  # DeepSeek-V2: a part tile, groups of 20 across tiles
])
def test_tiled_shapes_route_and_dispatch_as_the_reference(tokens, experts, kind, shared):
    """Expert tiles (and at 64 tokens, the most the model sends) keep the reference's choice,
    weights and dispatch, on ties too; the bias takes two values, so biased choices tie as well."""
    cfg = SHAPED[kind](experts)
    k1, k2 = jax.random.split(jax.random.key(tokens * 1000 + experts))
    bias = None
    if cfg.score_correction_bias:
        bias = jnp.where(jax.random.bernoulli(k2, 0.5, (experts,)), 0.25, 0.0)
    _assert_same(cfg, _tied_logits(k1, tokens, experts), bias, shared)


def test_shared_memory_bound_holds_for_every_step_the_model_routes_fused():
    """Every step the model sends to the kernel (up to MAX_TOKENS tokens, up to 256 experts:
    DeepSeek-V3) fits the budget; past it the kernel refuses and the router sorts."""
    assert shared_memory_bytes(64, 256) == 144 * 1024
    for tokens in (1, 7, 16, 33, MAX_TOKENS):
        for experts in (8, 60, 64, 128, 160, 256):
            assert fits(tokens, experts)
            assert shared_memory_bytes(tokens, experts) <= SHARED_MEMORY_BUDGET
    assert not fits(2 * MAX_TOKENS, 256)
    with pytest.raises(ValueError, match="SHARED_MEMORY_BUDGET"):
        fused_route(jnp.zeros((2 * MAX_TOKENS, 256)), routing_spec(SHAPED["softmax_greedy"](256)),
                    interpret=True)
    cfg = SHAPED["softmax_greedy"](256)
    logits = jnp.zeros((2 * MAX_TOKENS, 256))
    assert Router(fused=True, interpret=True, max_tokens=TOKEN_LIMIT)(cfg, logits).dispatch is None
