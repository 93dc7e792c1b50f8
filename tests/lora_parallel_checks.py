"""The LoRA part of tests/parallel_checks.py (run there on 8 CPU devices): one adapter and the base
model in one batch, greedy tokens under TP = 2 (asking for --lora-impl pallas) against one device."""

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
        # tp2 asks for the Pallas kernels, which a TP engine runs as the XLA path
        # (lora_args.with_lora_impl_decided).
        for name, sizes in (("tp1", {}), ("tp2", {"tensor_parallel_size": 2, "lora_impl": "pallas"}),
                            ("dp2", {"data_parallel_size": 2})):
            llm = LLM(str(model), **sizes, **kw)
            if name == "tp2":
                out["lora/tp2_impl"] = llm.engine.config.lora.lora_impl
            # dp2: requests go to the less loaded replica, ties to the first: each replica gets
            # an adapter row, then a base row
            outs = llm.generate(prompts * 2, params, use_tqdm=False,
                                lora_request=[lora, lora, None, None])
            out[f"lora/{name}"] = [o.outputs[0].token_ids for o in outs]
        out["lora/base"] = llm.generate(prompts[:1], params, use_tqdm=False)[0].outputs[0].token_ids
        out["lora/dp2_replicas"] = [r.list_loras() != [] for r in llm.engine.replicas]
        # The admin calls reach every replica, under one id.
        dp = llm.engine
        added = dp.load_lora_adapter("b", str(path))
        out["lora/dp2_loaded"] = [sorted((x.lora_name, x.lora_int_id) for x in r.list_loras())
                                  for r in dp.replicas] + [added.lora_int_id]
        dp.remove_lora("b")
        out["lora/dp2_removed"] = [[x.lora_name for x in r.list_loras()] for r in dp.replicas]
