"""LoRA without an engine: PEFT adapters read and refused by field, the mixed-batch delta against
the per-row reference, the device stacks (fused layouts too), every family's fixture with an
adapter against the base model with it merged into its weights (W + s·BA), the slot LRU and the
prefix cache's namespaces."""

from __future__ import annotations

import functools
import json
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.core.kv_cache import KVCacheManager
from jaxinfer.core.lora_slots import LoRASlots
from jaxinfer.lora_request import LoRARequest
from jaxinfer.model.config import load_config
from jaxinfer.model.fused_projections import fuse_projections
from jaxinfer.model.lora.delta import lora_delta, lora_delta_gather
from jaxinfer.model.lora.peft import LoRAAdapterError, load_adapter, save_adapter
from jaxinfer.model.lora.stacks import LORA, empty_stacks, slot_arrays
from jaxinfer.model.transformer import REFERENCE_KERNELS, Transformer
from jaxinfer.model.weights import load_params
from lora_support import merged, random_adapter

FIXTURES = Path(__file__).parent / "fixtures" / "models"
# (mixtral_fused and qwen3_moe_fused differ from these only in how their experts are stored)
FAMILIES = ["llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen3_moe", "qwen3_next"]
LLAMA = FIXTURES / "llama"


@pytest.fixture(scope="module")
def llama_cfg():
    return load_config(LLAMA)


# ---- PEFT files ---------------------------------------------------------------------------
def _edit(path: Path, **fields) -> Path:
    cfg_file = path / "adapter_config.json"
    config = json.loads(cfg_file.read_text())
    config.update(fields)
    cfg_file.write_text(json.dumps(config))
    return path


def test_peft_round_trip_and_scaling(tmp_path, llama_cfg):
    adapter = random_adapter(llama_cfg, 4, 0, alpha=8.0)
    path = save_adapter(adapter, llama_cfg, tmp_path / "a")
    got = load_adapter(path, llama_cfg, max_rank=8)
    assert got.rank == 4 and got.scaling == pytest.approx(2.0)
    for key, (a, b) in adapter.weights.items():
        np.testing.assert_array_equal(got.weights[key][0], a)
        np.testing.assert_array_equal(got.weights[key][1], b)
    _edit(path, use_rslora=True)
    assert load_adapter(path, llama_cfg, 8).scaling == pytest.approx(8.0 / 2.0)  # alpha / sqrt(r)
    _edit(path, target_modules=r".*\.(q|k|v|o|gate|up|down)_proj")  # a regex, as PEFT allows
    assert load_adapter(path, llama_cfg, 8).weights.keys() == adapter.weights.keys()


@pytest.mark.parametrize("edit, field", [
    (dict(modules_to_save=["lm_head"]), "modules_to_save"),
    (dict(use_dora=True), "use_dora"),
    (dict(bias="all"), "bias"),
    (dict(rank_pattern={"q_proj": 8}), "rank_pattern"),
    (dict(target_modules=["q_proj", "embed_tokens"]), "target_modules"),
    (dict(target_modules=["q_proj"]), "target_modules"),  # the file holds the other six too
    (dict(r=16), "r"),  # over --max-lora-rank 8
    (dict(r=2), "r"),  # the tensors are rank 4
    (dict(lora_alpha="x"), "lora_alpha"),
    (dict(peft_type="IA3"), "peft_type"),
])
def test_unsupported_adapters_are_refused_naming_the_field(tmp_path, llama_cfg, edit, field):
    path = save_adapter(random_adapter(llama_cfg, 4, 0), llama_cfg, tmp_path / "a")
    with pytest.raises(LoRAAdapterError) as e:
        load_adapter(_edit(path, **edit), llama_cfg, max_rank=8)
    assert e.value.param == field, str(e.value)


def test_missing_files_and_moe_experts_are_refused(tmp_path, llama_cfg):
    with pytest.raises(LoRAAdapterError, match="does not exist") as e:
        load_adapter(tmp_path / "nowhere", llama_cfg, 8)
    assert e.value.param == "lora_path"
    path = save_adapter(random_adapter(llama_cfg, 4, 0), llama_cfg, tmp_path / "a")
    (path / "adapter_model.safetensors").unlink()
    with pytest.raises(LoRAAdapterError, match="adapter_model.safetensors") as e:
        load_adapter(path, llama_cfg, 8)
    assert e.value.param == "lora_path"
    moe_cfg = load_config(FIXTURES / "mixtral")
    # The same adapter file on a MoE model: its MLP projections are experts there.
    llama_like = random_adapter(llama_cfg, 4, 0)
    moe_adapter = dict(llama_like.weights)
    path = save_adapter(type(llama_like)("m", 4, 1.0, {k: v for k, v in moe_adapter.items()}),
                        llama_cfg, tmp_path / "m")
    if moe_cfg.hidden_size == llama_cfg.hidden_size:
        with pytest.raises(LoRAAdapterError, match="MoE experts") as e:
            load_adapter(path, moe_cfg, 8)
        assert e.value.param == "target_modules"


# ---- the delta and the stacks -------------------------------------------------------------
def test_mixed_batch_delta_equals_per_row_reference_on_ragged_slots():
    delta, reference = jax.jit(lora_delta), jax.jit(lora_delta_gather)
    rng = np.random.default_rng(0)
    n, fan_in, rank, fan_out = 4, 24, 8, 40
    a = jnp.asarray(rng.normal(size=(n + 1, fan_in, rank)), jnp.float32).at[0].set(0)
    b = jnp.asarray(rng.normal(size=(n + 1, rank, fan_out)), jnp.float32).at[0].set(0)
    for t in (5, 33):
        slot = jnp.asarray(rng.integers(0, n + 1, t), jnp.int32)
        x = jnp.asarray(rng.normal(size=(t, fan_in)), jnp.float32)
        got = np.asarray(delta(x, a, b, slot))
        np.testing.assert_allclose(got, reference(x, a, b, slot), rtol=1e-5, atol=1e-5)
        assert not got[np.asarray(slot) == 0].any()  # exactly zero


@functools.partial(jax.jit, static_argnums=0)
def _logits(cfg, params, tokens, slots):
    """The dense (cache-free) forward: float32 logits [B, L, V] (one compilation per fixture:
    every call passes stacks, slot 0 running the weights as they are)."""
    variables = {"params": {k: v for k, v in params.items() if k != LORA}, "lora": params[LORA]}
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    logits, _ = Transformer(cfg, REFERENCE_KERNELS, jnp.float32).apply(
        variables, tokens, positions, lora_slot=slots)
    return logits


@pytest.mark.parametrize("family", FAMILIES)
def test_adapter_equals_base_with_the_adapter_merged(family):
    """Row 0 runs the adapter (slot 2 of 2), row 1 the base model (slot 0): row 0's float32
    logits and greedy tokens equal the merged model's, row 1's the base model's bit for bit. Odd
    families run with q/k/v and gate/up fused (one shrink feeds the fused matrix)."""
    cfg = load_config(FIXTURES / family)
    params = load_params(FIXTURES / family, cfg, jnp.float32, progress=False)
    adapter = random_adapter(cfg, 4, seed=FAMILIES.index(family), scale=0.2)
    fuse = fuse_projections if FAMILIES.index(family) % 2 else (lambda p: p)
    serving = fuse(params)
    stacks = empty_stacks(cfg, serving, 2, 8, jnp.float32)
    stacks = jax.tree.map(lambda s, v: np.concatenate([np.asarray(s)[:2], v[None]]), stacks,
                          slot_arrays(adapter, cfg, stacks))  # (write_slot: test_lora_engine)
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 12)), jnp.int32)
    slots = jnp.asarray([[2] * 12, [0] * 12], jnp.int32)
    got = np.asarray(_logits(cfg, {**serving, LORA: stacks}, tokens, slots))
    want = np.asarray(_logits(cfg, {**fuse(merged(params, adapter)), LORA: stacks}, tokens,
                              jnp.zeros_like(slots)))
    base = np.asarray(_logits(cfg, {**serving, LORA: stacks}, tokens, jnp.zeros_like(slots)))
    np.testing.assert_allclose(got[0], want[0], rtol=1e-4, atol=1e-4)
    assert (got[0].argmax(-1) == want[0].argmax(-1)).all()
    assert not np.allclose(got[0], base[0], atol=1e-2)  # the adapter does change the logits
    np.testing.assert_array_equal(got[1], base[1])


# ---- slots and the prefix cache -----------------------------------------------------------
def _seq(lora_id):
    return types.SimpleNamespace(request=types.SimpleNamespace(lora_id=lora_id), lora_slot=0)


def test_slots_are_an_lru_that_never_evicts_a_slot_in_use(tmp_path, llama_cfg):
    writes = []
    slots = LoRASlots(llama_cfg, max_loras=2, max_rank=8, max_cpu_loras=2,
                      write=lambda slot, adapter: writes.append((slot, adapter.name)))
    for i in (1, 2, 3):
        path = save_adapter(random_adapter(llama_cfg, 4, i), llama_cfg, tmp_path / f"a{i}")
        slots.register(LoRARequest(f"a{i}", i, str(path)))
    s1, s2, s3 = _seq(1), _seq(2), _seq(3)
    assert slots.acquire(s1) and slots.acquire(s2) and (s1.lora_slot, s2.lora_slot) == (1, 2)
    assert not slots.acquire(s3)  # both slots run rows: a3 waits
    slots.release(s2)
    assert slots.acquire(s3) and s3.lora_slot == 2 and writes[-1] == (2, "a3")
    again = _seq(1)
    assert slots.acquire(again) and again.lora_slot == 1 and len(writes) == 3  # resident: no load
    base = _seq(0)
    assert slots.acquire(base) and base.lora_slot == 0
    # a1 left the host cache (2 adapters kept) and is read again from its file when needed
    slots.release(s1), slots.release(again), slots.release(s3)
    assert slots.acquire(_seq(2)) and writes[-1][1] == "a2"
    with pytest.raises(Exception, match="already"):
        slots.register(LoRARequest("a1", 7, str(tmp_path / "a1")))


def test_prefix_cache_namespaces_never_share_blocks():
    kv = KVCacheManager(16, block_size=4)
    prompt = list(range(13))
    for rid, ns in (("base", None), ("a", ("lora", 1, 0))):
        assert kv.get_computed_blocks(rid, prompt, namespace=ns) == 0
        kv.allocate_slots(rid, len(prompt))
        kv.cache_blocks(rid, prompt, len(prompt))
    assert kv.get_computed_blocks("a2", prompt, namespace=("lora", 1, 0)) == 12
    assert kv.get_computed_blocks("b", prompt, namespace=("lora", 2, 0)) == 0
    assert kv.get_computed_blocks("a-v1", prompt, namespace=("lora", 1, 1)) == 0  # updated
    assert kv.get_computed_blocks("base2", prompt) == 12
