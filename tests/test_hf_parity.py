"""jaxinfer's logits and greedy tokens match HF transformers' on tiny random checkpoints of every
supported family (fixtures made by tests/fixtures/make_golden.py with torch + transformers). The
windowed families' (Gemma 2, Gemma 3, gpt-oss: 8-token windows) 29-token prompt and greedy runs
go past the window."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.model.config import load_config
from jaxinfer.core.kv_cache.device_cache import allocate_kv_cache
from jaxinfer.model.transformer import forward
from jaxinfer.model.weights import load_params
from pallas_kernels.attention.backend import REFERENCE
from pallas_kernels.attention.metadata import AttentionMetadata

FIXTURES = Path(__file__).parent / "fixtures" / "models"
FAMILIES = sorted(p.name for p in FIXTURES.iterdir() if (p / "golden.npz").is_file())
BLOCK = 4


def _prefill_metadata(n: int, num_blocks: int) -> tuple[AttentionMetadata, np.ndarray]:
    # A shuffled block table, so the test exercises real paging rather than contiguous slots.
    table = np.random.default_rng(n).permutation(num_blocks)[: -(-n // BLOCK)]
    slots = np.array([table[i // BLOCK] * BLOCK + i % BLOCK for i in range(n)], np.int32)
    md = AttentionMetadata(jnp.asarray(slots), jnp.array([0, n], jnp.int32), jnp.array([n], jnp.int32),
                           jnp.asarray(table[None], jnp.int32))
    return md, table


def test_all_nine_families_have_fixtures():
    archs = {load_config(FIXTURES / f).architecture for f in FAMILIES}
    assert archs == {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                     "MixtralForCausalLM", "Qwen3MoeForCausalLM", "Gemma2ForCausalLM",
                     "Gemma3ForCausalLM", "GptOssForCausalLM"}


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_and_greedy_match_transformers(family):
    cfg = load_config(FIXTURES / family)
    params = load_params(FIXTURES / family, cfg, jnp.float32, progress=False)
    golden = np.load(FIXTURES / family / "golden.npz")
    step = jax.jit(forward, static_argnames=("cfg", "backend"))
    for i in range(3):
        prompt = golden[f"prompt_{i}"]
        md, _ = _prefill_metadata(len(prompt), 16)
        cache = allocate_kv_cache(cfg, 16, BLOCK, jnp.float32)
        logits, _ = step(params, cfg, jnp.asarray(prompt), jnp.arange(len(prompt)), cache, md)
        np.testing.assert_allclose(np.asarray(logits), golden[f"logits_{i}"], atol=1e-4, rtol=0)

    # Greedy: prefill the prompt, then decode one token at a time through the paged cache.
    prompt, expected = golden["greedy_prompt"], golden["greedy_tokens"]
    total = len(prompt) + len(expected)
    md, table = _prefill_metadata(total, 16)
    cache = allocate_kv_cache(cfg, 16, BLOCK, jnp.float32)
    n = len(prompt)
    pre = AttentionMetadata(md.slot_mapping[:n], jnp.array([0, n], jnp.int32), jnp.array([n], jnp.int32),
                            md.block_tables)
    logits, cache = step(params, cfg, jnp.asarray(prompt), jnp.arange(n), cache, pre, REFERENCE,
                         jnp.array([n - 1]))
    tokens = [int(jnp.argmax(logits[-1]))]
    for pos in range(n, total - 1):
        dec = AttentionMetadata(md.slot_mapping[pos:pos + 1], jnp.array([0, 1], jnp.int32),
                                jnp.array([pos + 1], jnp.int32), md.block_tables, num_decodes=1)
        logits, cache = step(params, cfg, jnp.array([tokens[-1]]), jnp.array([pos]), cache, dec)
        tokens.append(int(jnp.argmax(logits[0])))
    assert tokens == expected.tolist()
