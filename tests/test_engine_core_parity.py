"""The engine core in its own process gives the outputs the in-process engine gives: the same
requests run through both of `jaxinfer serve`'s engines (`--engine-core process` and
`in-process`), one at a time, and each choice's whole text, token ids, logprobs, finish and usage
must be equal. Covers greedy, seeded sampling, logprobs, n > 1, stop strings (found by the
server process, which then finishes the choice in the core), structured output, LoRA and
speculative decoding with the demo model's draft."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from jaxinfer.engine.args import EngineArgs
from jaxinfer.model.config import load_config
from jaxinfer.model.lora.peft import save_adapter
from jaxinfer.sampling_params import SamplingParams
from jaxinfer.structured import StructuredOutputsParams
from lora_support import random_adapter
from server_harness import DEMO, DEMO_ENGINE, MAX_MODEL_LEN, MODEL, make_tiny_model_dir

DRAFT = Path(__file__).parents[1] / "checkpoints" / "demo-draft"
PROMPT = "The quick brown fox"


def run_both(engine_args: EngineArgs, requests: list[tuple]) -> list[dict]:
    """[{mode: result}] per request: run every request, one after the other, on each engine."""
    from jaxinfer.frontends.server_engine import create_server_engine

    async def run(mode: str) -> list:
        engine = create_server_engine(EngineArgs(**vars(engine_args)), mode)
        assert type(engine).__name__ == ("CoreProcessEngine" if mode == "process" else "AsyncEngine")
        await engine.start()
        try:
            return [await collect(engine, f"r{i}", *req) for i, req in enumerate(requests)]
        finally:
            await engine.shutdown()

    process, in_process = asyncio.run(run("process")), asyncio.run(run("in-process"))
    return [{"process": a, "in-process": b} for a, b in zip(process, in_process)]


async def collect(engine, rid: str, prompt, params: SamplingParams, lora: str | None = None) -> dict:
    choices: dict[int, dict] = {}
    last = None
    lora_request = None if lora is None else engine.lora_requests[lora]
    async for out in engine.generate(prompt, params, rid, lora_request=lora_request):
        last = out
        for c in out.outputs:
            ch = choices.setdefault(c.index, {"text": "", "ids": [], "logprobs": []})
            ch["text"] += c.new_text
            ch["ids"] += list(c.new_token_ids)
            ch["logprobs"] += [(t.token_id, t.logprob, t.top) for t in c.new_logprobs or ()]
            ch["finish"] = (c.finish_reason, c.stop_reason)
            assert ch["text"] == c.text and ch["ids"] == list(c.token_ids)
    assert last is not None and last.finished
    return {"choices": choices, "generated": last.num_generated_tokens,
            "prompt_tokens": last.num_prompt_tokens}


def assert_same(results: list[dict]) -> None:
    for i, r in enumerate(results):
        assert r["process"] == r["in-process"], f"request {i} differs"


@pytest.fixture(scope="module")
def demo_results():
    greedy = dict(max_tokens=12, temperature=0.0)
    # A stop string is taken from the greedy text, so that it certainly occurs.
    return run_both(EngineArgs(model=str(DEMO), **DEMO_ENGINE), [
        (PROMPT, SamplingParams(**greedy)),
        (PROMPT, SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=7)),
        (PROMPT, SamplingParams(**greedy, logprobs=3)),
        (PROMPT, SamplingParams(max_tokens=10, temperature=1.0, seed=11, n=3, logprobs=0)),
        (PROMPT, SamplingParams(max_tokens=24, temperature=0.0, stop=["e"])),
        (PROMPT, SamplingParams(max_tokens=24, temperature=0.0, stop=["e"],
                                include_stop_str_in_output=True)),
        (PROMPT, SamplingParams(max_tokens=16, temperature=1.0, seed=5, n=3, stop=["a"])),
        (PROMPT, SamplingParams(max_tokens=24, temperature=0.0, stop=["e"], min_tokens=6)),
        ("Give digits:", SamplingParams(max_tokens=16, temperature=0.0, structured_outputs=(
            StructuredOutputsParams(regex="[0-9]{3}-[0-9]{2}")))),
    ])


def test_greedy_sampling_logprobs_and_n(demo_results):
    assert_same(demo_results[:4])
    lp = demo_results[2]["process"]["choices"][0]["logprobs"]
    assert len(lp) == 12 and all(len(top) == 3 for _, _, top in lp)
    assert len(demo_results[3]["process"]["choices"]) == 3


def test_stop_strings_found_by_the_server_process(demo_results):
    assert_same(demo_results[4:8])
    plain, included = demo_results[4]["process"], demo_results[5]["process"]
    assert plain["choices"][0]["finish"] == ("stop", "e") and "e" not in plain["choices"][0]["text"]
    assert included["choices"][0]["text"].endswith("e")
    # every choice of the n = 3 request stopped at "a" or ran to its length
    assert all(c["finish"] in (("stop", "a"), ("length", None))
               for c in demo_results[6]["process"]["choices"].values())


def test_structured_output(demo_results):
    assert_same(demo_results[8:])
    import re
    assert re.fullmatch("[0-9]{3}-[0-9]{2}", demo_results[8]["process"]["choices"][0]["text"])


def test_speculative_decoding():
    results = run_both(EngineArgs(model=str(DEMO), **DEMO_ENGINE, speculative_model=str(DRAFT),
                                  num_speculative_tokens=3), [
        (PROMPT, SamplingParams(max_tokens=16, temperature=0.0)),
        (PROMPT, SamplingParams(max_tokens=16, temperature=0.8, seed=3, logprobs=2)),
    ])
    assert_same(results)
    assert len(results[0]["process"]["choices"][0]["ids"]) == 16


def test_lora(tmp_path):
    model_dir = make_tiny_model_dir(tmp_path / "model")
    cfg = load_config(model_dir)
    path = save_adapter(random_adapter(cfg, 4, 1, scale=0.5), cfg, tmp_path / "sql")
    args = EngineArgs(model=str(model_dir), served_model_name=MODEL, dtype="float32",
                      max_model_len=MAX_MODEL_LEN, block_size=16, num_blocks=64, max_num_seqs=4,
                      max_num_batched_tokens=32, compilation_cache_dir="",
                      attention_backend="reference", warmup=False, decode_steps_per_call=1,
                      enable_lora=True, lora_modules=[f"sql={path}"], max_loras=2, max_lora_rank=8)
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    results = run_both(args, [("Hello world", greedy), ("Hello world", greedy, "sql")])
    assert_same(results)
    assert results[0]["process"] != results[1]["process"]  # the adapter changed the tokens
