"""The engine with the kernels' backend against the reference backend on the GPU: the bundled demo
model (bf16) greedily continues 16 held-out code prompts by 48 tokens, with a bf16 and with an fp8
KV cache. Continuations that differ must first differ where the reference engine's own top-1/top-2
logprob gap (same cache dtype, so fp8's rounding is in it) is a near-tie (the kernels round q and
P to bf16, which can flip such a token), and most must be token-identical. Skipped without a CUDA
GPU."""

from __future__ import annotations

from pathlib import Path

import pytest

from jaxinfer.frontends.llm import LLM
from jaxinfer.sampling_params import SamplingParams

pytestmark = pytest.mark.gpu

HELDOUT = Path(__file__).resolve().parents[2] / "checkpoints" / "heldout_sample.txt"
NEAR_TIE = 0.1  # logits; the differences seen on the H200 sat at gaps of 0.005-0.046


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_mosaic_backend_matches_the_reference_up_to_near_ties(tmp_path, kv_cache_dtype):
    lines = [line for line in HELDOUT.read_text().splitlines() if line.strip()]
    prompts = ["\n".join(lines[i:i + 3]) for i in range(0, 48, 3)]
    # The reference reports its top-2 logprobs at every token: their gap is the logit gap.
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, logprobs=2)
    outs = {}
    for backend in ("reference", "mosaic"):
        llm = LLM(attention_backend=backend, dtype="bfloat16", max_num_seqs=16,
                  max_num_batched_tokens=512, warmup=False, num_blocks=4096,
                  compilation_cache_dir=str(tmp_path), kv_cache_dtype=kv_cache_dtype)
        outs[backend] = [(o.prompt_token_ids, o.outputs[0].token_ids, o.outputs[0].logprobs)
                         for o in llm.generate(prompts, params, use_tqdm=False)]
        del llm
    identical = 0
    for (prompt, ref, ref_lp), (_, got, _) in zip(outs["reference"], outs["mosaic"]):
        first = next((i for i, (x, y) in enumerate(zip(ref, got)) if x != y), None)
        if first is None:
            identical += 1
            continue
        (_, best), (_, second) = ref_lp[first].top[:2]
        assert best - second < NEAR_TIE, f"prompt {prompt[:8]}… differs at token {first}"
    # 11 and 12 of 16 measured on the H200 (2026-11-30, 2026-12-01, bf16 cache), every other one
    # first differing at a near-tie (asserted above per continuation).
    assert identical >= 10
