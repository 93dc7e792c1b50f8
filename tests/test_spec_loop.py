"""The on-device speculative loop (spec_decode/spec_loop.py) on CPU: greedy outputs (tokens, texts,
finish reasons, logprobs) identical to no speculation and to the host-driven verifying steps, for
the demo model with its EAGLE-3 head (rows of different lengths, stop token ids with and without
min_tokens, stop strings, max_tokens reached part-way through an iteration, logprobs; the tiny
model: the context limit, n = 2); loops really ran (several iterations' tokens in one dispatch,
fewer dispatches); preemption, an abort right after a loop and a pool too small to reserve a
loop leak no block; the acceptance metrics count what host-driven steps count, and the
acceptance gate takes each iteration as a verifying step."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from jaxinfer.engine.args import EngineArgs
from jaxinfer.engine.llm_engine import LLMEngine
from jaxinfer.sampling_params import SamplingParams
from jaxinfer.spec_decode.eagle import EagleProposer
from jaxinfer.spec_decode.spec_loop import SpecLoopHandle
from pallas_kernels.attention.backend import REFERENCE, register
from test_eagle3 import random_head
from test_engine_support import (BLOCK, MAX_LEN, NUM_BLOCKS, assert_all_free, prompt_ids,
                                 record_proposed, run_all, tiny_model, tiny_tokenizer)

pytestmark = [pytest.mark.filterwarnings("error:Some donated buffers were not usable"),
              pytest.mark.slow]

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "checkpoints" / "demo-target"
DEMO_EAGLE = ROOT / "checkpoints" / "demo-eagle3"
K = 3
PROMPTS = ["import re\n\n\ndef parse_version(version):",
           "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, x):",
           "def fib(n):",
           "import os\nimport sys\n\n\ndef main(argv):\n    parser = ",
           "    for i in range(10):\n        if i % 2 == 0:"]


def demo_engine(loop_iterations: int | None = None, spec: bool = True, **kwargs) -> LLMEngine:
    args = dict(model=str(DEMO), warmup=False, compilation_cache_dir=None, num_blocks=256,
                dtype="float32", max_num_seqs=8, max_num_batched_tokens=64, block_size=16)
    if spec:
        args.update(speculative_config=json.dumps({"method": "eagle3", "model": str(DEMO_EAGLE),
                                                   "num_speculative_tokens": K}),
                    speculative_min_acceptance=0.0, spec_loop_iterations=loop_iterations)
    args.update(kwargs)
    return LLMEngine.from_engine_args(EngineArgs(**args))


def run_collecting(engine: LLMEngine, requests: dict) -> tuple[dict, list]:
    """{id: (token ids, text, finish reason, logprobs)} and the handles of every dispatch."""
    handles = []
    execute = engine.runner.execute

    def recording(sched):
        handles.append(execute(sched))
        return handles[-1]
    engine.runner.execute = recording
    try:
        for rid, (prompt, params) in requests.items():
            engine.add_request(rid, prompt, params)
        out = {}
        while engine.has_unfinished_requests():
            for r in engine.step():
                c = r.outputs[0]
                lps = None if c.logprobs is None else [
                    (lp.token_id, round(lp.logprob, 3)) for lp in c.logprobs]
                out[r.request_id] = (c.token_ids, c.text, c.finish_reason, lps)
    finally:
        engine.runner.execute = execute
    assert_all_free(engine)
    return out, handles


@pytest.fixture(scope="module")
def engines() -> dict[str, LLMEngine]:
    """The demo model without speculation, with host-driven EAGLE-3 steps (loops of 1) and with
    the default configuration (loops of AUTO_SPEC_LOOP_ITERATIONS), shared by the tests."""
    return {"base": demo_engine(spec=False, decode_steps_per_call=1),
            "host": demo_engine(loop_iterations=1),
            "loop": demo_engine()}


def counts(e: LLMEngine) -> tuple[int, int, int, int]:
    """(loops dispatched, drafts, draft tokens, accepted) so far."""
    m, loop = e.spec.metrics, e.spec.step.loop
    return (loop.dispatches if loop else 0), m.drafts, m.draft_tokens, m.accepted


def since(e: LLMEngine, before) -> tuple[int, ...]:
    return tuple(a - b for a, b in zip(counts(e), before))


@pytest.fixture(scope="module")
def continuations(engines):
    """Each prompt's greedy continuation without speculation (limits are chosen from them)."""
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    out, _ = run_collecting(engines["base"],
                            {f"c{i}": (p, params) for i, p in enumerate(PROMPTS)})
    return [out[f"c{i}"] for i in range(len(PROMPTS))]


def workload(conts) -> dict:
    g = dict(temperature=0.0, ignore_eos=True)
    # (the sampler bans it before min_tokens: a token that comes back often stops it after)
    tail = conts[3][0][6:]
    frequent = max(set(tail), key=tail.count)
    return {
        "len23": (PROMPTS[0], SamplingParams(max_tokens=23, **g)),
        "len37": (PROMPTS[1], SamplingParams(max_tokens=37, **g)),
        "stop": (PROMPTS[2], SamplingParams(max_tokens=40, stop_token_ids=[conts[2][0][9]], **g)),
        "stop_min": (PROMPTS[3], SamplingParams(max_tokens=30, min_tokens=6,
                                                stop_token_ids=[frequent], **g)),
        "stop_str_logprobs": (PROMPTS[4], SamplingParams(
            max_tokens=29, logprobs=2, stop=[conts[4][1][len(conts[4][1]) * 2 // 3:][:3]], **g)),
    }


def test_greedy_loop_matches_no_speculation_and_the_host_driven_steps(engines, continuations):
    """The default configuration runs loops; their outputs are no speculation's and the
    host-driven steps'."""
    requests = workload(continuations)
    host_engine, loop_engine = engines["host"], engines["loop"]
    base, _ = run_collecting(engines["base"], requests)
    host0, loop0 = counts(host_engine), counts(loop_engine)
    host, host_handles = run_collecting(host_engine, requests)
    looped, handles = run_collecting(loop_engine, requests)
    assert looped == base == host
    assert {r: v[2] for r, v in looped.items()} == {
        "len23": "length", "len37": "length", "stop": "stop", "stop_min": "stop",
        "stop_str_logprobs": "stop"}
    loops = [h for h in handles if isinstance(h, SpecLoopHandle)]
    (dispatches, drafts, draft_tokens, accepted), hm = since(loop_engine, loop0), since(
        host_engine, host0)
    assert dispatches == len(loops) > 0
    assert host_engine.spec.step.loop is None
    # several iterations' tokens came back from one dispatch, in fewer dispatches in all
    assert max((h.result().tokens >= 0).sum(axis=0).max() for h in loops) > K + 1
    assert len(handles) < len(host_handles)
    assert drafts > 0 and 0 < accepted <= draft_tokens
    # (more: the loop computes a row its stop string ended until the loop ends)
    assert accepted >= hm[3]


def test_loop_iterations_propose_and_accept_what_host_steps_do(engines, continuations):
    """Without stop strings every loop iteration is a host-driven step's twin: the same rows,
    proposal counts and accepted proposals (the head's catch-up and chain are exact), counted
    into the metrics the same."""
    requests = {r: v for r, v in workload(continuations).items() if not v[1].stop}
    host_engine, loop_engine = engines["host"], engines["loop"]
    host0, loop0 = counts(host_engine), counts(loop_engine)
    assert run_collecting(host_engine, requests)[0] == run_collecting(loop_engine, requests)[0]
    looped = since(loop_engine, loop0)
    assert looped[1:] == since(host_engine, host0)[1:] and looped[0] > 0


# The reference kernels behind a GPU backend's mixed-step rule (one-token rows of a ragged call
# found on the device and sent to the decode kernel), which the loop turns off for its calls.
SPLIT_REFERENCE = dataclasses.replace(REFERENCE, name="reference_split", split_mixed_steps=True)
register("reference_split", "test_spec_loop:SPLIT_REFERENCE")


def tiny_loop_engine(proposer: bool = True, num_blocks: int = NUM_BLOCKS,
                     min_acceptance: float = 0.0, **kwargs) -> LLMEngine:
    """The tiny model, with a random EAGLE-3 head speculating in loops of 4 iterations."""
    cfg, params = tiny_model()
    args = dict(model="tiny", max_model_len=MAX_LEN, block_size=BLOCK, num_blocks=num_blocks,
                max_num_seqs=8, max_num_batched_tokens=32, long_prefill_chunk=32,
                compilation_cache_dir=None, warmup=False, dtype="float32", **kwargs)
    draft = None
    if not proposer:  # the baseline: single steps (compiling a decode loop costs more here)
        args.setdefault("decode_steps_per_call", 1)
    if proposer:
        head_cfg, hp = random_head(cfg, std=0.05)
        draft = EagleProposer(head_cfg, hp)
        args.update(speculative_config={"method": "eagle3", "model": "in-process",
                                        "num_speculative_tokens": 2},
                    speculative_min_acceptance=min_acceptance, spec_loop_iterations=4)
    return LLMEngine(cfg, params, tiny_tokenizer(), EngineArgs(**args), num_blocks=num_blocks,
                     draft=draft)


TINY = {f"t{i}": (prompt_ids(20 + i, 6 + 5 * i),
                  SamplingParams(temperature=0.0, max_tokens=18 + 3 * i, ignore_eos=True))
        for i in range(4)}


def run_tiny(e: LLMEngine, rids=tuple(TINY)) -> dict:
    for rid in rids:
        e.add_request(rid, *TINY[rid])
    return run_all(e)


def test_preemption_and_a_pool_too_small_to_reserve_a_loop_leak_nothing():
    """A pool that holds two of the four sequences: preemptions, loops whose reservation fails
    (single verifying steps instead), and the same greedy outputs."""
    e = tiny_loop_engine(num_blocks=26)
    speculator, refused = e.scheduler.speculator, []
    loop_iterations = speculator.loop_iterations

    def recording(scheduler, decodes):
        n = loop_iterations(scheduler, decodes)
        refused.append(n == 1 and all(d.proposal for d in decodes))  # (no other refusal here)
        return n
    speculator.loop_iterations = recording
    assert run_tiny(e) == run_tiny(tiny_loop_engine(proposer=False, num_blocks=26))
    assert e.scheduler.num_preemptions > 0 and e.spec.step.loop.dispatches > 0 and any(refused)
    assert_all_free(e)


def test_an_abort_right_after_a_loop_leaks_nothing():
    e = tiny_loop_engine()
    for rid in TINY:
        e.add_request(rid, *TINY[rid])
    while e.spec.step.loop.dispatches == 0:
        e.step()
    e.step()  # processes that loop (and dispatches the next step, likely a loop)
    e.abort("t1")
    rest = run_all(e)
    assert_all_free(e)
    expected = run_tiny(tiny_loop_engine(proposer=False), ("t0", "t2", "t3"))
    assert {rid: rest[rid] for rid in expected} == expected


@pytest.mark.parametrize("backend", ["reference", "reference_split"])
def test_rows_at_the_context_limit_and_n2_choices(backend):
    """Rows that run into max_model_len (no max_tokens) and two choices of one request: loops stop
    each at its limit; outputs as without speculation (also over a backend that splits mixed
    steps, as the GPU ones do)."""
    requests = {"ctx": (prompt_ids(30, 44), SamplingParams(temperature=0.0, max_tokens=None,
                                                           ignore_eos=True)),
                "n2": (prompt_ids(31, 12), SamplingParams(n=2, temperature=0.0, max_tokens=21,
                                                          ignore_eos=True))}

    def run(e):
        for rid, (prompt, params) in requests.items():
            e.add_request(rid, prompt, params)
        out = run_all(e)
        assert_all_free(e)
        return out
    e = tiny_loop_engine(attention_backend=backend)
    looped = run(e)
    assert looped == run(tiny_loop_engine(proposer=False))
    assert len(looped["ctx"][0][0]) == MAX_LEN - 44 and e.spec.step.loop.dispatches > 0


def test_the_acceptance_gate_counts_each_iteration_as_a_step(monkeypatch):
    """A random head under --speculative-min-acceptance 1: a full window of loop iterations (each
    one verifying step to the gate) closes it, and the rest runs without speculation."""
    monkeypatch.setattr("jaxinfer.spec_decode.gate.WINDOW_STEPS", 4)
    e = tiny_loop_engine(min_acceptance=1.0)
    proposed = record_proposed(e)
    assert run_tiny(e) == run_tiny(tiny_loop_engine(proposer=False))
    gate = e.spec.speculator.gate
    assert gate.closings == 1 and not gate.open and e.spec.step.loop.dispatches >= 1
    assert e.spec.metrics.draft_tokens >= 64  # the window filled from loops' iterations
    assert proposed[-1] == 0
