"""jaxinfer's logits and greedy tokens match HF transformers' on tiny random checkpoints of every
supported family (fixtures made by tests/fixtures/make_golden.py, make_golden_deepseek.py and
make_golden_families.py with torch + transformers). The windowed families' (Gemma 2, Gemma 3,
gpt-oss: 8-token windows) 29-token prompt and greedy runs go past the window, Llama 4's past its
8-token attention chunks. The rope of config.json spellings whose fields
fall back or default (rope_golden.json, made by make_golden_rope.py) matches HF's per case."""

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.model.config import (SUPPORTED_ARCHITECTURES, config_from_dict, load_config,
                                   rope_inv_freq)
from jaxinfer.worker.kv.device_cache import allocate_kv_cache
from jaxinfer.model.kernel_table import REFERENCE_KERNELS
from jaxinfer.model.kv_specs import FixedStateSpec
from jaxinfer.model.routing import Router
from jaxinfer.model.shared_experts import fuse_shared_experts, stackable
from jaxinfer.model.transformer import forward
from jaxinfer.model.weights import load_params
from pallas_kernels.moe.routing_kernel import TOKEN_LIMIT
from pallas_kernels.attention.metadata import AttentionMetadata

FIXTURES = Path(__file__).parent / "fixtures" / "models"
FAMILIES = sorted(p.name for p in FIXTURES.iterdir() if (p / "golden.npz").is_file())
MOE_FAMILIES = [f for f in FAMILIES if load_config(FIXTURES / f).num_experts]
SHARED_FAMILIES = [f for f in MOE_FAMILIES if load_config(FIXTURES / f).n_shared_experts
                   and stackable(load_config(FIXTURES / f))]
# The fused MoE router (its Pallas kernel interpreted) in place of `route` and the sort, at
# every step these tests run (prefill included).
FUSED_ROUTING = dataclasses.replace(REFERENCE_KERNELS, routing=Router(fused=True, interpret=True,
                                                                      max_tokens=TOKEN_LIMIT))
ROPE_CASES = json.loads((FIXTURES.parent / "rope_golden.json").read_text())["cases"]
BLOCK = 4


def test_every_supported_architecture_has_a_fixture():
    archs = {load_config(FIXTURES / f).architecture for f in FAMILIES}
    assert archs == set(SUPPORTED_ARCHITECTURES)


def _block_size(cfg) -> int:
    """BLOCK, or the smallest block whose page holds a state-space layer's state (the tables
    here give a sequence only the blocks of its tokens, which a state's pages must not pass)."""
    block = BLOCK
    while any(s.state_pages(block, jnp.float32) > 1 for s in cfg.layer_kv_specs()
              if isinstance(s, FixedStateSpec)):
        block *= 2
    return block


def _batch_metadata(lengths: list[int], num_blocks: int, capacity: list[int] | None = None,
                    block: int = BLOCK) -> AttentionMetadata:
    """The prompts as one ragged prefill step, each sequence on its own shuffled blocks (a real
    paging, not contiguous slots), enough of them for `capacity` tokens (default: its length)."""
    perm = np.random.default_rng(len(lengths)).permutation(num_blocks)
    tables, slots, used = [], [], 0
    capacity = capacity or lengths
    width = max(-(-c // block) for c in capacity)
    for n, c in zip(lengths, capacity):
        table = perm[used:used + -(-c // block)]
        used += len(table)
        slots += [table[i // block] * block + i % block for i in range(n)]
        tables.append(np.pad(table, (0, width - len(table))))
    starts = np.concatenate([[0], np.cumsum(lengths)])
    return AttentionMetadata(jnp.asarray(slots, jnp.int32), jnp.asarray(starts, jnp.int32),
                             jnp.asarray(lengths, jnp.int32), jnp.asarray(np.stack(tables), jnp.int32))


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_and_greedy_match_transformers(family):
    _check_parity(family, REFERENCE_KERNELS)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_moe_families_match_transformers_through_the_fused_router(family):
    _check_parity(family, FUSED_ROUTING)


@pytest.mark.parametrize("family", SHARED_FAMILIES)
@pytest.mark.parametrize("kernels", [REFERENCE_KERNELS, FUSED_ROUTING], ids=["route", "fused"])
def test_shared_experts_in_the_expert_stacks_match_transformers(family, kernels):
    """The serving layout on a GPU: the shared MLP as always-on experts of the grouped call."""
    _check_parity(family, kernels, fuse_shared_experts)


def _check_parity(family, kernels, rewrite=None):
    cfg = load_config(FIXTURES / family)
    params = load_params(FIXTURES / family, cfg, jnp.float32, progress=False)
    if rewrite is not None:
        params = rewrite(params)
        layer = next(v for k, v in params.items() if k.startswith("layers_") and "moe" in v)
        assert "shared_experts" not in layer["moe"]
        assert layer["moe"]["w_gate"].shape[0] == cfg.num_experts + cfg.n_shared_experts
    golden = np.load(FIXTURES / family / "golden.npz")
    step = jax.jit(forward, static_argnames=("cfg", "kernels"))
    # The three prompts and the greedy prompt in one prefill step (one compile): each sequence
    # attends only to its own blocks; the greedy one's leave room for its continuation.
    prompts = [golden[f"prompt_{i}"] for i in range(3)] + [golden["greedy_prompt"]]
    expected = golden["greedy_tokens"]
    lengths = [len(p) for p in prompts]
    block = _block_size(cfg)
    md = _batch_metadata(lengths, 32, capacity=lengths[:3] + [lengths[3] + len(expected)],
                         block=block)
    positions = np.concatenate([np.arange(len(p)) for p in prompts])
    logits, cache = step(params, cfg, jnp.asarray(np.concatenate(prompts)), jnp.asarray(positions),
                         allocate_kv_cache(cfg, 32, block, jnp.float32), md, kernels=kernels)
    starts = np.asarray(md.query_start_loc)
    for i in range(3):
        np.testing.assert_allclose(np.asarray(logits[starts[i]:starts[i + 1]]),
                                   golden[f"logits_{i}"], atol=1e-4, rtol=0)

    # Greedy: from the prefilled prompt, decode one token at a time through the paged cache.
    n, table = lengths[3], md.block_tables[3:]
    tokens = [int(jnp.argmax(logits[starts[4] - 1]))]
    for pos in range(n, n + len(expected) - 1):
        slot = int(table[0, pos // block]) * block + pos % block
        dec = AttentionMetadata(jnp.array([slot], jnp.int32), jnp.array([0, 1], jnp.int32),
                                jnp.array([pos + 1], jnp.int32), table, num_decodes=1)
        logits, cache = step(params, cfg, jnp.array([tokens[-1]]), jnp.array([pos]), cache, dec,
                             kernels=kernels)
        tokens.append(int(jnp.argmax(logits[0])))
    assert tokens == expected.tolist()


@pytest.mark.parametrize("case", sorted(ROPE_CASES))
def test_rope_matches_transformers(case):
    """Each config.json spelling's inverse frequencies and cos/sin factor, per layer type, are
    those of HF's rotary embedding (fixture made by tests/fixtures/make_golden_rope.py)."""
    cfg = config_from_dict(ROPE_CASES[case]["config"])
    ropes = {"all": cfg.rope, "full_attention": cfg.rope, "sliding_attention": cfg.local_rope}
    for layer_type, golden in ROPE_CASES[case]["rope"].items():
        rope = ropes[layer_type]
        np.testing.assert_allclose(np.float32(rope_inv_freq(cfg, rope)), golden["inv_freq"],
                                   rtol=1e-5, atol=0, err_msg=layer_type)
        assert rope.attention_factor == pytest.approx(golden["attention_factor"], rel=1e-6)
