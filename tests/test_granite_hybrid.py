"""Granite 4.0-H (GraniteMoeHybridForCausalLM, a Mamba-2 hybrid: granitemoehybrid.py, mamba2.py)
through the engine against HF transformers' goldens (tests/fixtures/make_golden_hybrid.py):
greedy tokens under 3-token prefill chunks and preemption by recompute in a tiny pool, a fork
(n = 2) whose state pages are copied on write, a ragged batch of three prompts scored beside
decoding rows (mixed prefill + decode steps), aborts that leave no block held; the state's
place in the KV groups and the memory figures; what the engine refuses for such a model."""

from __future__ import annotations

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
from jaxinfer.model.transformer import train_forward
from jaxinfer.model.weights import load_params
from jaxinfer.sampling_params import SamplingParams
from hybrid_support import (GREEDY, assert_engine_matches_goldens, assert_same_tree, hybrid_args,
                            reference_param_shapes)
from test_engine_support import assert_all_free, run_all

FIXTURES = Path(__file__).parent / "fixtures" / "models"
MOE, DENSE = FIXTURES / "granitemoehybrid", FIXTURES / "granitemoehybrid_dense"
BLOCK = 4  # a layer's state spans two attention pages


def _load(model_dir: Path):
    cfg = load_config(model_dir)
    return cfg, load_params(model_dir, cfg, jnp.float32, progress=False)


def _args(model_dir: Path, num_blocks: int, **overrides) -> EngineArgs:
    return hybrid_args(model_dir, num_blocks, **{"block_size": BLOCK, **overrides})


@pytest.mark.parametrize("caching", [False, True], ids=["plain", "prefix_caching"])
def test_engine_matches_transformers(caching):
    """The golden walk, with prefix caching off and on (the state snapshots:
    test_hybrid_prefix_cache.py); one pool, so the two engines share their compiled steps."""
    cfg, params = _load(MOE)
    # Per sequence of 21 tokens: 6 blocks of the attention group and, per state group (three:
    # one Mamba-2 layer each, as the one attention layer sets num_slots), the 2 pages of its
    # state. 5 such sequences need 60; 16 preempt.
    engine = LLMEngine(cfg, params, None, _args(MOE, 16, enable_prefix_caching=caching),
                       num_blocks=16)
    assert_engine_matches_goldens(engine, np.load(MOE / "golden.npz"))


def test_dense_variant_matches_transformers():
    """No experts, RoPE on the attention layer, untied head: whole-prompt logits (the dense
    path, fresh states) as HF's."""
    cfg, params = _load(DENSE)
    assert not cfg.is_moe and cfg.family_options.rope and not cfg.tie_word_embeddings
    golden = np.load(DENSE / "golden.npz")
    logits = jax.jit(train_forward, static_argnums=1)(params, cfg,
                                                      jnp.asarray(golden["prompt_2"])[None])[0]
    np.testing.assert_allclose(logits, golden["logits_2"], atol=1e-4, rtol=0)


def test_starts_at_the_default_flags():
    """From the flags' defaults (prefix caching on, block size 16), the engine keeps them and
    generates HF's greedy tokens."""
    from jaxinfer import LLM
    golden = np.load(MOE / "golden.npz")
    llm = LLM(str(MOE), dtype="float32", max_model_len=32, num_blocks=32,
              warmup=False, compilation_cache_dir=None, attention_backend="reference")
    cache = llm.engine.config.cache
    assert cache.enable_prefix_caching and cache.block_size == 16
    expected = golden["greedy_tokens"].tolist()
    out = llm.generate(golden["greedy_prompt"].tolist(), SamplingParams(
        max_tokens=len(expected), temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert out[0].outputs[0].token_ids == expected


def test_state_in_the_attention_page():
    cfg = load_config(MOE)
    dims = cfg.family_options.mamba
    # (W - 1) x conv channels + H x P x N, float32: 3 x 80 + 4 x 16 x 4 words.
    assert dims.state_bytes == 4 * (3 * 80 + 4 * 16 * 4)
    specs = cfg.layer_kv_specs()
    page = FullAttentionSpec(2, 16)
    assert specs == (FixedStateSpec(dims.state_bytes, page_of=page), page,
                     FixedStateSpec(dims.state_bytes, page_of=page),
                     FixedStateSpec(dims.state_bytes, page_of=page))
    state = specs[0]
    assert state.page_bytes(BLOCK, jnp.float32) == page.page_bytes(BLOCK, jnp.float32)
    assert state.state_pages(BLOCK, jnp.float32) == 2 and state.state_pages(8, jnp.float32) == 1
    assert state.state_pages(8, jnp.bfloat16) == 3  # half the page, 6 bytes a state word
    # fp8: a quarter of the float32 page, each 4-byte word stored in 6 bytes (state_pages.py).
    assert state.state_pages(BLOCK, jnp.float8_e4m3fn) == -(-dims.state_bytes * 6 // 4 // 256)
    groups = KVCacheGroups.for_model(cfg)
    assert groups.specs == (page, state, state, state) and groups.num_slots == 1
    assert groups.state_pages(BLOCK, jnp.float32) == (None, 2, 2, 2)
    # A sequence's KV at 32 tokens: 8 attention blocks, each state group its state's 2 pages.
    assert groups.tokens_held(32, BLOCK, jnp.float32) == (8 + 3 * 2) * BLOCK
    # The planner's block is one attention page (num_slots = 1); a state's pages are held
    # whatever the chunk (the engine's sizing floor).
    assert groups.page_bytes(BLOCK, jnp.float32) == BLOCK * 2 * 2 * 16 * 4
    assert groups.blocks_for_sequence(32, 16, BLOCK, jnp.float32) == 8 + 3 * 2
    assert groups.table_width(4, BLOCK, jnp.float32) == 2  # the pages beyond the tokens' one
    assert groups.table_width(4, BLOCK, jnp.float32, 64) == 64  # a GPU's rows: 256 bytes
    assert groups.table_width(64 * BLOCK + 1, BLOCK, jnp.float32, 64) == 128


def test_memory_counts_the_state():
    from jaxinfer.cli.memory import ACCELERATORS, _shape_from_args, memory_report
    import argparse
    args = argparse.Namespace(model=str(MOE), layers=None, kv_heads=None, head_dim=None,
                              heads=None, kv_lora_rank=None, quantization=None, dtype=None,
                              weight_bytes=None, qk_rope_dim=64)
    shape = _shape_from_args(args)
    report = memory_report(shape, kv_dtype="auto", seq_len=32, batch=1, block_size=BLOCK,
                           accelerator=ACCELERATORS["l4"], gpu_memory_utilization=0.9)
    page = 2 * 2 * 16 * 4  # K and V of 2 heads x 16, float32, per token
    assert report["kv_bytes_per_token"] == page  # the one attention layer
    # 32 tokens of the attention layer plus each Mamba-2 layer's 2 state pages (padded).
    assert report["kv_bytes_per_sequence"] == 32 * page + 3 * 2 * BLOCK * page


# The mixer shapes of test_pallas_kernels_through_the_mixer: a 5632-byte state, float32 pages
# of 256 bytes a token.
SMALL = {
    "architectures": ["GraniteMoeHybridForCausalLM"], "vocab_size": 64, "hidden_size": 64,
    "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
    "layer_types": ["mamba", "attention"], "mamba_n_heads": 4, "mamba_d_head": 16,
    "mamba_expand": 1, "mamba_n_groups": 2, "mamba_d_state": 16, "mamba_chunk_size": 16,
    "num_local_experts": 0, "shared_intermediate_size": 64, "torch_dtype": "float32"}


def test_param_shapes_are_the_reference_inits():
    """param_shapes traces the Mamba-2 scans as zeros of their shapes: the tree of an init
    through the reference kernels all the same, plain and fp8."""
    import dataclasses

    from jaxinfer.model.transformer import param_shapes
    cfg = config_from_dict({**SMALL, "num_local_experts": 4, "num_experts_per_tok": 2})
    for model in (cfg, dataclasses.replace(cfg, quantization="fp8")):
        assert_same_tree(param_shapes(model), reference_param_shapes(model, jnp.bfloat16))


def test_engine_at_the_default_block_size_with_a_state_over_two_pages():
    """At --block-size 16 a state of 5632 bytes spans two 4096-byte pages: greedy tokens
    through 3-token chunks, preemption and a fork equal the dense forward's (fresh states over
    the whole sequence each token), and every block comes back."""
    from jaxinfer.model.transformer import init_params
    cfg = config_from_dict(SMALL)
    assert cfg.layer_kv_specs()[0].state_pages(16, jnp.float32) == 2
    params = init_params(cfg, jax.random.key(1), jnp.float32, std=0.2)
    prompt = np.random.default_rng(1).integers(0, 64, 20).tolist()
    # One compiled dense forward over a buffer of the final length: the model is causal, so the
    # zeros after the tokens so far change no logit before them.
    dense = jax.jit(train_forward, static_argnums=1)
    tokens = list(prompt)
    for _ in range(8):
        buf = np.zeros((1, len(prompt) + 8), np.int32)
        buf[0, :len(tokens)] = tokens
        tokens.append(int(jnp.argmax(dense(params, cfg, jnp.asarray(buf))[0, len(tokens) - 1])))
    expected = tokens[len(prompt):]
    # A sequence of 28 tokens holds 2 attention blocks and the state's 2 pages: the five
    # (three, and a fork's two) need 20; 8 preempt.
    engine = LLMEngine(cfg, params, None, _args(MOE, 8, block_size=16), num_blocks=8)
    for i in range(3):
        engine.add_request(f"g{i}", prompt, SamplingParams(max_tokens=8, **GREEDY))
    engine.add_request("fork", prompt, SamplingParams(n=2, max_tokens=8, **GREEDY))
    results = run_all(engine)
    assert engine.scheduler.num_preemptions > 0
    for i in range(3):
        assert results[f"g{i}"][0][0] == expected, i
    assert results["fork"][0][0] == results["fork"][1][0] == expected
    assert_all_free(engine)


# Granite 4.0-H-Tiny's config.json: the values the shapes read (4 attention layers in 40).
GRANITE_4_H_TINY = {
    "architectures": ["GraniteMoeHybridForCausalLM"], "vocab_size": 100352,
    "hidden_size": 1536, "intermediate_size": 512, "num_hidden_layers": 40,
    "num_attention_heads": 12, "num_key_value_heads": 4,
    "layer_types": ["attention" if i in (5, 15, 25, 35) else "mamba" for i in range(40)],
    "mamba_n_heads": 48, "mamba_d_head": 64, "mamba_d_state": 128, "mamba_n_groups": 1,
    "mamba_expand": 2, "mamba_d_conv": 4, "mamba_chunk_size": 256, "num_local_experts": 64,
    "num_experts_per_tok": 6, "shared_intermediate_size": 1024,
    "position_embedding_type": "nope", "max_position_embeddings": 131072,
    "torch_dtype": "bfloat16"}


def test_granite_4_h_tiny_starts_at_the_default_block_size(tmp_path, capsys):
    """Granite 4.0-H-Tiny's 1.6 MB Mamba-2 state spans 74 attention pages of 16 bfloat16
    tokens: its shapes (no weights) pass the start-up refusals at the default flags (prefix caching
    on), and `jaxinfer memory` counts each sequence's state pages, in its figures and in the
    engine's pre-load check."""
    import argparse
    import json

    from jaxinfer.cli import memory as cli_memory
    from jaxinfer.engine.fixed_state import refuse_what_fixed_state_lacks
    cfg = config_from_dict(GRANITE_4_H_TINY)
    state = cfg.layer_kv_specs()[0]
    assert state.state_bytes == 4 * (3 * (3072 + 2 * 128) + 48 * 64 * 128)
    assert state.state_pages(16, jnp.bfloat16) == 74
    args = EngineArgs(model=str(tmp_path))
    assert args.block_size == 16 and args.enable_prefix_caching
    groups = KVCacheGroups.for_model(cfg)
    refuse_what_fixed_state_lacks(groups, args.create_engine_config())  # nothing refused
    # 4 attention layers set num_slots: the 36 Mamba-2 layers make 9 state groups.
    assert groups.num_slots == 4 and groups.state_pages(16, jnp.bfloat16) == (None,) + (74,) * 9
    assert groups.blocks_for_sequence(4096, 2048, 16, jnp.bfloat16) == 256 + 9 * 74

    (tmp_path / "config.json").write_text(json.dumps(GRANITE_4_H_TINY))
    parser = argparse.ArgumentParser()
    cli_memory.add_parser(parser.add_subparsers())
    cli = parser.parse_args(["memory", "--model", str(tmp_path), "--accelerator", "h200",
                             "--seq-len", "4096", "--batch", "8", "--json"])
    assert cli.func(cli) == 0
    report = json.loads(capsys.readouterr().out)
    token = 4 * 2 * 4 * 128 * 2  # K and V of 4 heads x 128 in 4 layers, bfloat16
    assert report["kv_bytes_per_token"] == token
    assert report["kv_bytes_per_sequence"] == (4096 + 9 * 74 * 16) * token
    assert report["engine_plan"]["sequence_kv_bytes"] == (256 + 9 * 74) * 16 * token
    assert report["engine_plan"]["fitting_model_len"] == 4096


@pytest.mark.parametrize("overrides, flag", [
    # (MTP runs over state-space layers now, test_hybrid_mtp.py; Granite has no MTP module)
    (dict(speculative_config='{"method": "mtp", "num_speculative_tokens": 2}'),
     "--speculative-model: no draft model was loaded"),
])
def test_refused_at_start(overrides, flag):
    cfg, params = _load(DENSE)
    with pytest.raises(ConfigError, match=flag):
        LLMEngine(cfg, params, None, _args(DENSE, 32, **overrides), num_blocks=32)


def test_bfloat16_engine_reuses_state_pages_for_attention():
    """A bfloat16 model (its cache bfloat16) in a pool small enough to preempt: attention blocks
    that held states before keep stale state elements past a sequence's last token, which the
    attention reads masked; every greedy run's first token is the float32 engine's (a raw float32
    word's low half may be a bfloat16 NaN: 0 x NaN gave token 0). (Later tokens may differ
    at near-ties of the two dtypes.)"""
    cfg = load_config(DENSE)
    prompt = np.load(DENSE / "golden.npz")["greedy_prompt"].tolist() * 3
    firsts = {}
    for dtype in ("float32", "bfloat16"):
        params = load_params(DENSE, cfg, jnp.dtype(dtype), progress=False)
        engine = LLMEngine(cfg, params, None, _args(DENSE, 40, dtype=dtype), num_blocks=40)
        for round_ in range(2):
            for i in range(4):
                engine.add_request(f"{round_}.{i}", prompt[:5 + 3 * i],
                                   SamplingParams(max_tokens=8, **GREEDY))
            firsts[dtype] = {rid: out[0][0][0] for rid, out in run_all(engine).items()}
        assert engine.scheduler.num_preemptions > 0
        assert_all_free(engine)
    assert firsts["bfloat16"] == firsts["float32"]


def test_fp8_kv_cache_ranks_the_goldens_greedy_tokens_first():
    """--kv-cache-dtype fp8: the attention layer's K and V in fp8 with its calibrated scales (the
    Mamba-2 layers' 1.0, unread), the states over the fp8 pages; teacher-forced through the
    engine, HF's greedy continuation is its top-1 at >= 14 of 16 positions (as
    test_kv_fp8.py judges an fp8 cache), and every block comes back."""
    cfg, params = _load(DENSE)
    golden = np.load(DENSE / "golden.npz")
    prompt, expected = golden["greedy_prompt"].tolist(), golden["greedy_tokens"].tolist()
    engine = LLMEngine(cfg, params, None, _args(DENSE, 64, kv_cache_dtype="fp8"), num_blocks=64)
    assert engine.runner.kv_cache[0][0].dtype == jnp.float8_e4m3fn
    attention = engine.runner.kernels.attention
    assert [attention.k_scales[i] for i, s in enumerate(cfg.layer_states) if s] == [1.0] * 3
    engine.add_request("s", prompt + expected, SamplingParams(max_tokens=1, prompt_logprobs=0))
    scored = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            scored = scored or out.prompt_logprobs
    picked = scored[len(prompt):]
    assert [lp.token_id for lp in picked] == expected
    assert sum(lp.rank == 1 for lp in picked) >= 14
    assert_all_free(engine)


def test_disaggregated_engine_hands_the_states_over():
    """A prefill and a decode engine on one device: the hand-over copies the attention group's
    prompt blocks and each Mamba-2 layer's state pages (every KV group's table), and the decode
    side continues with HF's greedy tokens, a chunked prompt and a one-block one alike, and
    after a prefill-side prefix hit; no block is left held on either side."""
    from test_engine_support import one_device_disaggregated
    cfg, params = _load(DENSE)
    golden = np.load(DENSE / "golden.npz")
    prompt, expected = golden["greedy_prompt"].tolist(), golden["greedy_tokens"].tolist()
    args = _args(DENSE, 32, hybrid_kv_cache=False, enable_prefix_caching=True)
    disagg = one_device_disaggregated(cfg, params, None, args, 32)
    assert disagg.decode.scheduler.kv.groups.num_groups == 4  # attention + 3 state groups
    disagg.add_request("long", prompt, SamplingParams(max_tokens=len(expected), **GREEDY))
    disagg.add_request("short", prompt[:3], SamplingParams(max_tokens=6, **GREEDY))
    results = run_all(disagg)
    assert results["long"][0][0] == expected
    # (the pool of the bfloat16 test's float32 engine: the same compiled steps)
    plain = LLMEngine(cfg, params, None, _args(DENSE, 40), num_blocks=40)
    plain.add_request("short", prompt[:3], SamplingParams(max_tokens=6, **GREEDY))
    assert results["short"][0][0] == run_all(plain)["short"][0][0]
    # Again: a prefix hit on the prefill side (its state from a snapshot), none on the decode's.
    disagg.add_request("again", prompt, SamplingParams(max_tokens=len(expected), **GREEDY))
    assert run_all(disagg)["again"][0][0] == expected
    assert disagg.prefill.scheduler.kv.stats.hits > 0
    assert disagg.transfer_metrics.transfers._value.get() == 3
    assert disagg.transfer_metrics.blocks_skipped._value.get() == 0
    assert not disagg.requests and not disagg._transit
    for side in (disagg.prefill, disagg.decode):
        assert_all_free(side)


@pytest.mark.parametrize("model_dir", [MOE, DENSE], ids=["moe", "dense"])
def test_quantized_on_load(model_dir):
    """--quantization int8 on the float checkpoint: the shared MLP's fused gate/up and its down
    projection (read by the family's tensor_sources) become QuantLinear weights [out, in] that
    dequantize to the checkpoint's, and the model runs."""
    import dataclasses

    from jaxinfer.model.quant import ops
    cfg = dataclasses.replace(load_config(model_dir), quantization="int8")
    params = load_params(model_dir, cfg, jnp.float32, progress=False)
    dense = load_params(model_dir, load_config(model_dir), jnp.float32, progress=False)
    layer = next(k for k in params if k.startswith("layers_") and (
        "moe" in params[k] or "mlp" in params[k]))
    path = ("moe", "shared_mlp") if cfg.is_moe else ("mlp",)
    q_mlp, d_mlp = params[layer], dense[layer]
    for key in path:
        q_mlp, d_mlp = q_mlp[key], d_mlp[key]
    for proj in ("gate_proj", "up_proj", "down_proj"):
        q, want = q_mlp[proj], np.asarray(d_mlp[proj]["kernel"]).T
        got = np.asarray(ops.dequantize(q["weight"], q["weight_scale"], -1))
        assert np.abs(got - want).max() <= np.abs(want).max() / 127, proj
    golden = np.load(model_dir / "golden.npz")
    logits = jax.jit(train_forward, static_argnums=1)(params, cfg,
                                                      jnp.asarray(golden["prompt_1"])[None])[0]
    assert np.isfinite(np.asarray(logits)).all()


def test_in_proj_parts_and_their_scales_from_a_quantized_checkpoint(tmp_path):
    """mamba.in_proj [z | x | B | C | dt, H] is read as the mixer's five parts (so a column split
    over devices gives each its heads' rows), with its scales per tensor, per channel, or per
    block of rows; blocks a part's rows would cut are refused."""
    import dataclasses

    from safetensors.numpy import save_file

    from jaxinfer.errors import CheckpointError
    from jaxinfer.model import granitemoehybrid
    from jaxinfer.model.tensor_sources import Checkpoint
    cfg = dataclasses.replace(load_config(MOE), quantization="fp8")
    parts = cfg.family_options.mamba.in_projections  # 64, 64, 8, 8, 4 rows
    rows = sum(size for _, size in parts)
    rng = np.random.default_rng(0)
    name = "model.layers.0.mamba.in_proj.weight"
    weight = rng.random((rows, 8), np.float32)
    scales = {"per_tensor": np.ones((1,), np.float32), "channel": rng.random((rows, 1), np.float32),
              "block4": rng.random((rows // 4, 2), np.float32),
              "block16": rng.random((-(-rows // 16), 2), np.float32)}
    want = {"per_tensor": lambda s, n: scales["per_tensor"],
            "channel": lambda s, n: scales["channel"][s:s + n],
            "block4": lambda s, n: scales["block4"][s // 4:(s + n) // 4]}

    def sources(kind, tensor):
        path = tmp_path / f"{kind}.safetensors"
        save_file({name: weight, name + "_scale_inv": scales[kind]}, str(path))
        return granitemoehybrid.tensor_sources(Checkpoint([path]), f"{name}{tensor}", cfg)

    for kind in want:
        weights, got, start = sources(kind, ""), sources(kind, "_scale_inv"), 0
        for part, size in parts:
            key = ("layers_0", "mamba", part)
            np.testing.assert_array_equal(weights[(*key, "weight")].read_all(),
                                          weight[start:start + size])
            np.testing.assert_array_equal(got[(*key, "weight_scale")].read_all(),
                                          want[kind](start, size))
            start += size
    with pytest.raises(CheckpointError, match="16-row scale blocks do not split at rows 128 .. 136"):
        sources("block16", "_scale_inv")


def test_config_parsing():
    raw = {"architectures": ["GraniteMoeHybridForCausalLM"], "vocab_size": 32,
           "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
           "num_hidden_layers": 2, "layer_types": ["mamba", "attention"], "mamba_n_heads": 4,
           "mamba_d_state": 8, "num_local_experts": 0, "time_step_limit": [0.0, 8.0]}
    cfg = config_from_dict(raw)
    dims = cfg.family_options.mamba
    assert (dims.heads, dims.head_dim, dims.dt_limit) == (4, 32, (0.0, 8.0))  # expand 2 x 64 / 4
    assert not cfg.family_options.rope and cfg.layer_states[1] is None
    assert config_from_dict({**raw, "layer_types": None,
                             "layers_block_type": ["attention", "mamba"]}).layer_states[0] is None
    for bad, match in (({"layer_types": ["mamba", "conv"]}, "layer_types"),
                       ({"layer_types": ["mamba", "mamba"]}, "no attention layer"),
                       ({"mamba_n_heads": 5}, "mamba_n_heads"),
                       ({"position_embedding_type": "alibi"}, "position_embedding_type")):
        with pytest.raises(ConfigError, match=match):
            config_from_dict({**raw, **bad})


def test_pallas_kernels_through_the_mixer():
    """The table's Pallas kernels (interpreted) in the mixer give the references' logits: a
    ragged prefill of 5, 20 and 1 tokens, then a pure-decode step (the one-token kernels), on
    shapes the Triton blocks take (C = 128 conv channels, P = N = 16)."""
    import dataclasses

    from jaxinfer.model.kernel_table import REFERENCE_KERNELS
    from jaxinfer.model.ssm_kernels import Mamba2Kernels
    from jaxinfer.model.transformer import forward, init_params
    from jaxinfer.worker.kv.device_cache import allocate_kv_cache
    from pallas_kernels.attention.metadata import AttentionMetadata

    cfg = config_from_dict({
        "architectures": ["GraniteMoeHybridForCausalLM"], "vocab_size": 64, "hidden_size": 64,
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
        "layer_types": ["mamba", "attention"], "mamba_n_heads": 4, "mamba_d_head": 16,
        "mamba_expand": 1, "mamba_n_groups": 2, "mamba_d_state": 16, "mamba_chunk_size": 16,
        "num_local_experts": 0, "shared_intermediate_size": 64, "torch_dtype": "float32"})
    block = 16  # the state spans both of a sequence's pages
    assert cfg.layer_kv_specs()[0].state_pages(block, jnp.float32) == 2
    params = init_params(cfg, jax.random.key(0), jnp.float32, std=0.2)
    groups = KVCacheGroups.for_model(cfg)
    lengths = np.array([5, 20, 1])
    # Sequence s of group g on blocks 2 (g * 3 + s) and the next (the state group: its pages).
    tables = np.arange(2 * 3 * groups.num_groups, dtype=np.int32).reshape(groups.num_groups, 3, 2)

    def metadata(first, count, **kw):
        pos = np.concatenate([np.arange(f, f + c) for f, c in zip(first, count)])
        seq = np.repeat(np.arange(3), count)
        slots = tables[:, seq, pos // block] * block + pos % block
        starts = np.concatenate([[0], np.cumsum(count)]).astype(np.int32)
        return pos, AttentionMetadata(jnp.asarray(slots), jnp.asarray(starts),
                                      jnp.asarray(first + count, jnp.int32), jnp.asarray(tables),
                                      kv_layout=groups.kv_layout, **kw)

    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, lengths.sum()), jnp.int32)
    prefill_pos, prefill = metadata(np.zeros(3, int), lengths)
    decode_pos, decode = metadata(lengths, np.ones(3, int), num_decodes=3)
    logits = {}
    pallas = dataclasses.replace(REFERENCE_KERNELS, mamba2=Mamba2Kernels(pallas=True,
                                                                         interpret=True))
    step = jax.jit(forward, static_argnums=(1, 6))  # (eagerly, each op compiles on its own)
    for name, kernels in (("reference", REFERENCE_KERNELS), ("pallas", pallas)):
        cache = allocate_kv_cache(cfg, 12, block, jnp.float32, num_slots=groups.num_slots)
        first, cache = step(params, cfg, tokens, jnp.asarray(prefill_pos), cache, prefill,
                            kernels)
        second, _ = step(params, cfg, jnp.asarray([1, 2, 3], jnp.int32),
                         jnp.asarray(decode_pos), cache, decode, kernels)
        logits[name] = (first, second)
    for ref, got in zip(logits["reference"], logits["pallas"]):
        np.testing.assert_allclose(got, ref, atol=1e-4, rtol=0)


def test_block_tables_padded_to_a_gpus_width_keep_the_goldens(monkeypatch):
    """A GPU's kernel table pads a block table's width to 64 columns (KernelTable.table_columns:
    each row and group sliced out of it then starts 256-byte aligned, as Mosaic GPU requires);
    the state pages and attention blocks read through the wider tables give the same walk."""
    import dataclasses

    from jaxinfer.engine import kernels, kv_blocks, llm_engine

    def padded(config):
        return dataclasses.replace(kernels.engine_kernels(config), table_columns=64)
    for module in (llm_engine, kv_blocks):
        monkeypatch.setattr(module, "engine_kernels", padded)
    cfg, params = _load(MOE)
    engine = LLMEngine(cfg, params, None, _args(MOE, 16), num_blocks=16)
    assert engine.runner.max_blocks == 64
    assert_engine_matches_goldens(engine, np.load(MOE / "golden.npz"))
