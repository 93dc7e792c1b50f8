"""jaxinfer's logits and greedy tokens match HF transformers' on tiny random checkpoints of every
supported family (fixtures made by tests/fixtures/make_golden.py and make_golden_deepseek.py with
torch + transformers). The windowed families' (Gemma 2, Gemma 3, gpt-oss: 8-token windows)
29-token prompt and greedy runs go past the window."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.model.config import load_config
from jaxinfer.worker.kv.device_cache import allocate_kv_cache
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


def test_all_eleven_families_have_fixtures():
    archs = {load_config(FIXTURES / f).architecture for f in FAMILIES}
    assert archs == {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                     "MixtralForCausalLM", "Qwen3MoeForCausalLM", "Gemma2ForCausalLM",
                     "Gemma3ForCausalLM", "GptOssForCausalLM", "DeepseekV2ForCausalLM",
                     "DeepseekV3ForCausalLM"}


def _batch_metadata(lengths: list[int], num_blocks: int) -> AttentionMetadata:
    """The prompts as one ragged prefill step, each sequence on its own shuffled blocks."""
    perm = np.random.default_rng(len(lengths)).permutation(num_blocks)
    tables, slots, used = [], [], 0
    width = max(-(-n // BLOCK) for n in lengths)
    for n in lengths:
        table = perm[used:used + -(-n // BLOCK)]
        used += len(table)
        slots += [table[i // BLOCK] * BLOCK + i % BLOCK for i in range(n)]
        tables.append(np.pad(table, (0, width - len(table))))
    starts = np.concatenate([[0], np.cumsum(lengths)])
    return AttentionMetadata(jnp.asarray(slots, jnp.int32), jnp.asarray(starts, jnp.int32),
                             jnp.asarray(lengths, jnp.int32), jnp.asarray(np.stack(tables), jnp.int32))


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_and_greedy_match_transformers(family):
    cfg = load_config(FIXTURES / family)
    params = load_params(FIXTURES / family, cfg, jnp.float32, progress=False)
    golden = np.load(FIXTURES / family / "golden.npz")
    step = jax.jit(forward, static_argnames=("cfg", "backend"))
    # The three prompts in one step (one compile): each sequence attends only to its own blocks.
    prompts = [golden[f"prompt_{i}"] for i in range(3)]
    md = _batch_metadata([len(p) for p in prompts], 32)
    positions = np.concatenate([np.arange(len(p)) for p in prompts])
    logits, _ = step(params, cfg, jnp.asarray(np.concatenate(prompts)), jnp.asarray(positions),
                     allocate_kv_cache(cfg, 32, BLOCK, jnp.float32), md)
    for i, (start, p) in enumerate(zip(np.asarray(md.query_start_loc), prompts)):
        np.testing.assert_allclose(np.asarray(logits[start:start + len(p)]),
                                   golden[f"logits_{i}"], atol=1e-4, rtol=0)

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
