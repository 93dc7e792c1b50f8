"""What the hybrid families' engine tests share (test_granite_hybrid.py, test_qwen3_next.py): the
engine flags of a tiny hybrid, the walk of an engine against HF's goldens
(tests/fixtures/make_golden_hybrid.py), and the param tree of an init through the reference
kernels."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.engine.args import EngineArgs
from jaxinfer.sampling_params import SamplingParams
from test_engine_support import assert_all_free, run_all

GREEDY = dict(temperature=0.0, ignore_eos=True)


def hybrid_args(model_dir: Path, num_blocks: int, **overrides) -> EngineArgs:
    """3-token prefill chunks in 16-token steps, float32 on the reference kernels."""
    args = dict(model=str(model_dir), max_model_len=32, num_blocks=num_blocks, max_num_seqs=4,
                max_num_batched_tokens=16,
                long_prefill_chunk=3, compilation_cache_dir=None, warmup=False, dtype="float32",
                background_compile=False, attention_backend="reference",
                enable_prefix_caching=False)
    return EngineArgs(**{**args, **overrides})


def golden_prompt_logprobs(golden, i: int) -> np.ndarray:
    prompt = golden[f"prompt_{i}"]
    want = np.asarray(jax.nn.log_softmax(golden[f"logits_{i}"], axis=-1))
    return want[np.arange(len(prompt) - 1), prompt[1:]]


def assert_engine_matches_goldens(engine, golden) -> None:
    """On an engine whose pool is small enough to preempt: three greedy runs and a fork (n = 2)
    give HF's greedy tokens; then prompts of 1, 7 and 29 tokens scored in 3-token chunks beside a
    decoding run (steps mixing decode rows and prefill chunks) give HF's prompt logprobs; then
    aborts mid-prefill and mid-decode; every block comes back after each part."""
    prompt, expected = golden["greedy_prompt"].tolist(), golden["greedy_tokens"].tolist()
    for i in range(3):
        engine.add_request(f"g{i}", prompt, SamplingParams(max_tokens=len(expected), **GREEDY))
    engine.add_request("fork", prompt, SamplingParams(n=2, max_tokens=len(expected), **GREEDY))
    results = run_all(engine)
    assert engine.scheduler.num_preemptions > 0
    for i in range(3):
        assert results[f"g{i}"][0][0] == expected, i
    assert results["fork"][0][0] == results["fork"][1][0] == expected
    assert_all_free(engine)

    engine.add_request("decode", prompt, SamplingParams(max_tokens=len(expected), **GREEDY))
    engine.step()
    for i in range(3):
        engine.add_request(f"p{i}", golden[f"prompt_{i}"].tolist(),
                           SamplingParams(max_tokens=1, prompt_logprobs=1, **GREEDY))
    scored, firsts = {}, {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.prompt_logprobs and out.request_id not in scored:
                scored[out.request_id] = [e.logprob for e in out.prompt_logprobs[1:]]
            if out.finished:
                firsts[out.request_id] = out.outputs[0].token_ids
    assert firsts["decode"] == expected
    for i in range(3):
        assert firsts[f"p{i}"] == [int(np.argmax(golden[f"logits_{i}"][-1]))], i
        np.testing.assert_allclose(scored.get(f"p{i}", []), golden_prompt_logprobs(golden, i),
                                   atol=1e-4, rtol=0)
    assert_all_free(engine)

    for i in range(3):
        engine.add_request(f"a{i}", golden["prompt_2"].tolist(),
                           SamplingParams(max_tokens=3, **GREEDY))
    for _ in range(4):
        engine.step()
    for i in range(3):
        engine.abort(f"a{i}")
    while engine.has_unfinished_requests():
        engine.step()
    assert_all_free(engine)


def assert_same_outputs(got: dict, want: dict) -> None:
    """{request id: (tokens, logprobs)}: the same tokens, logprobs to 1e-5."""
    assert got.keys() == want.keys()
    for rid, (tokens, logprobs) in want.items():
        assert got[rid][0] == tokens, rid
        np.testing.assert_allclose(got[rid][1], logprobs, atol=1e-5, rtol=0)


def reference_param_shapes(cfg, dtype):
    """The param tree's shapes as the model's init through the reference kernels makes them."""
    from jaxinfer.model.kernel_table import REFERENCE_KERNELS
    from jaxinfer.model.transformer import Transformer
    model, tokens = Transformer(cfg, REFERENCE_KERNELS, dtype), jnp.zeros((1, 1), jnp.int32)
    return jax.eval_shape(lambda: model.init(jax.random.key(0), tokens, tokens))["params"]


def assert_same_tree(got, want) -> None:
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
    assert jax.tree_util.tree_leaves(got) == jax.tree_util.tree_leaves(want)
