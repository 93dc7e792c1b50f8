"""The engine inside a training loop: weight updates in place (no recompilation, no stale prefix-cache
hits, wrong pytrees refused by name, requests in flight aborted), sleep/wake of the KV cache, and
rollouts as padded arrays."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.frontends.llm import LLM
from jaxinfer.engine.llm_engine import LLMEngine
from jaxinfer.engine.args import EngineArgs
from jaxinfer.engine.rollout import to_rollout_batch
from jaxinfer.engine.weight_update import ParamsMismatchError
from jaxinfer.model.transformer import init_params
from jaxinfer.sampling_params import SamplingParams
from test_engine_features import counting_compilations
from test_engine_support import (BLOCK, MAX_LEN, NUM_BLOCKS, assert_all_free, make_engine,
                                 prompt_ids, run_all, tiny_model, tiny_tokenizer)

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
# 13 tokens: 3 full blocks of 4, which the prefix cache keeps after the first run.
PROMPTS = [prompt_ids(40 + i, 13) for i in range(3)]


def engine_with(params) -> LLMEngine:
    cfg, _ = tiny_model()
    args = EngineArgs(model="tiny", max_model_len=MAX_LEN, block_size=BLOCK, num_blocks=NUM_BLOCKS,
                      max_num_seqs=8, max_num_batched_tokens=32, long_prefill_chunk=32,
                      compilation_cache_dir=None, warmup=False, dtype="float32")
    return LLMEngine(cfg, params, tiny_tokenizer(), args, num_blocks=NUM_BLOCKS)


def greedy_tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def new_params():
    cfg, _ = tiny_model()
    return init_params(cfg, jax.random.key(8), jnp.float32, std=0.3)


def test_update_weights_equals_a_fresh_engine_without_recompiling_or_stale_prefix_hits():
    llm = LLM(engine=make_engine())
    before = greedy_tokens(llm)
    p2 = new_params()
    fresh = greedy_tokens(LLM(engine=engine_with(p2)))
    assert fresh != before  # the new weights change the greedy tokens
    stats = llm.engine.scheduler.kv.stats
    with counting_compilations() as compilations:
        llm.update_weights(p2)
        hits = stats.hits
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert compilations[0] == 0
    assert [o.outputs[0].token_ids for o in outs] == fresh
    assert stats.hits == hits  # the old weights' cached prompt blocks were not reused
    assert {o.weight_version for o in outs} == {1}
    assert greedy_tokens(llm) == fresh and stats.hits > hits  # (the same prompts do hit now)
    assert_all_free(llm.engine)


def test_update_weights_casts_host_arrays_of_another_float_dtype_on_the_device():
    llm = LLM(engine=make_engine())
    p2 = new_params()
    host_bf16 = jax.tree.map(lambda a: np.asarray(a.astype(jnp.bfloat16)), p2)
    llm.update_weights(host_bf16)
    leaf = jax.tree.leaves(llm.engine.runner.params)[0]
    assert isinstance(leaf, jax.Array) and leaf.dtype == jnp.float32
    rounded = jax.tree.map(lambda a: a.astype(jnp.bfloat16).astype(jnp.float32), p2)
    assert greedy_tokens(llm) == greedy_tokens(LLM(engine=engine_with(rounded)))


def test_update_weights_never_aliases_the_callers_buffers():
    engine = make_engine()
    p2 = new_params()
    engine.update_weights(p2)
    for a in jax.tree.leaves(p2):
        a.delete()  # a trainer donating its params must not break the engine
    engine.add_request("r", PROMPTS[0], GREEDY)
    assert len(run_all(engine)["r"][0][0]) == GREEDY.max_tokens


def test_an_update_frees_the_engines_own_old_weights_but_never_a_callers():
    engine = make_engine()
    callers = jax.tree.leaves(engine.runner.params)  # handed to the constructor: the caller's
    engine.update_weights(new_params())
    assert not any(a.is_deleted() for a in callers)
    own = jax.tree.leaves(engine.runner.params)  # placed by the update: the engine's own
    p3 = jax.tree.map(lambda a: np.asarray(a) * 0.5, new_params())
    engine.update_weights(p3)
    assert all(a.is_deleted() for a in own)  # each freed as its replacement landed
    assert greedy_tokens(LLM(engine=engine)) == greedy_tokens(LLM(engine=engine_with(p3)))


class _Unplaceable:
    """Passes the shape and dtype checks; no device can take it."""

    def __init__(self, like):
        self.shape, self.dtype = like.shape, like.dtype


def test_a_failed_transfer_leaves_a_usable_engine_naming_the_parameter():
    from jaxinfer.engine.weight_update import PartialUpdateError
    engine = make_engine()
    engine.update_weights(new_params())  # now the engine's own weights: an update frees them
    own = engine.runner.params
    p3 = jax.tree.map(np.asarray, new_params())
    p3["final_norm"]["weight"] = _Unplaceable(p3["final_norm"]["weight"])
    with pytest.raises(PartialUpdateError, match=re.escape("params['final_norm']['weight']")):
        engine.update_weights(p3)
    held = engine.runner.params
    assert held["final_norm"]["weight"] is own["final_norm"]["weight"]  # the old one, kept
    np.testing.assert_array_equal(np.asarray(held["embed"]["embedding"]),
                                  p3["embed"]["embedding"])
    assert engine.weight_version == 2
    engine.add_request("r", PROMPTS[0], GREEDY)
    assert len(run_all(engine)["r"][0][0]) == GREEDY.max_tokens


@pytest.mark.parametrize("mutate, path", [
    (lambda p: p["layers_0"].pop("attn"), "['layers_0']['attn']['k_proj']['kernel']"),
    (lambda p: p.__setitem__("extra", jnp.zeros(3)), "['extra']"),
    (lambda p: p["embed"].__setitem__("embedding", p["embed"]["embedding"][:-1]),
     "['embed']['embedding']"),
    (lambda p: p["final_norm"].__setitem__("weight", p["final_norm"]["weight"].astype(jnp.int32)),
     "['final_norm']['weight']"),
])
def test_wrong_params_are_refused_naming_the_parameter_and_change_nothing(mutate, path):
    engine = make_engine()
    bad = jax.tree.map(lambda a: a, new_params())  # fresh dicts to mutate
    mutate(bad)
    with pytest.raises(ParamsMismatchError, match=re.escape(f"params{path}")) as err:
        engine.update_weights(bad)
    assert err.value.path == path
    assert engine.weight_version == 0 and engine.runner.params is tiny_model()[1]


def test_update_weights_aborts_requests_in_flight_and_versions_outputs():
    engine = make_engine()
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"r{i}", p, GREEDY)
    engine.add_request("late", PROMPTS[0], GREEDY)
    engine.step()
    engine.step()
    outs = engine.update_weights(new_params())
    final = {o.request_id: o for o in outs if o.finished}
    assert set(final) == {"r0", "r1", "r2", "late"}
    assert all(c.finish_reason == "abort" for o in final.values() for c in o.outputs)
    assert {o.weight_version for o in outs} == {0}
    assert_all_free(engine)
    engine.add_request("after", PROMPTS[0], GREEDY)
    outs = list(engine.run_to_completion())
    assert outs[-1].finished and outs[-1].weight_version == 1


def live_bytes() -> int:
    return sum(a.nbytes for a in jax.live_arrays() if not a.is_deleted())


def test_sleep_frees_the_kv_cache_memory_and_wake_restores_a_working_engine():
    llm = LLM(engine=make_engine())
    before = greedy_tokens(llm)
    engine = llm.engine
    kv_bytes = sum(a.nbytes for a in jax.tree.leaves(engine.runner.kv_cache))
    # (long enough to be in flight after a step that is an 8-step decode loop: its prompt's last
    # token is its only one not in the prefix cache)
    engine.add_request("in-flight", PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=32,
                                                                ignore_eos=True))
    engine.step()
    live = live_bytes()
    outs = engine.sleep()
    assert [o.outputs[0].finish_reason for o in outs if o.finished] == ["abort"]
    assert live - live_bytes() >= kv_bytes
    assert engine.scheduler.kv.num_cached_blocks == 0
    engine.add_request("queued", PROMPTS[2], GREEDY)  # waits for wake()
    with pytest.raises(RuntimeError, match="asleep"):
        engine.step()
    engine.wake()
    assert live_bytes() - live >= -1024 and engine.runner.kv_cache[0][0].shape[1] == NUM_BLOCKS
    with counting_compilations() as compilations:
        queued = run_all(engine)["queued"][0][0]
        assert greedy_tokens(llm) == before
        assert compilations[0] == 0
    assert queued == before[2]


def test_rollout_batch_pads_generate_outputs_with_their_logprobs():
    llm = LLM(engine=make_engine())
    prompts = [prompt_ids(7, 5), prompt_ids(8, 9)]
    params = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=6, logprobs=2, min_tokens=1)
    outs = llm.generate(prompts, params, use_tqdm=False)
    batch = to_rollout_batch(outs, max_completion_len=8, top_k=2)
    assert batch.completion_ids.shape == (4, 8) and batch.prompt_ids.shape == (4, 9)
    assert batch.group.tolist() == [0, 0, 1, 1]
    assert batch.prompt_lens.tolist() == [5, 5, 9, 9]
    assert batch.weight_versions.tolist() == [0] * 4
    tokens, loss_mask, old = batch.packed()
    for i, (g, c) in enumerate([(g, c) for g, o in enumerate(outs) for c in o.outputs]):
        n = len(c.token_ids)
        assert 1 <= n == len(c.logprobs) == batch.completion_lens[i]  # every token's logprob kept
        assert batch.finish_reasons[i] == c.finish_reason
        np.testing.assert_allclose(batch.logprobs[i, :n], [lp.logprob for lp in c.logprobs])
        assert not batch.logprobs[i, n:].any() and not batch.completion_mask[i, n:].any()
        assert batch.top_ids[i, 0].tolist() == [t for t, _ in c.logprobs[0].top]
        p = len(prompts[g])
        assert tokens[i, :p + n].tolist() == prompts[g] + c.token_ids
        # column j predicts tokens[j + 1]: exactly the completion's tokens are trained on
        assert np.flatnonzero(loss_mask[i]).tolist() == list(range(p - 1, p - 1 + n))
        np.testing.assert_allclose(old[i, p - 1:p - 1 + n], batch.logprobs[i, :n])
    with pytest.raises(ValueError, match="max_completion_len"):
        to_rollout_batch(outs, max_completion_len=2)
    with pytest.raises(ValueError, match="top_k=3 but the completions were sampled with logprobs=2"):
        to_rollout_batch(outs, top_k=3)
    plain = llm.generate(prompts[:1], SamplingParams(max_tokens=3), use_tqdm=False)
    with pytest.raises(ValueError, match="logprobs"):
        to_rollout_batch(outs + plain)
    assert to_rollout_batch(plain).logprobs is None


def test_grpo_example_reward_and_group_advantages():
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parent.parent / "examples" / "grpo_demo.py"
    spec = importlib.util.spec_from_file_location("grpo_demo", path)
    grpo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(grpo)
    assert grpo.reward("x = 1\ny = 2") == 1.0
    assert grpo.reward("x = (\n1)\nz = ") == 1 / 3  # only "x = (\n1)" parses
    adv = grpo.group_advantages(np.array([1.0, 0.0, 0.5, 0.5], np.float32), np.array([0, 0, 1, 1]))
    np.testing.assert_allclose(adv, [1.0, -1.0, 0.0, 0.0], atol=1e-5)
