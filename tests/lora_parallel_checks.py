"""The LoRA part of tests/parallel_checks.py (run there on 8 CPU devices): one adapter and the base
model in one batch, greedy tokens under TP = 2 against one device."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np

from jaxinfer import LLM, LoRARequest, SamplingParams
from jaxinfer.model.config import load_config
from jaxinfer.model.lora.peft import save_adapter
from lora_support import random_adapter

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "models"


def lora_checks(out: dict) -> None:
    model = FIXTURES / "llama"
    cfg = load_config(model)
    golden = np.load(model / "golden.npz")
    prompts = [golden["greedy_prompt"].tolist(), golden["prompt_1"].tolist()]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    kw = dict(dtype="float32", max_num_seqs=4, max_num_batched_tokens=64, num_blocks=64,
              block_size=4, warmup=False, compilation_cache_dir=None, decode_steps_per_call=1,
              enable_lora=True, max_loras=1, max_lora_rank=8)
    with tempfile.TemporaryDirectory() as tmp:
        path = save_adapter(random_adapter(cfg, 4, 5, scale=0.5), cfg, Path(tmp) / "a")
        lora = LoRARequest("a", 1, str(path))
        for tp in (1, 2):
            llm = LLM(str(model), tensor_parallel_size=tp, **kw)
            outs = llm.generate(prompts, params, use_tqdm=False, lora_request=[lora, None])
            out[f"lora/tp{tp}"] = [o.outputs[0].token_ids for o in outs]
        out["lora/base"] = llm.generate(prompts[:1], params, use_tqdm=False)[0].outputs[0].token_ids
