"""The hybrid families (Granite 4.0-H's Mamba-2, Qwen3-Next's Gated DeltaNet) at TP = 2, a check of
tests/parallel_checks.py (its `models` part): each device keeps its state-space heads' states in
its head shard of the cache pages (jaxinfer/parallel/state_heads.py).

Per family, one TP = 2 engine (float32, 4-token blocks, 3-token prefill chunks, prefix caching):
a 29-token prompt through ten chunks, the same prompt again (a prefix-cache hit resuming from the
state snapshot at token 28), a 5-token prompt decoding 4 tokens; the test compares them with HF's
goldens, which one device gives (tests/test_hybrid_prefix_cache.py). And the collectives of the
engine's compiled forwards, which must move no cache page (the states are not gathered). And
disaggregated pairs handing the states' pages over from TP = 1 to TP = 2 and back (a page's
layout is the same at every TP size: model/state_pages.py), against one device: the long prompt
prefilled in chunks and the short one, decoding 4 tokens each."""

from pathlib import Path

import numpy as np

from jaxinfer import LLM, SamplingParams
from jaxinfer.bench.profile.hlo_collectives import COLLECTIVES
from jaxinfer.bench.profile.hlo_text import parse

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "models"
HYBRIDS = ["granitemoehybrid", "qwen3_next"]
# The (prefill, decode) TP sizes each family's states are handed over between. Both directions
# run the same page layout code; the reverse runs on one family only (a TP = 2 prefill engine
# compiles for some seconds).
HANDOVERS = {"granitemoehybrid": ((1, 2), (2, 1)), "qwen3_next": ((1, 2),)}
MAX_ROWS = 16  # the engine's --max-num-batched-tokens: its largest forward


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


def _run(llm, prompts: list[list[int]], max_tokens: int) -> list[dict]:
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0,
                                                ignore_eos=True, logprobs=0), use_tqdm=False)
    return [{"tokens": list(o.outputs[0].token_ids), "cached": o.num_cached_tokens,
             "logprobs": [e.logprob for e in o.outputs[0].logprobs]} for o in outs]


def _handed_over(model_dir: Path, prompts: list[list[int]], kw: dict, pairs) -> dict:
    """One device's greedy tokens and logprobs, and those of disaggregated pairs whose prefill and
    decode TP sizes (`pairs`) differ (prefill on the first devices, decode on the next)."""
    kw = {**kw, "warmup": False}
    out = {"one_device": _run(LLM(str(model_dir), **kw), prompts, 4)}
    for prefill_tp, decode_tp in pairs:
        llm = LLM(str(model_dir), disaggregate=True, prefill_tensor_parallel_size=prefill_tp,
                  decode_tensor_parallel_size=decode_tp, **kw)
        out[f"tp{prefill_tp}_to_tp{decode_tp}"] = _run(llm, prompts, 4)
    return out


def hybrid_checks(out: dict) -> None:
    # Warm-up compiles every forward bucket ahead, keeping the executables whose HLO is read.
    kw = dict(dtype="float32", max_model_len=48, max_num_seqs=2, max_num_batched_tokens=MAX_ROWS,
              long_prefill_chunk=3, num_blocks=64, block_size=4, enable_prefix_caching=True,
              compilation_cache_dir=None, decode_steps_per_call=1,
              attention_backend="reference", background_compile=False)
    for fam in HYBRIDS:
        golden = np.load(FIXTURES / fam / "golden.npz")
        llm = LLM(str(FIXTURES / fam), tensor_parallel_size=2, **kw)
        long_prompt, short_prompt = golden["prompt_2"].tolist(), golden["greedy_prompt"].tolist()
        out[f"hybrid/{fam}"] = {
            "chunked": _run(llm, [long_prompt], 1)[0], "hit": _run(llm, [long_prompt], 1)[0],
            "decoded": _run(llm, [short_prompt], 4)[0], "collectives": _collectives(llm),
            "handed_over": _handed_over(FIXTURES / fam, [long_prompt, short_prompt], kw,
                                        HANDOVERS[fam])}
