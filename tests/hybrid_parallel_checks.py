"""The hybrid families (Granite 4.0-H's Mamba-2, Qwen3-Next's Gated DeltaNet) at TP = 2, a check of
tests/parallel_checks.py (its `models` part): each device keeps its state-space heads' states in
its head shard of the cache pages (jaxinfer/parallel/state_heads.py).

Per family, one TP = 2 engine (float32, 4-token blocks, 3-token prefill chunks, prefix caching):
a 29-token prompt through ten chunks, the same prompt again (a prefix-cache hit resuming from the
state snapshot at token 28), a 5-token prompt decoding 4 tokens; the test compares them with HF's
goldens, which one device gives (tests/test_hybrid_prefix_cache.py). And the collectives of the
engine's compiled forwards, which must move no cache page (the states are not gathered); and
the disaggregated hand-over refusing prefill and decode TP sizes that differ (the pages' layout
depends on it)."""

from pathlib import Path

import jax
import numpy as np

from jaxinfer import LLM, SamplingParams
from jaxinfer.bench.profile.hlo_collectives import COLLECTIVES
from jaxinfer.bench.profile.hlo_text import parse
from jaxinfer.disagg.transfer import KVTransfer
from jaxinfer.errors import ConfigError
from jaxinfer.model.config import load_config
from jaxinfer.parallel.sharding import ShardingPlan, build_mesh

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "models"
HYBRIDS = ["granitemoehybrid", "qwen3_next"]
MAX_ROWS = 16  # the engine's --max-num-batched-tokens: its largest forward


def _run(llm, prompt: list[int], max_tokens: int) -> dict:
    out = llm.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0,
                                                ignore_eos=True, logprobs=0),
                       use_tqdm=False)[0]
    return {"tokens": list(out.outputs[0].token_ids),
            "logprobs": [e.logprob for e in out.outputs[0].logprobs],
            "cached": out.num_cached_tokens}


def _collectives(llm) -> dict[str, int]:
    """Per collective opcode in the engine's compiled forwards, the most elements it moves."""
    most: dict[str, int] = {}
    for exe in llm.engine.runner.programs.compiled["packed forward"].values():
        for instrs in parse(exe.as_text()).comps.values():
            for i in instrs:
                op = i.opcode.removesuffix("-start")
                if op in COLLECTIVES:
                    most[op] = max(most.get(op, 0), *(n for _, n in i.arrays))
    return most


def _handover_refusal(model_dir: Path) -> str | None:
    cfg = load_config(model_dir)
    devices = jax.devices()
    try:
        KVTransfer(ShardingPlan(build_mesh(1, devices=devices[:1]), cfg),
                   ShardingPlan(build_mesh(2, devices=devices[1:3]), cfg), 4)
    except ConfigError as e:
        return str(e)
    return None


def hybrid_checks(out: dict) -> None:
    # Warm-up compiles every forward bucket ahead, keeping the executables whose HLO is read.
    kw = dict(dtype="float32", max_model_len=48, max_num_seqs=2, max_num_batched_tokens=MAX_ROWS,
              long_prefill_chunk=3, num_blocks=64, block_size=4, enable_prefix_caching=True,
              compilation_cache_dir=None, decode_steps_per_call=1,
              attention_backend="reference", background_compile=False)
    for fam in HYBRIDS:
        golden = np.load(FIXTURES / fam / "golden.npz")
        llm = LLM(str(FIXTURES / fam), tensor_parallel_size=2, **kw)
        long_prompt = golden["prompt_2"].tolist()
        out[f"hybrid/{fam}"] = {
            "chunked": _run(llm, long_prompt, 1), "hit": _run(llm, long_prompt, 1),
            "decoded": _run(llm, golden["greedy_prompt"].tolist(), 4),
            "collectives": _collectives(llm),
            "handover_refusal": _handover_refusal(FIXTURES / fam)}
