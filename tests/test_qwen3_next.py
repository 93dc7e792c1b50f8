"""Qwen3-Next (Qwen3NextForCausalLM: Gated DeltaNet beside gated attention, qwen3_next.py,
gated_deltanet.py) through the engine against HF transformers' goldens
(tests/fixtures/make_golden_hybrid.py): greedy tokens under 3-token prefill chunks and
preemption by recompute in a tiny pool, a fork (n = 2), a ragged batch of three prompts scored
beside a decoding row (mixed prefill + decode steps), aborts that leave no block held; the
state's place in the KV groups and the memory figures; the config's parsing; the table's Pallas
kernels in the layer."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.core.kv_cache import FixedStateSpec, FullAttentionSpec, KVCacheGroups
from jaxinfer.engine.args import EngineArgs
from jaxinfer.engine.llm_engine import LLMEngine
from jaxinfer.errors import ConfigError
from jaxinfer.model.config import config_from_dict, load_config
from jaxinfer.model.weights import load_params
from hybrid_support import (assert_engine_matches_goldens, assert_same_tree, hybrid_args,
                            reference_param_shapes)

MODEL = Path(__file__).parent / "fixtures" / "models" / "qwen3_next"
BLOCK = 4  # a layer's state spans three attention pages


def _args(num_blocks: int, **overrides) -> EngineArgs:
    return hybrid_args(MODEL, num_blocks, **{"block_size": BLOCK, **overrides})


@pytest.mark.parametrize("caching", [False, True], ids=["plain", "prefix_caching"])
def test_engine_matches_transformers(caching):
    """The golden walk, with prefix caching off and on (the state snapshots:
    test_hybrid_prefix_cache.py); one pool, so the two engines share their compiled steps."""
    cfg = load_config(MODEL)
    params = load_params(MODEL, cfg, jnp.float32, progress=False)
    # Per sequence of 21 tokens: 6 blocks of the attention group and, per state group (three:
    # one Gated DeltaNet layer each), the 3 pages of its state. 5 such sequences need 75; 20
    # preempt. (The 29-token scored prompt crosses a 16-token step boundary.)
    engine = LLMEngine(cfg, params, None, _args(20, enable_prefix_caching=caching), num_blocks=20)
    assert_engine_matches_goldens(engine, np.load(MODEL / "golden.npz"))


def test_state_in_the_attention_page():
    cfg = load_config(MODEL)
    dims = cfg.family_options.gdn
    # (W - 1) x conv channels (q, k: 2 x 16 each; v: 4 x 16) + Hv x K x V, float32.
    assert dims.state_bytes == 4 * (3 * 128 + 4 * 16 * 16)
    page = FullAttentionSpec(2, 32)
    state = FixedStateSpec(dims.state_bytes, page_of=page)
    assert cfg.layer_kv_specs() == (state, page, state, state)
    assert state.state_pages(BLOCK, jnp.float32) == 3 and state.state_pages(16, jnp.float32) == 1
    assert state.state_pages(BLOCK, jnp.bfloat16) == 9
    groups = KVCacheGroups.for_model(cfg)
    assert groups.specs == (page, state, state, state) and groups.num_slots == 1
    assert groups.tokens_held(32, BLOCK, jnp.float32) == (8 + 3 * 3) * BLOCK


def test_memory_counts_the_state():
    from jaxinfer.cli.memory import ACCELERATORS, _shape_from_args, memory_report
    args = argparse.Namespace(model=str(MODEL), layers=None, kv_heads=None, head_dim=None,
                              heads=None, kv_lora_rank=None, quantization=None, dtype=None,
                              weight_bytes=None, qk_rope_dim=64)
    shape = _shape_from_args(args)
    cfg = load_config(MODEL)
    params = load_params(MODEL, cfg, jnp.float32, progress=False)
    assert shape.weight_bytes == 4 * sum(x.size for x in jax.tree.leaves(params))
    report = memory_report(shape, kv_dtype="auto", seq_len=32, batch=1, block_size=BLOCK,
                           accelerator=ACCELERATORS["l4"], gpu_memory_utilization=0.9)
    page = 2 * 2 * 32 * 4  # K and V of 2 heads x 32, float32, per token
    assert report["kv_bytes_per_token"] == page  # the one attention layer
    assert report["kv_bytes_per_sequence"] == 32 * page + 3 * 3 * BLOCK * page


def test_quantized_on_load():
    """--quantization int8 on the float checkpoint: the shared expert (read by the family's
    tensor_sources) becomes QuantLinear weights [out, in] that dequantize to the checkpoint's,
    and the model runs."""
    from jaxinfer.model.quant import ops
    from jaxinfer.model.transformer import train_forward
    cfg = dataclasses.replace(load_config(MODEL), quantization="int8")
    params = load_params(MODEL, cfg, jnp.float32, progress=False)
    dense = load_params(MODEL, load_config(MODEL), jnp.float32, progress=False)
    for proj in ("gate_proj", "up_proj", "down_proj"):
        q = params["layers_3"]["moe"]["shared_expert"][proj]
        want = np.asarray(dense["layers_3"]["moe"]["shared_expert"][proj]["kernel"]).T
        got = np.asarray(ops.dequantize(q["weight"], q["weight_scale"], -1))
        assert np.abs(got - want).max() <= np.abs(want).max() / 127, proj
    golden = np.load(MODEL / "golden.npz")
    logits = jax.jit(train_forward, static_argnums=1)(params, cfg,
                                                      jnp.asarray(golden["prompt_1"])[None])[0]
    assert np.isfinite(np.asarray(logits)).all()


RAW = {"architectures": ["Qwen3NextForCausalLM"], "vocab_size": 64, "hidden_size": 64,
       "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
       "num_hidden_layers": 4, "intermediate_size": 64, "linear_num_key_heads": 2,
       "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
       "num_experts": 0, "torch_dtype": "float32"}


def test_config_parsing():
    cfg = config_from_dict(RAW)
    # HF's defaults: one full-attention layer every 4, a quarter of each head rotated.
    assert [s is None for s in cfg.layer_states] == [False, False, False, True]
    assert cfg.rotary_dim == 8 and cfg.norm_offset and cfg.qk_norm and not cfg.is_moe
    moe = config_from_dict({**RAW, "num_local_experts": 8, "num_experts": None,
                            "num_experts_per_tok": 2, "mlp_only_layers": [0]})
    assert moe.num_experts == 8 and moe.moe_layers == (False, True, True, True)
    assert config_from_dict({**RAW, "full_attention_interval": 2}).layer_states[1] is None
    for bad, match in (({"layer_types": ["linear_attention"] * 3 + ["mamba"]}, "layer_types"),
                       ({"layer_types": ["linear_attention"] * 4}, "no full_attention"),
                       ({"linear_num_value_heads": 3}, "linear_num_key_heads"),
                       ({"hidden_act": "gelu"}, "hidden_act")):
        with pytest.raises(ConfigError, match=match):
            config_from_dict({**RAW, **bad})


# Qwen3-Next-80B-A3B-Instruct's config.json: the values the shapes read.
QWEN3_NEXT_80B = {
    "architectures": ["Qwen3NextForCausalLM"], "vocab_size": 151936, "hidden_size": 2048,
    "intermediate_size": 5120, "num_hidden_layers": 48, "num_attention_heads": 16,
    "num_key_value_heads": 2, "head_dim": 256, "linear_num_key_heads": 16,
    "linear_num_value_heads": 32, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4, "full_attention_interval": 4, "num_experts": 512,
    "num_experts_per_tok": 10, "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "norm_topk_prob": True, "max_position_embeddings": 262144, "rope_theta": 10000000,
    "partial_rotary_factor": 0.25, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16"}


def test_qwen3_next_80b_starts_at_the_default_block_size(tmp_path, capsys):
    """Qwen3-Next-80B's 2.1 MB Gated DeltaNet state spans 101 attention pages of 16 bfloat16
    tokens: its shapes (no weights) pass the start-up refusals at the default flags (prefix caching
    on), and `jaxinfer memory` counts each sequence's state pages, in its figures and in the
    engine's pre-load check."""
    from jaxinfer.cli import memory as cli_memory
    from jaxinfer.engine.fixed_state import refuse_what_fixed_state_lacks
    cfg = config_from_dict(QWEN3_NEXT_80B)
    state = cfg.layer_kv_specs()[0]
    assert state.state_bytes == 4 * (3 * 8192 + 32 * 128 * 128)
    assert state.state_pages(16, jnp.bfloat16) == 101
    args = EngineArgs(model=str(tmp_path))
    assert args.block_size == 16 and args.enable_prefix_caching
    groups = KVCacheGroups.for_model(cfg)
    refuse_what_fixed_state_lacks(groups, args.create_engine_config())  # nothing refused
    # 12 attention layers set num_slots: the 36 Gated DeltaNet layers make 3 state groups.
    assert groups.num_slots == 12 and groups.state_pages(16, jnp.bfloat16) == (None, 101, 101, 101)
    assert groups.blocks_for_sequence(4096, 2048, 16, jnp.bfloat16) == 256 + 3 * 101

    (tmp_path / "config.json").write_text(json.dumps(QWEN3_NEXT_80B))
    parser = argparse.ArgumentParser()
    cli_memory.add_parser(parser.add_subparsers())
    # (fp8 weights, the target: 160 GB of bf16 weights would not fit an H200)
    cli = parser.parse_args(["memory", "--model", str(tmp_path), "--accelerator", "h200",
                             "--seq-len", "4096", "--batch", "8", "--quantization", "fp8",
                             "--json"])
    assert cli.func(cli) == 0
    report = json.loads(capsys.readouterr().out)
    token = 12 * 2 * 2 * 256 * 2  # K and V of 2 heads x 256 in 12 layers, bfloat16
    assert report["kv_bytes_per_token"] == token
    assert report["kv_bytes_per_sequence"] == (4096 + 3 * 101 * 16) * token
    assert report["engine_plan"]["sequence_kv_bytes"] == (256 + 3 * 101) * 16 * token
    assert report["engine_plan"]["fitting_model_len"] == 4096


def test_param_shapes_are_traced_once_per_config_and_dtype():
    """`jaxinfer memory` and the planners ask for a model's param shapes several times (the 80B
    model's trace above: seconds each): the second ask of a (config, dtype) is the first's
    answer, in containers of its own, the tree of an init through the reference kernels (the
    trace's Gated DeltaNet scans are zeros of their shapes)."""
    from jaxinfer.model import transformer
    cfg = config_from_dict({**RAW, "vocab_size": 96})  # a config no other test traces
    traced = transformer._traced_param_shapes
    misses = traced.cache_info().misses
    first = transformer.param_shapes(cfg, jnp.float32)
    first["embed"]["embedding"] = None  # the caller's own dict
    second = transformer.param_shapes(cfg, "float32")
    assert traced.cache_info().misses == misses + 1
    assert second["embed"]["embedding"] == jax.ShapeDtypeStruct((96, 64), jnp.float32)
    assert_same_tree(second, reference_param_shapes(cfg, jnp.float32))
    fp8 = dataclasses.replace(cfg, quantization="fp8")
    assert_same_tree(transformer.param_shapes(fp8), reference_param_shapes(fp8, jnp.bfloat16))


def test_pallas_kernels_through_the_layer():
    """The table's Pallas kernels (interpreted) in the Gated DeltaNet layers give the
    references' logits: a ragged prefill of 5, 20 and 1 tokens, then a pure-decode step (the
    one-token kernels), on shapes the Triton blocks take (C = 128 conv channels, K = 16,
    V = 32; two value heads keep the interpreted grids small)."""
    from jaxinfer.model.kernel_table import REFERENCE_KERNELS
    from jaxinfer.model.ssm_kernels import GatedDeltaNetKernels
    from jaxinfer.model.transformer import forward, init_params
    from jaxinfer.worker.kv.device_cache import allocate_kv_cache
    from pallas_kernels.attention.metadata import AttentionMetadata

    cfg = config_from_dict({**RAW, "num_hidden_layers": 2, "linear_num_value_heads": 2,
                            "linear_value_head_dim": 32,
                            "layer_types": ["linear_attention", "full_attention"]})
    params = init_params(cfg, jax.random.key(0), jnp.float32, std=0.2)
    groups = KVCacheGroups.for_model(cfg)
    lengths = np.array([5, 20, 1])
    # Sequence s of group g on blocks 2 (g * 3 + s) and the next.
    tables = np.arange(2 * 3 * groups.num_groups, dtype=np.int32).reshape(groups.num_groups, 3, 2)

    def metadata(first, count, **kw):
        pos = np.concatenate([np.arange(f, f + c) for f, c in zip(first, count)])
        seq = np.repeat(np.arange(3), count)
        slots = tables[:, seq, pos // 16] * 16 + pos % 16
        starts = np.concatenate([[0], np.cumsum(count)]).astype(np.int32)
        return pos, AttentionMetadata(jnp.asarray(slots), jnp.asarray(starts),
                                      jnp.asarray(first + count, jnp.int32), jnp.asarray(tables),
                                      kv_layout=groups.kv_layout, **kw)

    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, lengths.sum()), jnp.int32)
    prefill_pos, prefill = metadata(np.zeros(3, int), lengths)
    decode_pos, decode = metadata(lengths, np.ones(3, int), num_decodes=3)
    pallas = dataclasses.replace(REFERENCE_KERNELS,
                                 gdn=GatedDeltaNetKernels(pallas=True, interpret=True))
    step = jax.jit(forward, static_argnames=("cfg", "kernels"))
    logits = {}
    for name, kernels in (("reference", REFERENCE_KERNELS), ("pallas", pallas)):
        cache = allocate_kv_cache(cfg, 12, 16, jnp.float32, num_slots=groups.num_slots)
        first, cache = step(params, cfg, tokens, jnp.asarray(prefill_pos), cache, prefill,
                            kernels=kernels)
        second, _ = step(params, cfg, jnp.asarray([1, 2, 3], jnp.int32),
                         jnp.asarray(decode_pos), cache, decode, kernels=kernels)
        logits[name] = (first, second)
    for ref, got in zip(logits["reference"], logits["pallas"]):
        np.testing.assert_allclose(got, ref, atol=1e-4, rtol=0)
