"""LoRA in the engine: a mixed batch of 4 adapters + the base model gives each row the tokens it
gets alone (and the adapter's tokens those of the base model with it merged), slots reused LRU,
`update_lora` in place without compiling, prefix-cache isolation between adapters, refusals;
`--lora-impl pallas` under tensor parallelism decided to the XLA path, logged."""

from __future__ import annotations

import logging

import jax
import numpy as np
import pytest

from jaxinfer import LLM, LoRARequest, SamplingParams
from jaxinfer.engine.args import EngineArgs
from jaxinfer.engine.lora_args import with_lora_impl_decided
from jaxinfer.errors import InvalidRequestError
from jaxinfer.model.lora.peft import LoRAAdapterError, peft_tensors, save_adapter
from lora_support import merged, random_adapter
from test_engine_features import counting_compilations
from test_engine_support import assert_all_free, make_engine, prompt_ids, tiny_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPTS = [prompt_ids(70 + i, 9 + i) for i in range(5)]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    """Five adapters: a1..a4 rank 4 on every projection, a5 rank 2 on q/v only."""
    cfg, _ = tiny_model()
    root = tmp_path_factory.mktemp("adapters")
    out = {}
    for i in range(1, 6):
        ad = (random_adapter(cfg, 4, i) if i < 5 else
              random_adapter(cfg, 2, i, projs=("q_proj", "v_proj")))
        out[f"a{i}"] = (ad, LoRARequest(f"a{i}", i, str(save_adapter(ad, cfg, root / f"a{i}"))))
    return out


@pytest.fixture(scope="module")
def llm():
    return LLM(engine=make_engine(enable_lora=True, max_loras=4, max_lora_rank=8,
                                  max_cpu_loras=4, decode_steps_per_call=1))


def tokens(llm, prompts, lora=None) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False,
                                                          lora_request=lora)]


def test_mixed_batch_rows_get_their_own_tokens_and_equal_the_merged_model(llm, adapters):
    loras = [adapters[f"a{i}"][1] for i in range(1, 5)] + [None]
    mixed = tokens(llm, PROMPTS, loras)
    alone = [tokens(llm, [p], lora)[0] for p, lora in zip(PROMPTS, loras)]
    assert mixed == alone
    assert len({tuple(t) for t in mixed}) == 5
    assert tokens(llm, PROMPTS[:1])[0] != mixed[0]  # the adapter changes the tokens
    _, params = tiny_model()
    engine = llm.engine
    engine.update_weights(merged(params, adapters["a1"][0]))
    try:
        assert tokens(llm, PROMPTS[:1]) == mixed[:1]
    finally:
        engine.update_weights(params)
    assert engine.lora.num_loads == 4
    assert tokens(llm, PROMPTS[4:], adapters["a5"][1]) != mixed[4:]  # a 5th: an idle slot reused
    assert engine.lora.num_loads == 5 and tokens(llm, PROMPTS[:1], loras[0]) == mixed[:1]
    assert_all_free(engine)


def test_update_lora_changes_outputs_in_place_without_compiling(llm, adapters, tmp_path):
    cfg, _ = tiny_model()
    a2 = adapters["a2"][1]
    before = tokens(llm, PROMPTS[1:2], a2)
    new = random_adapter(cfg, 4, 42)
    loads = llm.engine.lora.num_loads
    with counting_compilations() as compilations:
        llm.update_lora("a2", jax.tree.map(np.asarray, peft_tensors(new)))
        after = tokens(llm, PROMPTS[1:2], a2)
        assert compilations[0] == 0
    assert after != before and llm.engine.lora.num_loads == loads  # written into its own slot
    same = LoRARequest("a2-copy", 12, str(save_adapter(new, cfg, tmp_path / "copy", 8.0)))
    assert tokens(llm, PROMPTS[1:2], same) == after
    with pytest.raises(LoRAAdapterError) as e:  # a rank other than the adapter's
        llm.update_lora("a2", peft_tensors(random_adapter(cfg, 2, 1)))
    assert e.value.param == "r"
    with pytest.raises(InvalidRequestError):
        llm.update_lora("nope", peft_tensors(new))


def test_prefix_cache_never_serves_one_adapters_blocks_to_another(llm, adapters):
    engine = llm.engine
    stats = engine.scheduler.kv.stats
    prompt = [prompt_ids(90, 13)]  # 3 full blocks of 4
    a3, a4 = adapters["a3"][1], adapters["a4"][1]
    first = tokens(llm, prompt, a3)
    hits = stats.hits
    fresh = [tokens(llm, prompt, a4), tokens(llm, prompt)]
    assert stats.hits == hits  # neither a4 nor the base model matched a3's blocks
    assert tokens(llm, prompt, a3) == first and stats.hits == hits + 12  # a3's own: a hit
    assert fresh == [tokens(llm, prompt, a4), tokens(llm, prompt)]


def test_lora_refusals_change_nothing(llm, adapters, tmp_path):
    engine = llm.engine
    if "a1" not in [r.lora_name for r in engine.list_loras()]:  # run alone: no earlier test's
        engine.add_lora(adapters["a1"][1])
    with pytest.raises(LoRAAdapterError) as e:
        llm.generate(PROMPTS[:1], GREEDY, lora_request=LoRARequest("x", 30, str(tmp_path)))
    assert e.value.param == "lora_path"
    with pytest.raises(InvalidRequestError, match="already"):
        engine.add_lora(LoRARequest("a1", 31, adapters["a1"][1].lora_path))
    engine.add_request("busy", PROMPTS[0], GREEDY, lora_request=adapters["a1"][1])
    with pytest.raises(InvalidRequestError, match="in use"):
        engine.remove_lora("a1")
    engine.abort("busy")
    engine.remove_lora("a1")
    assert "a1" not in [r.lora_name for r in engine.list_loras()]
    engine.add_lora(adapters["a1"][1])
    assert_all_free(engine)
    with pytest.raises(InvalidRequestError) as e:
        make_engine().add_request("r", PROMPTS[0], GREEDY, lora_request=adapters["a1"][1])
    assert e.value.param == "model"


def test_pallas_lora_under_tensor_parallelism_runs_the_xla_path_logged(caplog):
    args = EngineArgs(enable_lora=True, lora_impl="pallas", tensor_parallel_size=2)  # no refusal
    with caplog.at_level(logging.INFO, logger="jaxinfer.engine.lora_args"):
        assert with_lora_impl_decided(args).lora_impl == "xla"
    assert "not partitioned" in caplog.text
    one = EngineArgs(enable_lora=True, lora_impl="pallas")
    assert with_lora_impl_decided(one) is one  # the kernels run where nothing splits them
