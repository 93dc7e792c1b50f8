"""The engine with both Mosaic GPU kernels, run in Mosaic GPU's interpreter on CPU, gives the
reference backend's greedy tokens on a workload shaped like the one that once hung the H200: chunked
and prefix-cached prefills that start at context positions off a 128-key boundary, decodes mixed
into the same steps, and persistent grids of two CTAs so each runs several work items and barrier phases carry
across them (the interpreter rejects any phase a waiting thread does not observe).

Slow by CPU-test standards (the interpreter runs each kernel call in Python, ~1-5 s), so the model
has one layer and the workload ~10 steps."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest

from jaxinfer.model.config import config_from_dict
from jaxinfer.engine.llm_engine import LLMEngine
from jaxinfer.engine.args import EngineArgs
from jaxinfer.model.transformer import init_params
from jaxinfer.sampling_params import SamplingParams
from pallas_kernels.attention import backend as attention_backends
from pallas_kernels.attention.flash_config import KernelConfig
from pallas_kernels.attention.flash_prefill import flash_prefill_mosaic
from pallas_kernels.attention.paged_decode import MosaicDecodeConfig, paged_decode_mosaic
from test_engine_support import prompt_ids, run_all, assert_all_free, tiny_tokenizer

MOSAIC_INTERPRETED = attention_backends.AttentionBackend(
    "mosaic_interpreted",
    decode=functools.partial(paged_decode_mosaic, interpret=True,
                             config=MosaicDecodeConfig(num_ctas=2)),
    prefill=functools.partial(flash_prefill_mosaic, interpret=True,
                              config=KernelConfig(num_ctas=2)),
    split_mixed_steps=True)
attention_backends.register("mosaic_interpreted", f"{__name__}:MOSAIC_INTERPRETED")

# Round 1 prefills a 150-token prompt in 128-token chunks beside a short one. Round 2 then sends a
# prompt sharing its first 40 tokens: the prefix cache serves 32 (two blocks), so its 128-token
# prefill starts at position 32 -- its first tile's warpgroup 0 needs one K/V step fewer than
# warpgroup 1 and drains it, with more items after it on the same CTA -- beside a 70-token chunk and
# a 9-token prompt, and decodes of the others join later steps.
LONG = prompt_ids(300, 150)
ROUNDS = [
    [(LONG, 3), (prompt_ids(301, 37), 4)],
    [(LONG[:40] + prompt_ids(302, 120), 4), (prompt_ids(303, 70), 3), (prompt_ids(304, 9), 4)],
]


@functools.lru_cache(maxsize=None)
def kernel_model():
    """bf16, head_dim 64 (the kernels' sizes), GQA 2; the embedding scaled up so the logits are far
    from ties and bf16 rounding in the kernels cannot flip a greedy token."""
    cfg = config_from_dict({
        "architectures": ["LlamaForCausalLM"], "vocab_size": tiny_tokenizer().vocab_size,
        "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 1,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "torch_dtype": "bfloat16"})
    params = init_params(cfg, jax.random.key(11), jnp.bfloat16, std=0.1)
    return cfg, params


def generate(backend: str) -> list[list[list[int]]]:
    cfg, params = kernel_model()
    args = EngineArgs(model="kernel-tiny", max_model_len=256, block_size=16, num_blocks=64,
                      max_num_seqs=4, max_num_batched_tokens=256, long_prefill_chunk=128,
                      compilation_cache_dir=None, warmup=False, dtype="bfloat16",
                      attention_backend=backend)
    engine = LLMEngine(cfg, params, tiny_tokenizer(), args, num_blocks=64)
    tokens = []
    for r, workload in enumerate(ROUNDS):
        for i, (prompt, n) in enumerate(workload):
            engine.add_request(f"r{r}.{i}", prompt,
                               SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
        results = run_all(engine)
        tokens.append([results[f"r{r}.{i}"][0][0] for i in range(len(workload))])
    assert_all_free(engine)
    return tokens


@pytest.mark.timeout(900)
def test_engine_with_interpreted_mosaic_kernels_matches_reference():
    assert generate("mosaic_interpreted") == generate("reference")
