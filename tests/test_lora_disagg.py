"""LoRA with disaggregation (--enable-lora --disaggregate) on CPU: the hand-over carries the
request's adapter id, so the decode side continues it on the same adapter and greedy tokens equal
a plain engine's with that adapter, for rows of two adapters and of none in one batch, with one
adapter slot a side (a hand-over waits for the decode side's slot). Adapters are registered on
both sides under one id (frontends/lora_fan_out.py); an adapter the decode side can no longer
read fails its request in transit, leaking nothing.

Both engines share the one CPU device here (the hand-over's device-to-device copy between two
devices is tests/test_disagg.py's)."""

from __future__ import annotations

import os

import pytest

from jaxinfer import LoRARequest
from jaxinfer.engine.args import EngineArgs
from jaxinfer.engine.llm_engine import LLMEngine
from jaxinfer.errors import InvalidRequestError
from jaxinfer.frontends.disaggregated import DisaggregatedEngine
from jaxinfer.model.lora.peft import save_adapter
from jaxinfer.sampling_params import SamplingParams
from lora_support import random_adapter
from test_engine_support import (BLOCK, MAX_LEN, NUM_BLOCKS, assert_all_free,
                                 one_device_disaggregated, prompt_ids, run_all, tiny_model,
                                 tiny_tokenizer)

pytestmark = pytest.mark.filterwarnings("error:Some donated buffers were not usable")

ARGS = dict(model="tiny", max_model_len=MAX_LEN, block_size=BLOCK, num_blocks=NUM_BLOCKS,
            max_num_seqs=8, max_num_batched_tokens=32, long_prefill_chunk=32,
            compilation_cache_dir=None, warmup=False, dtype="float32", background_compile=False,
            enable_lora=True, max_loras=1, max_lora_rank=8, max_cpu_loras=2,
            decode_steps_per_call=1)
PROMPTS = [prompt_ids(40 + i, 6 + 2 * i) for i in range(4)]
ADAPTERS = ["a1", "a2", None, "a1"]  # each row's adapter (None: the base model)
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def plain_engine() -> LLMEngine:
    cfg, params = tiny_model()
    return LLMEngine(cfg, params, tiny_tokenizer(), EngineArgs(**ARGS), num_blocks=NUM_BLOCKS)


@pytest.fixture(scope="module")
def disagg() -> DisaggregatedEngine:
    cfg, params = tiny_model()
    return one_device_disaggregated(cfg, params, tiny_tokenizer(), EngineArgs(**ARGS), NUM_BLOCKS)


@pytest.fixture(scope="module")
def loras(tmp_path_factory) -> dict[str, LoRARequest]:
    cfg, _ = tiny_model()
    root = tmp_path_factory.mktemp("adapters")
    return {f"a{i}": LoRARequest(f"a{i}", i, str(save_adapter(random_adapter(cfg, 4, i), cfg,
                                                                root / f"a{i}")))
            for i in (1, 2, 3)}


def tokens(e, loras) -> dict[str, list[int]]:
    for i, (prompt, name) in enumerate(zip(PROMPTS, ADAPTERS)):
        e.add_request(f"r{i}", prompt, GREEDY, lora_request=loras.get(name))
    return {rid: out[0][0] for rid, out in run_all(e).items()}


@pytest.fixture(scope="module")
def plain(loras) -> tuple[dict, dict]:
    """A plain engine's greedy tokens: with the rows' adapters, and all on the base model."""
    e = plain_engine()
    expected, base = tokens(e, loras), tokens(e, {})
    assert base != expected  # the adapters change their rows
    return expected, base


def assert_nothing_held(d: DisaggregatedEngine) -> None:
    assert not d.requests and not d._transit
    for side in (d.prefill, d.decode):
        assert_all_free(side)


def test_adapters_hand_over_and_equal_a_plain_engine(disagg, loras, plain):
    expected, base = plain
    assert tokens(disagg, loras) == expected
    # The same prompts on the base model: the decode side's prefix cache holds the adapters'
    # blocks under their own namespaces, never matched by the base model's hand-overs.
    skipped = disagg.transfer_metrics.blocks_skipped._value.get()
    assert tokens(disagg, {}) == base
    assert disagg.transfer_metrics.blocks_skipped._value.get() > skipped  # (its own: a hit)
    assert disagg.decode.lora.num_loads >= 3  # the decode side ran a1, a2, then a1 again
    # Each side registered the requests' adapters under their ids.
    assert ([sorted((r.lora_name, r.lora_int_id) for r in side.list_loras())
             for side in (disagg.prefill, disagg.decode)] == [[("a1", 1), ("a2", 2)]] * 2)
    assert_nothing_held(disagg)


def test_admin_calls_reach_both_sides(disagg, loras):
    added = disagg.load_lora_adapter("late", loras["a3"].lora_path)
    assert all(added in side.list_loras() for side in (disagg.prefill, disagg.decode))
    disagg.add_request("busy", PROMPTS[0], GREEDY, lora_request=added)
    with pytest.raises(InvalidRequestError, match="in use"):
        disagg.remove_lora("late")
    disagg.abort("busy")
    disagg.remove_lora("late")
    assert all("late" not in [r.lora_name for r in side.list_loras()]
               for side in (disagg.prefill, disagg.decode))
    assert_nothing_held(disagg)


def test_an_adapter_the_decode_side_cannot_read_fails_in_transit(disagg, plain, tmp_path):
    cfg, _ = tiny_model()
    doomed = LoRARequest("doomed", 9, str(save_adapter(random_adapter(cfg, 4, 9), cfg,
                                                       tmp_path / "doomed")))
    disagg.add_lora(doomed)
    disagg.decode.lora._host.pop(9)  # dropped from the decode side's host copies ...
    for name in os.listdir(doomed.lora_path):  # ... and its files gone
        os.remove(os.path.join(doomed.lora_path, name))
    disagg.add_request("doomed", PROMPTS[1], GREEDY, lora_request=doomed)
    disagg.add_request("fine", PROMPTS[2], GREEDY)
    out = run_all(disagg)
    assert "doomed" not in out  # (no finish: its failure is its report)
    failed = disagg.take_failed()
    assert [rid for rid, _ in failed] == ["doomed"] and "no longer be read" in str(failed[0][1])
    assert out["fine"][0][0] == plain[1]["r2"]
    assert_nothing_held(disagg)
