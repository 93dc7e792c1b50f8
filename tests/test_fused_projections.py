"""Fused q/k/v and gate/up projections (jaxinfer/model/fused_projections.py): the same model as the
separate ones, for every family's layout (biases, q/k norm, MoE layers, quantized linears), and an
engine on fused weights decodes alike (a lone sequence in its own bucket) and takes separate ones
in `update_weights`; an engine on fused FP8 weights decodes as their dequantized twin."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.engine.args import EngineArgs
from jaxinfer.engine.llm_engine import LLMEngine
from jaxinfer.model.config import load_config
from jaxinfer.model.fused_projections import fuse_projections, is_fused
from jaxinfer.model.transformer import train_forward
from jaxinfer.model.weights import load_params
from jaxinfer.sampling_params import SamplingParams
from test_engine_support import (BLOCK, MAX_LEN, NUM_BLOCKS, prompt_ids, run_all, tiny_model,
                                 tiny_tokenizer)

FIXTURES = Path(__file__).parent / "fixtures" / "models"


@pytest.mark.parametrize("family, quantization", [
    ("llama", None), ("qwen2", None), ("qwen3", None), ("qwen3_moe", None), ("llama", "fp8"),
    ("gpt_oss", None), ("gpt_oss", "fp8")])
def test_fused_weights_give_the_separate_projections_logits(family, quantization):
    """Biased experts (gpt-oss) also get their gate/up stacks, scales and biases fused."""
    cfg = dataclasses.replace(load_config(FIXTURES / family), quantization=quantization)
    params = load_params(FIXTURES / family, cfg, jnp.float32, progress=False)
    fused = fuse_projections(params)
    assert is_fused(fused) and not is_fused(params)
    attn = params["layers_0"]["attn"]
    for leaf, value in fused["layers_0"]["attn"]["qkv_proj"].items():
        axis = 1 if leaf == "kernel" else 0
        parts = [np.asarray(attn[p][leaf]) for p in ("q_proj", "k_proj", "v_proj")]
        np.testing.assert_array_equal(np.asarray(value), np.concatenate(parts, axis=axis))
    assert ("gate_up_proj" in fused["layers_0"].get("mlp", {})) == ("mlp" in params["layers_0"])
    moe = fused["layers_0"].get("moe", {})
    assert ("w_gate_up" in moe) == (family == "gpt_oss")
    if family == "gpt_oss":
        separate = params["layers_0"]["moe"]
        names = [("w_gate_up", "w_gate", "w_up"), ("gate_up_bias", "gate_bias", "up_bias")]
        if quantization:
            names.append(("w_gate_up_scale", "w_gate_scale", "w_up_scale"))
        for name, gate, up in names:
            assert gate not in moe and up not in moe
            np.testing.assert_array_equal(np.asarray(moe[name]), np.concatenate(
                [np.asarray(separate[gate]), np.asarray(separate[up])], axis=-1))
    assert jax.tree.structure(fuse_projections(fused)) == jax.tree.structure(fused)
    tokens = jnp.asarray(np.random.default_rng(0).integers(1, cfg.vocab_size, (2, 11)), jnp.int32)
    np.testing.assert_allclose(np.asarray(train_forward(fused, cfg, tokens)),
                               np.asarray(train_forward(params, cfg, tokens)), rtol=1e-5, atol=1e-5)


def test_an_engine_on_fused_weights_decodes_alike_and_takes_separate_updates():
    cfg, params = tiny_model()
    args = EngineArgs(model="tiny", max_model_len=MAX_LEN, block_size=BLOCK, num_blocks=NUM_BLOCKS,
                      max_num_seqs=8, max_num_batched_tokens=32, long_prefill_chunk=32,
                      compilation_cache_dir=None, warmup=False, dtype="float32",
                      background_compile=False)
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = [prompt_ids(60 + i, 9) for i in range(3)]

    def tokens(engine, prompts=prompts):
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, greedy)
        return {rid: out[0][0] for rid, out in run_all(engine).items()}

    separate = LLMEngine(cfg, params, tiny_tokenizer(), args, num_blocks=NUM_BLOCKS)
    fused = LLMEngine(cfg, fuse_projections(params), tiny_tokenizer(), args,
                      num_blocks=NUM_BLOCKS)
    # The fused engine decodes a lone sequence in its own bucket (Buckets.lone_sequence).
    assert fused.runner.buckets.decode_buckets[:2] == (1, 8)
    assert separate.runner.buckets.decode_buckets[0] == 8
    assert tokens(fused) == tokens(separate)
    assert tokens(fused, prompts[:1]) == tokens(separate, prompts[:1])
    update = jax.tree.map(lambda a: np.asarray(a) * 0.5, params)  # separate, on the host
    fused.update_weights(update)
    separate.update_weights(update)
    assert is_fused(fused.runner.params)
    assert tokens(fused) == tokens(separate)


def test_an_fp8_engine_on_fused_weights_decodes_as_its_dequantized_twin():
    """FP8 weights quantized as `--quantization fp8` loads them, fused as the engine serves them on
    one GPU (fuse_for_serving): q/k/v and gate/up stay e4m3 with their channel scales concatenated,
    the engine takes the lone-sequence bucket, and at batch-1 sizes (weight-only arithmetic, what
    the GPU runs below FP8_GEMM_MIN_ROWS) it decodes the tokens of the same weights dequantized."""
    from jaxinfer.model.quant import loading, ops
    from jaxinfer.model.transformer import param_shapes
    from jaxinfer.model.weights import _flat_paths, _set

    cfg, params = tiny_model()
    qcfg = dataclasses.replace(cfg, quantization="fp8")
    flat = {k: jnp.array(v) for k, v in _flat_paths(params).items()}  # copies: the loader deletes
    quantized: dict = {}
    for key, leaf in loading.quantize_unquantized(
            flat, _flat_paths(param_shapes(qcfg, jnp.float32)), "fp8", {}).items():
        _set(quantized, key, leaf)
    fp8 = fuse_projections(quantized)
    qkv = fp8["layers_0"]["attn"]["qkv_proj"]
    assert qkv["weight"].dtype == jnp.float8_e4m3fn and qkv["weight_scale"].shape == (
        (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim,)

    def dequantized(tree):
        if isinstance(tree, dict) and "weight_scale" in tree:
            return {"kernel": ops.dequantize(tree["weight"], tree["weight_scale"]).T,
                    **{k: v for k, v in tree.items() if k not in ("weight", "weight_scale")}}
        return {k: dequantized(v) for k, v in tree.items()} if isinstance(tree, dict) else tree

    args = EngineArgs(model="tiny", max_model_len=MAX_LEN, block_size=BLOCK, num_blocks=NUM_BLOCKS,
                      max_num_seqs=8, max_num_batched_tokens=32, long_prefill_chunk=32,
                      compilation_cache_dir=None, warmup=False, dtype="float32",
                      background_compile=False, quant_impl="dequant")
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    engines = {name: LLMEngine(c, p, tiny_tokenizer(), args, num_blocks=NUM_BLOCKS)
               for name, c, p in (("fp8", qcfg, fp8), ("twin", cfg, dequantized(fp8)))}
    assert engines["fp8"].runner.buckets.decode_buckets[:2] == (1, 8)
    for prompts in ([prompt_ids(70 + i, 9) for i in range(3)], [prompt_ids(80, 11)]):
        tokens = {}
        for name, engine in engines.items():
            for i, p in enumerate(prompts):
                engine.add_request(f"r{i}", p, greedy)
            tokens[name] = {rid: out[0][0] for rid, out in run_all(engine).items()}
        assert tokens["fp8"] == tokens["twin"]
