"""Copies of whole KV blocks between caches (model/kv_block_rows.py: the host tier's pieces, the
disaggregated hand-over) for every page kind: K and V of one width, and the MLA latent (V empty).
Through the engine: DeepSeek-V2's latent cache offloads to the host tier with the same greedy
tokens as without, and a windowed model under --kv-offload runs on one KV group (hybrid off)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.engine.args import EngineArgs
from jaxinfer.engine.kv_blocks import with_hybrid_kv_decided
from jaxinfer.engine.llm_engine import LLMEngine
from jaxinfer.model.config import load_config
from jaxinfer.model.kv_block_rows import gather_rows, row_bytes, scatter_rows
from jaxinfer.model.weights import load_params
from jaxinfer.sampling_params import SamplingParams
from test_engine_support import assert_all_free, prompt_ids, run_all

FIXTURES = Path(__file__).parent / "fixtures" / "models"
GREEDY = dict(temperature=0.0, ignore_eos=True)


def random_cache(key, layers, heads, blocks, block_size, k_width, v_width):
    keys = jax.random.split(key, 2 * layers)
    return tuple((jax.random.normal(keys[2 * i], (heads, blocks, block_size, k_width)),
                  jax.random.normal(keys[2 * i + 1], (heads, blocks, block_size, v_width)))
                 for i in range(layers))


@pytest.mark.parametrize("widths", [(8, 8), (12, 0)], ids=["k_and_v", "mla_latent"])
def test_rows_carry_blocks_between_caches(widths):
    src = random_cache(jax.random.key(0), 3, 2, 10, 4, *widths)
    dst = jax.tree.map(jnp.zeros_like, src)
    ids = np.array([7, 2, 5, 0], np.int32)
    rows = jax.jit(gather_rows)(src, ids)
    assert rows.shape == (4, 3, 2, 4, sum(widths))
    assert row_bytes(src) == rows.nbytes // 4
    to = np.array([1, -1, 9, 3], np.int32)  # row 1 goes nowhere
    out = jax.jit(scatter_rows, donate_argnums=0)(dst, rows, to)
    for (k_src, v_src), (k, v) in zip(src, out):
        for s, d in ((7, 1), (5, 9), (0, 3)):
            np.testing.assert_array_equal(k[:, d], k_src[:, s])
            np.testing.assert_array_equal(v[:, d], v_src[:, s])
        untouched = [b for b in range(10) if b not in (1, 9, 3)]
        assert not np.asarray(k[:, untouched]).any() and not np.asarray(v[:, untouched]).any()


def engine_for(family: str, **overrides) -> LLMEngine:
    cfg = load_config(FIXTURES / family)
    params = load_params(FIXTURES / family, cfg, jnp.float32, progress=False)
    args = EngineArgs(model=str(FIXTURES / family), max_model_len=64, block_size=4, num_blocks=18,
                      max_num_seqs=2, max_num_batched_tokens=16, compilation_cache_dir=None,
                      warmup=False, dtype="float32", background_compile=False,
                      attention_backend="reference", decode_steps_per_call=1)
    args = with_hybrid_kv_decided(cfg, dataclasses.replace(args, **overrides))
    return LLMEngine(cfg, params, None, args, num_blocks=args.num_blocks)


def turns(engine: LLMEngine) -> list[list[int]]:
    """A prompt, a filler that evicts its blocks from an 18-block pool, the prompt again with a
    new ending (its prefix from the host tier when offloading): each one's greedy tokens."""
    shared = prompt_ids(100, 40)
    out = []
    for rid, prompt in (("a", shared + [5]), ("fill", prompt_ids(7, 60)), ("b", shared + [6])):
        engine.add_request(rid, prompt, SamplingParams(max_tokens=3, **GREEDY))
        out.append(run_all(engine)[rid][0][0])
    return out


@pytest.mark.parametrize("family", ["deepseek_v2", "gemma2"])
def test_offload_gives_the_same_greedy_tokens(family):
    engine = engine_for(family, kv_offload=True, kv_host_gib=1e-3)
    assert engine.scheduler.kv.groups.num_groups == 1  # gemma2's windowed layers: hybrid off
    assert turns(engine) == turns(engine_for(family, hybrid_kv_cache=False))
    assert engine.scheduler.kv.host.stats.loaded_blocks > 0  # b's prefix came from the host
    assert_all_free(engine)


def test_hybrid_kv_stays_on_without_a_feature_that_needs_one_group():
    cfg = load_config(FIXTURES / "gemma2")
    args = EngineArgs(model="gemma2")
    assert with_hybrid_kv_decided(cfg, args).hybrid_kv_cache
    assert not with_hybrid_kv_decided(cfg, args, role="prefill").hybrid_kv_cache
    assert not with_hybrid_kv_decided(cfg, dataclasses.replace(args, kv_offload=True)).hybrid_kv_cache
