"""Gemma 2, Gemma 3 and gpt-oss configs and checkpoints: per-layer windows from every spelling,
HF's defaults for sparse hub configs, refusals that name the field, MXFP4 expert blocks and
Gemma3ForConditionalGeneration checkpoints loading the same params as their plain fixtures."""

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxinfer.errors import ConfigError
from jaxinfer.model import mxfp4
from jaxinfer.model.config import config_from_dict, load_config
from jaxinfer.model.weights import load_params

FIXTURES = Path(__file__).parent / "fixtures" / "models"
BASE = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=16)
GEMMA2 = dict(BASE, architectures=["Gemma2ForCausalLM"])
GEMMA3 = dict(BASE, architectures=["Gemma3ForCausalLM"])
GPT_OSS = dict(BASE, architectures=["GptOssForCausalLM"], num_local_experts=4,
               num_experts_per_tok=2)


def _equal(a, b) -> bool:
    return jax.tree_util.tree_all(jax.tree.map(lambda x, y: bool(jnp.array_equal(x, y)), a, b))


def test_windows_from_each_spelling():
    assert config_from_dict(GEMMA2).layer_windows == (16, None, 16, None)
    assert config_from_dict(GPT_OSS).layer_windows == (16, None, 16, None)
    twelve = config_from_dict({**GEMMA3, "num_hidden_layers": 12})  # pattern 6 by default
    assert twelve.layer_windows == (16,) * 5 + (None,) + (16,) * 5 + (None,)
    types = ["full_attention", "sliding_attention"] * 2
    assert config_from_dict({**GEMMA3, "layer_types": types}).layer_windows == (None, 16) * 2


def test_gemma_fields_and_hf_defaults():
    g2 = config_from_dict(GEMMA2)
    assert (g2.attn_softcap, g2.final_softcap, g2.tie_word_embeddings) == (50.0, 30.0, True)
    assert g2.score_scale == 256 ** -0.5 and g2.norm_offset and g2.hidden_act == "gelu_tanh"
    # A hub Gemma-3 multimodal config: the text fields nested, most of them left to HF's defaults.
    hub = {"architectures": ["Gemma3ForConditionalGeneration"], "eos_token_id": [1, 106],
           "text_config": {"hidden_size": 5376, "intermediate_size": 21504,
                           "num_hidden_layers": 62, "num_attention_heads": 32,
                           "num_key_value_heads": 16, "head_dim": 128,
                           "query_pre_attn_scalar": 168, "sliding_window": 1024,
                           "rope_scaling": {"factor": 8.0, "rope_type": "linear"}},
           "vision_config": {"hidden_size": 1152}}
    cfg = config_from_dict(hub)
    assert cfg.vocab_size == 262208 and cfg.eos_token_ids == (1, 106) and cfg.qk_norm
    assert cfg.layer_windows.count(None) == 10 and cfg.layer_window(5) is None
    assert (cfg.rope.rope_type, cfg.rope.factor, cfg.rope.theta) == ("linear", 8.0, 1e6)
    assert cfg.layer_rope(0).theta == 10000.0 and cfg.layer_rope(0).rope_type == "default"
    gpt = config_from_dict({**GPT_OSS, "rope_scaling": {"rope_type": "yarn", "factor": 32.0}})
    assert gpt.rope.attention_factor == pytest.approx(0.1 * np.log(32.0) + 1)
    assert gpt.swiglu_clamp == (1.702, 7.0) and gpt.topk_then_softmax and gpt.attn_sinks


@pytest.mark.parametrize("raw, message", [
    ({**GEMMA3, "layer_types": ["sliding_attention"] * 3}, "layer_types has 3 entries"),
    ({**GEMMA3, "layer_types": ["chunked_attention"] * 4}, "layer_types \\['chunked_attention'\\]"),
    ({**GEMMA2, "sliding_window": None}, "sliding_window=None must be a positive integer"),
    ({**GEMMA3, "use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({**GEMMA2, "hidden_activation": "gelu"}, "hidden_activation 'gelu'"),
    ({**GEMMA2, "attention_bias": True}, "attention_bias"),
    ({**GPT_OSS, "rope_scaling": {"rope_type": "longrope"}}, "rope_type 'longrope'"),
    ({**GPT_OSS, "num_experts_per_tok": 5}, "num_experts_per_tok=5"),
    ({"architectures": ["Gemma3ForConditionalGeneration"]}, "'text_config'"),
    ({**GEMMA2, "quantization_config": {"quant_method": "mxfp4"}}, "quant_method 'mxfp4'"),
])
def test_bad_configs_are_refused_by_field(raw, message):
    with pytest.raises(ConfigError, match=message):
        config_from_dict(raw)


def test_mxfp4_round_trip_and_values():
    rng = np.random.default_rng(0)
    codes = rng.integers(0, 16, (2, 3, 64))
    w = mxfp4.FP4_VALUES[codes] * np.ldexp(1.0, rng.integers(-8, 3, (2, 3, 2)).repeat(32, -1))
    blocks, scales = mxfp4.quantize(w)
    assert blocks.shape == (2, 3, 2, 16) and scales.shape == (2, 3, 2)
    assert np.array_equal(mxfp4.dequantize(blocks, scales), w)
    # low nibble first: byte 0x21 holds 0.5 (code 1) then 1.0 (code 2); scale 128 = 2^1
    one = np.zeros((1, 16), np.uint8)
    one[0, 0] = 0x21
    assert mxfp4.dequantize(one, np.array([128], np.uint8))[:3].tolist() == [1.0, 2.0, 0.0]
    with pytest.raises(ValueError, match="not on the MXFP4 grid"):
        mxfp4.quantize(np.full((1, 32), 0.3))


def test_mxfp4_checkpoint_loads_the_same_params_exactly():
    cfg = load_config(FIXTURES / "gpt_oss_mxfp4")
    assert cfg == load_config(FIXTURES / "gpt_oss") and cfg.quantization is None
    # bf16: the dequantized values are exact in it (the fixture's experts are on the MXFP4 grid)
    plain = load_params(FIXTURES / "gpt_oss", cfg, jnp.bfloat16, progress=False)
    packed = load_params(FIXTURES / "gpt_oss_mxfp4", cfg, jnp.bfloat16, progress=False)
    assert _equal(plain, packed)


def test_gemma3_multimodal_checkpoint_loads_its_language_model(tmp_path):
    """The hub layout of Gemma3ForConditionalGeneration: `language_model.model.*` tensors beside a
    vision tower and projector, the text config nested."""
    src = FIXTURES / "gemma3"
    text = json.loads((src / "config.json").read_text())
    config = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
              "text_config": {k: v for k, v in text.items() if k != "architectures"},
              "vision_config": {"hidden_size": 8}, "eos_token_id": text["eos_token_id"]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    tensors = {"language_model." + k: v for k, v in load_file(src / "model.safetensors").items()}
    tensors["vision_tower.vision_model.embeddings.patch_embedding.weight"] = np.ones((8, 3, 2, 2),
                                                                                    np.float32)
    tensors["multi_modal_projector.mm_input_projection_weight"] = np.ones((8, 64), np.float32)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    cfg = load_config(tmp_path)
    assert cfg.architecture == "Gemma3ForConditionalGeneration"
    plain_cfg = load_config(src)
    assert cfg.layer_windows == plain_cfg.layer_windows and cfg.rope == plain_cfg.rope
    assert _equal(load_params(tmp_path, cfg, jnp.float32, progress=False),
                  load_params(src, plain_cfg, jnp.float32, progress=False))
    shutil.rmtree(tmp_path)


def test_memory_report_counts_windowed_reads():
    from jaxinfer.cli.memory import ModelShape, memory_report, parse_accelerator
    windows = (4, 4, None, 4, 4, None)  # 6 layers, 2 KV heads x 8, bf16: 384 B per token
    shape = ModelShape(6, 2, 8, 4, 1000, 500, "bfloat16", layer_windows=windows)
    r = memory_report(shape, kv_dtype="auto", seq_len=16, batch=2, block_size=16,
                      accelerator=parse_accelerator("h200", None, None), gpu_memory_utilization=0.9)
    assert r["kv_bytes_per_token"] == 384 and r["kv_bytes_per_sequence"] == 384 * 16
    assert r["kv_read_bytes_per_token"] == 384 * (4 * 4 + 2 * 16) // (6 * 16)
    assert r["decode_roofline"]["bytes_per_step"] == 1000 + 2 * 16 * 192


def test_memory_report_counts_the_hybrid_pool():
    from jaxinfer.cli.memory import ModelShape, memory_report, parse_accelerator
    shape = ModelShape(6, 2, 8, 4, 1000, 500, "bfloat16", layer_windows=(4, 4, None, 4, 4, None))
    r = memory_report(shape, kv_dtype="auto", seq_len=64, batch=2, block_size=4,
                      accelerator=parse_accelerator("h200", None, None), gpu_memory_utilization=0.9)
    # groups: the 2 global layers, the 4 windowed ones as 2 groups of 2 (2 cache arrays): 16
    # blocks + 1 + 1 (the window's block) of 2 layers' pages, against 16 blocks of 6
    assert r["kv_pool_bytes_per_token"] == 384 * (18 * 2) // (16 * 6)
    assert r["kv_bytes_per_sequence"] == 384 * 64 * 36 // 96
