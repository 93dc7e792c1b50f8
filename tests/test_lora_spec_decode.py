"""LoRA with speculative decoding on CPU: the target verifies each row with its own adapter
(the proposers run the base model, so an adapter's row gets fewer accepted drafts), so greedy
outputs equal LoRA without speculation token for token, for rows of two adapters and of none in
one batch: n-gram and draft-model proposals (host-driven verifying steps) and an EAGLE-3 head in
the on-device loop (spec_decode/spec_loop.py)."""

from __future__ import annotations

import pytest

from jaxinfer import LoRARequest
from jaxinfer.engine.args import EngineArgs
from jaxinfer.engine.llm_engine import LLMEngine
from jaxinfer.model.lora.peft import save_adapter
from jaxinfer.sampling_params import SamplingParams
from jaxinfer.spec_decode.draft import DraftModel
from jaxinfer.spec_decode.eagle import EagleProposer
from lora_support import random_adapter
from test_eagle3 import random_head
from test_engine_support import (BLOCK, MAX_LEN, NUM_BLOCKS, assert_all_free, prompt_ids, run_all,
                                 tiny_model, tiny_tokenizer)

pytestmark = pytest.mark.filterwarnings("error:Some donated buffers were not usable")

LORA = dict(enable_lora=True, max_loras=2, max_lora_rank=8, decode_steps_per_call=1)
# Repetitive prompts, so the n-gram proposer finds matches.
PROMPTS = [prompt_ids(i % 3, 5 + i) * 2 for i in range(5)]
ADAPTERS = ["a1", "a2", None, "a1", None]  # each row's adapter (None: the base model)


@pytest.fixture(scope="module")
def loras(tmp_path_factory) -> dict[str, LoRARequest]:
    cfg, _ = tiny_model()
    root = tmp_path_factory.mktemp("adapters")
    return {f"a{i}": LoRARequest(f"a{i}", i, str(save_adapter(random_adapter(cfg, 4, i), cfg,
                                                                root / f"a{i}")))
            for i in (1, 2)}


def greedy(engine, loras) -> dict:
    for i, (prompt, name) in enumerate(zip(PROMPTS, ADAPTERS)):
        engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0.0, max_tokens=10,
                                                          ignore_eos=True),
                           lora_request=loras.get(name))
    return run_all(engine)


def engine(draft=None, **flags) -> LLMEngine:
    cfg, params = tiny_model()
    args = dict(model="tiny", max_model_len=MAX_LEN, block_size=BLOCK, num_blocks=NUM_BLOCKS,
                max_num_seqs=8, max_num_batched_tokens=32, long_prefill_chunk=32,
                compilation_cache_dir=None, warmup=False, dtype="float32", **LORA, **flags)
    return LLMEngine(cfg, params, tiny_tokenizer(), EngineArgs(**args), num_blocks=NUM_BLOCKS,
                     draft=draft)


@pytest.fixture(scope="module")
def without_speculation(loras) -> dict:
    e = engine()
    out = greedy(e, loras)
    # The adapters change the rows they run (so a verify without them would be caught).
    base = greedy(e, {})
    assert all((out[r] == base[r]) == (name is None) for r, name in zip(out, ADAPTERS))
    return out


def _eagle() -> EagleProposer:
    cfg, _ = tiny_model()
    return EagleProposer(*random_head(cfg, std=0.05))


K = 3
SPECULATION = {  # name: (the engine's flags, its proposer)
    "ngram": (dict(speculative_method="ngram", num_speculative_tokens=K), lambda: None),
    "draft": (dict(speculative_model="draft", num_speculative_tokens=K),
              lambda: DraftModel(*tiny_model())),
    "eagle3_loop": (dict(speculative_config={"method": "eagle3", "model": "in-process",
                                             "num_speculative_tokens": K},
                         spec_loop_iterations=4), _eagle),
}


@pytest.mark.parametrize("method", SPECULATION)
def test_greedy_with_speculation_equals_lora_alone(method, loras, without_speculation):
    flags, proposer = SPECULATION[method]
    e = engine(proposer(), speculative_min_acceptance=0.0, **flags)
    assert greedy(e, loras) == without_speculation
    m = e.spec.metrics
    assert 0 < m.accepted < m.draft_tokens  # drafts verified, some of them rejected
    if method == "eagle3_loop":
        assert e.spec.step.loop.dispatches > 0
    assert_all_free(e)
