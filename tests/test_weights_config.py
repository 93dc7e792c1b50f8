"""Config parsing and weight loading: every supported option, every refusal, and clear errors."""

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxinfer.cli.main import main
from jaxinfer.model.config import config_from_dict, load_config, rope_inv_freq
from jaxinfer.errors import CheckpointError, ConfigError
from jaxinfer.model.weights import load_params

FIXTURES = Path(__file__).parent / "fixtures" / "models"
BASE = dict(architectures=["LlamaForCausalLM"], vocab_size=64, hidden_size=32, intermediate_size=64,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)


def _tree_equal(a, b):
    return jax.tree_util.tree_all(jax.tree_util.tree_map(lambda x, y: bool(jnp.array_equal(x, y)), a, b))


def test_legacy_rope_scaling_keys_equal_rope_parameters():
    legacy = config_from_dict({**BASE, "rope_theta": 5e5, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}})
    new = config_from_dict({**BASE, "rope_parameters": {
        "rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}})
    assert legacy.rope == new.rope
    plain = config_from_dict({**BASE, "rope_theta": 5e5})
    scaled, unscaled = rope_inv_freq(legacy), rope_inv_freq(plain)
    assert scaled[0] == unscaled[0] and scaled[-1] == pytest.approx(unscaled[-1] / 8)


@pytest.mark.parametrize("change, message", [
    ({"architectures": ["GPT2LMHeadModel"]}, "architectures 'GPT2LMHeadModel' is not supported"),
    ({"architectures": []}, "'architectures' is missing"),
    ({"rope_scaling": {"rope_type": "longrope", "factor": 4.0}}, "rope_type 'longrope' is not supported"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "partial_rotary_factor": 0.5}},
     "partial_rotary_factor=0.5"),
    ({"rope_scaling": {"rope_type": "linear"}}, "rope_scaling.factor is required"),
    ({"max_position_embeddings": None, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
     "max_position_embeddings is required for rope_type 'yarn'"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"num_key_value_heads": 3}, "num_key_value_heads=3"),
    ({"hidden_size": None}, "'hidden_size' is missing"),
])
def test_unsupported_config_is_refused_by_name(change, message):
    with pytest.raises(ConfigError, match=message):
        config_from_dict({**BASE, **change})


def test_sliding_window_shorter_than_context_windows_mistral_and_caps_others():
    cfg = config_from_dict({**BASE, "architectures": ["MistralForCausalLM"], "sliding_window": 64})
    assert cfg.max_position_embeddings == 128 and set(cfg.layer_windows) == {64}
    llama = config_from_dict({**BASE, "sliding_window": 64})
    assert llama.max_position_embeddings == 64 and not llama.layer_windows
    qwen = config_from_dict({**BASE, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 16,
                             "use_sliding_window": False})
    assert qwen.max_position_embeddings == 128


def test_missing_dir_and_bad_json(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope")
    with pytest.raises(ConfigError, match="config.json' not found"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config(tmp_path)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_fused_and_per_expert_moe_layouts_load_identically(family):
    cfg = load_config(FIXTURES / family)
    a = load_params(FIXTURES / family, cfg, jnp.float32, progress=False)
    b = load_params(FIXTURES / f"{family}_fused", cfg, jnp.float32, progress=False)
    assert _tree_equal(a, b)


def _copy_fixture(tmp_path, family="llama"):
    d = tmp_path / family
    shutil.copytree(FIXTURES / family, d)
    return d, load_config(d)


def _rewrite(d, edit):
    tensors = load_file(str(d / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(d / "model.safetensors"))


def test_missing_tensor_is_named(tmp_path):
    d, cfg = _copy_fixture(tmp_path)
    _rewrite(d, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match="layers_1/mlp/up_proj/kernel"):
        load_params(d, cfg, progress=False)


def test_extra_tensor_is_named(tmp_path):
    d, cfg = _copy_fixture(tmp_path)
    _rewrite(d, lambda t: t.update({"model.layers.0.self_attn.extra.weight": np.zeros(3, np.float32)}))
    with pytest.raises(CheckpointError, match="unexpected tensor 'model.layers.0.self_attn.extra.weight'"):
        load_params(d, cfg, progress=False)


def test_misshaped_tensor_is_named(tmp_path):
    d, cfg = _copy_fixture(tmp_path)
    _rewrite(d, lambda t: t.update({"model.norm.weight": np.ones(7, np.float32)}))
    message = r"final_norm/weight has shape \[7\], the config implies \[64\]"
    with pytest.raises(CheckpointError, match=message):
        load_params(d, cfg, progress=False)


def test_unsupported_dtype_is_named(tmp_path):
    d, cfg = _copy_fixture(tmp_path)
    _rewrite(d, lambda t: t.update({"model.norm.weight": np.ones(64, np.int16)}))
    with pytest.raises(CheckpointError, match="'model.norm.weight' has dtype I16"):
        load_params(d, cfg, progress=False)


def test_missing_weights_file(tmp_path):
    d, cfg = _copy_fixture(tmp_path)
    (d / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_params(d, cfg, progress=False)


def test_sharded_checkpoint_with_index(tmp_path):
    d, cfg = _copy_fixture(tmp_path)
    tensors = load_file(str(d / "model.safetensors"))
    (d / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for fname, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(d / fname))
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {k: f for f, ks in shards.items() for k in ks}}))
    sharded = load_params(d, cfg, jnp.float32, progress=False)
    assert _tree_equal(sharded, load_params(FIXTURES / "llama", cfg, jnp.float32, progress=False))
    (d / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="listed in the safetensors index but missing"):
        load_params(d, cfg, progress=False)


def test_convert_to_orbax_round_trips(tmp_path, capsys):
    out = tmp_path / "converted"
    assert main(["convert", str(FIXTURES / "qwen2"), str(out), "--dtype", "float32"]) == 0
    cfg = load_config(out)
    restored = load_params(out, cfg, jnp.float32, progress=False)
    assert _tree_equal(restored, load_params(FIXTURES / "qwen2", cfg, jnp.float32, progress=False))


def test_cli_reports_bad_model_dir_without_traceback(tmp_path, capsys):
    assert main(["convert", str(tmp_path / "missing"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "error: model directory" in err and "Traceback" not in err


def test_dummy_weights_have_real_shapes():
    cfg = load_config(FIXTURES / "qwen3_moe")
    dummy = load_params(None, cfg, jnp.bfloat16, load_format="dummy")
    real = load_params(FIXTURES / "qwen3_moe", cfg, jnp.bfloat16, progress=False)
    assert jax.tree_util.tree_map(lambda x: (x.shape, x.dtype), dummy) == \
        jax.tree_util.tree_map(lambda x: (x.shape, x.dtype), real)
    assert sum(x.size for x in jax.tree_util.tree_leaves(real)) == cfg.num_params()


def test_dummy_weights_quantized_on_load_never_hold_the_unquantized_tree(monkeypatch):
    """--load-format dummy --quantization fp8 makes each bf16 weight only when it is quantized
    and deletes it after (an 80B model's bf16 weights outgrow the card its FP8 ones fit): at most
    one unquantized weight at a time, and the weights are init_params' own, quantized."""
    import dataclasses

    from jaxinfer.model import transformer
    from jaxinfer.model.quant.ops import quantize
    cfg = dataclasses.replace(load_config(FIXTURES / "qwen3_moe"), quantization="fp8")
    made, alive = [], []
    real = transformer._normal

    def counted(*args, **kwargs):
        made.append(real(*args, **kwargs))
        alive.append({i for i, x in enumerate(made) if not x.is_deleted()})
        return made[-1]

    monkeypatch.setattr(transformer, "_normal", counted)
    params = load_params(None, cfg, jnp.bfloat16, load_format="dummy")
    quantized = {i for i, x in enumerate(made) if x.is_deleted()}  # deleted once quantized
    assert len(quantized) > 5 and max(len(a & quantized) for a in alive) == 1
    base = transformer.init_params(dataclasses.replace(cfg, quantization=None),
                                   jax.random.key(0), jnp.bfloat16)
    proj = params["layers_0"]["attn"]["q_proj"]
    want, scale = quantize(base["layers_0"]["attn"]["q_proj"]["kernel"].T, "fp8")
    assert jnp.array_equal(proj["weight"].astype(jnp.float32), want.astype(jnp.float32))
