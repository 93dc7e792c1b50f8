"""`jaxinfer bench throughput --suite hybrid`: the 128k-sequence counts from the engine's planners
for a device of a given size, the decode roofline's bytes, and the whole suite at a CPU's size
(driver, section processes, engines, record)."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import pytest

from jaxinfer.bench import cli, presets
from jaxinfer.bench.suites import hybrid
from jaxinfer.bench.suites.hybrid_plan import max_concurrent, plan_section
from jaxinfer.model.config import config_from_dict
from jaxinfer.model.transformer import param_shapes

pytestmark = pytest.mark.slow  # minutes on the CI machine: xdist starts its group first (conftest.py)

ATTENTION_BLOCKS_128K = 131072 // 16


def test_plan_counts_128k_sequences_on_a_141_gb_device(monkeypatch):
    """A 128k sequence holds 8192 attention blocks, plus 101 pages of each of Qwen3-Next's 3
    Gated DeltaNet state groups or 74 of each of Granite's 9 Mamba-2 ones; the pool is the
    planner's: 0.9 x device - weights - activation floor - compile scratch, in whole blocks."""
    from jaxinfer.engine.args import EngineArgs
    from jaxinfer.engine.memory_preflight import preflight
    monkeypatch.setenv("JAXINFER_DEVICE_MEMORY", "141GB")
    out = plan_section(hybrid.PLAN_MODELS)
    assert out["qwen3_next_80b_fp8_plan_sequence_blocks"] == ATTENTION_BLOCKS_128K + 3 * 101
    assert out["granite4h_tiny_plan_sequence_blocks"] == ATTENTION_BLOCKS_128K + 9 * 74
    assert out["llama8b_plan_sequence_blocks"] == ATTENTION_BLOCKS_128K
    for name in hybrid.PLAN_MODELS:
        assert out[f"{name}_max_concurrent_128k"] == (out[f"{name}_plan_pool_blocks"]
                                                      // out[f"{name}_plan_sequence_blocks"])
        assert out[f"{name}_plan_device_gib"] == pytest.approx(141e9 / 2 ** 30, abs=1e-3)
    # Llama-3-8B by hand: a block is 32 layers x 16 tokens x K and V of 8 heads x 128, bf16.
    cfg = config_from_dict(presets.LLAMA3_8B)
    figures = preflight(cfg, EngineArgs(model="x", max_model_len=131072),
                        param_shapes(cfg), None, jnp.bfloat16, device_bytes=141 * 10 ** 9)
    room = int(0.9 * 141e9) - figures.weight_bytes - figures.activation_floor_bytes \
        - figures.compile_scratch_bytes
    assert out["llama8b_plan_pool_blocks"] == room // (32 * 16 * 2 * 8 * 128 * 2)
    # Few layers keep K and V per token: Granite holds many times Llama's sequences.
    assert out["granite4h_tiny_max_concurrent_128k"] > 10 * out["llama8b_max_concurrent_128k"] > 0
    assert out["qwen3_next_80b_fp8_max_concurrent_128k"] > out["llama8b_max_concurrent_128k"]


def test_plan_on_an_80_gb_device_refuses_qwen3_next_by_the_planners_reason(monkeypatch):
    monkeypatch.setenv("JAXINFER_DEVICE_MEMORY", "80GB")
    config, quantization = hybrid.PLAN_MODELS["qwen3_next_80b_fp8"]
    out = plan_section({"qwen3_next_80b_fp8": (config, quantization)})
    assert out["qwen3_next_80b_fp8_max_concurrent_128k"] == 0
    assert "no room for the KV cache" in out["qwen3_next_80b_fp8_plan_refused"]
    assert max_concurrent(presets.GRANITE_4_H_TINY)["max_concurrent"] > 0


@pytest.mark.parametrize("name", list(hybrid.ENGINE_MODELS))
def test_decode_read_bytes_count_the_active_weights_kv_and_state(name):
    """Weights: the param tree's bytes less the routed experts a token skips (and the input
    embedding table of an untied head); KV over the context in the attention layers; one state
    per state-space layer."""
    config, quantization = hybrid.ENGINE_MODELS[name]
    cfg = config_from_dict({**config, **hybrid.TINY_OVERRIDES[name]})
    params = param_shapes(cfg)
    leaves = jax.tree_util.tree_leaves(params)
    total = sum(x.size * x.dtype.itemsize for x in leaves)
    skipped = sum(cfg.layer_is_moe(i) for i in range(cfg.num_layers)) * (
        cfg.num_experts - cfg.num_experts_per_tok) * 3 * cfg.hidden_size \
        * cfg.moe_intermediate_size * 2
    embedding = 0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size * 2
    read = hybrid.decode_read_bytes(cfg, params, 100)
    assert read["weights"] == pytest.approx(total - skipped - embedding)
    states = [s for s in cfg.layer_states if s]
    attention = cfg.num_layers - len(states)
    assert read["kv"] == attention * 2 * cfg.num_kv_heads * cfg.head_dim * 2 * 100
    assert read["state"] == sum(states) > 0
    # FP8: each routed expert's share of its stack, values and scales, as stored.
    fp8 = hybrid.decode_read_bytes(dataclasses.replace(cfg, quantization="fp8"),
                                   param_shapes(dataclasses.replace(cfg, quantization="fp8")), 100)
    assert fp8["weights"] < 0.7 * read["weights"] and fp8["kv"] == read["kv"]


def test_suite_at_a_cpus_size_writes_every_sections_keys(tmp_path, monkeypatch):
    """The path a GPU run takes, at tiny shapes: the driver, each section in its process, the
    engine on the Mamba-2 hybrid, the record."""
    monkeypatch.setenv("BENCH_TINY_SHAPES", "1")
    monkeypatch.setattr(hybrid, "TINY", True)
    # One engine section: both run the same code (Qwen3-Next's FP8 quantize-on-load of dummy
    # weights has its own test in test_weights_config.py); the second engine cost CI a minute.
    assert cli.main(["throughput", "--suite", "hybrid", "--save", str(tmp_path), "--name", "hy",
                     "--", "--sections", "plan,ssm,granite4h_tiny", "--device-memory", "141GB",
                     "--deadline-s", "2400"]) == 0
    record = json.loads((tmp_path / "hy.json").read_text())
    m = record["metrics"]
    assert not [k for k in m if k.endswith(("_error", "_skipped"))], m
    for name in ["granite4h_tiny"]:
        assert 0 < m[f"{name}_bs1_roofline_ms"] and 0 < m[f"{name}_bs1_tpot_ms"]
        assert m[f"{name}_c64_out_tok_s"] > 0 and m[f"{name}_c64_prefix_hit_rate"] == 0
        assert m[f"{name}_bs1_state_read_gb"] >= 0 and m[f"{name}_engine_pool_blocks"] > 0
    for name in hybrid.PLAN_MODELS:
        assert m[f"{name}_max_concurrent_128k"] > 0
    for kind in ("gdn", "ssd"):
        # (interpreted kernels: a fraction that rounds to 0 on a CPU)
        assert m[f"{kind}_prefill_frac_of_matmul"] >= 0 and m[f"{kind}_prefill_rel_err"] < 1e-2
    assert record["config"]["workload"] == {"prompt": 24, "out": 8, "seqs": 4, "step": 32}
