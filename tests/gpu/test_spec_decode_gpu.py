"""Speculative decoding on the GPU with the kernels' backend: the bundled demo model (bf16)
greedily continues 8 held-out code prompts by 48 tokens without speculation, with the demo draft
and with n-gram lookup. Verification computes its logits through the prefill kernel and a plain
decode through the decode kernel, so a continuation may differ, but only where the target's own
top-1/top-2 logit gap is a near-tie; most must be token-identical. Skipped without a CUDA GPU."""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.frontends.llm import LLM
from jaxinfer.model.transformer import train_forward
from jaxinfer.sampling_params import SamplingParams

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]
HELDOUT = ROOT / "checkpoints" / "heldout_sample.txt"
BACKEND = "mosaic"
NEAR_TIE = 0.1  # logits, as tests/gpu/test_engine_parity_gpu.py


@pytest.mark.parametrize("spec", [dict(speculative_model=str(ROOT / "checkpoints" / "demo-draft")),
                                  dict(speculative_method="ngram")], ids=["draft", "ngram"])
def test_speculation_matches_plain_decoding_up_to_near_ties(tmp_path, spec):
    lines = [line for line in HELDOUT.read_text().splitlines() if line.strip()]
    prompts = ["\n".join(lines[i:i + 3]) for i in range(0, 24, 3)]
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    outs, llms = {}, {}
    for name, extra in (("plain", {}), ("spec", dict(spec, num_speculative_tokens=4))):
        llms[name] = LLM(attention_backend=BACKEND, dtype="bfloat16", max_num_seqs=8,
                         max_num_batched_tokens=256, warmup=False, num_blocks=2048,
                         compilation_cache_dir=str(tmp_path), **extra)
        outs[name] = [(o.prompt_token_ids, o.outputs[0].token_ids)
                      for o in llms[name].generate(prompts, params, use_tqdm=False)]
    engine = llms["plain"].engine
    assert llms["spec"].engine.spec.metrics.accepted > 0
    identical = 0
    for (prompt, ref), (_, got) in zip(outs["plain"], outs["spec"]):
        first = next((i for i, (x, y) in enumerate(zip(ref, got)) if x != y), None)
        if first is None:
            identical += 1
            continue
        ctx = list(prompt) + list(ref[:first])
        logits = np.asarray(train_forward(engine.runner.params, engine.cfg,
                                          jnp.asarray([ctx], jnp.int32))[0, -1], np.float32)
        top2 = np.sort(logits)[-2:]
        assert top2[1] - top2[0] < NEAR_TIE, f"prompt {prompt[:8]}… differs at token {first}"
    assert identical >= 6
