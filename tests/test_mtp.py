"""DeepSeek-V3's multi-token-prediction module as a speculative proposer (spec_decode/mtp.py), on
the tiny random V3 fixture (tests/fixtures/models/deepseek_v3) extended with an MTP module
(checkpoint layer 2 in HF's names; HF transformers drops it, so it is made here): the module's
paged forward against a dense reference written from the formula (vLLM's deepseek_mtp), greedy
tokens with MTP speculation identical to HF's golden continuation, and the refusals."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxinfer.engine.args import EngineArgs
from jaxinfer.errors import ConfigError
from jaxinfer.model.config import load_config
from jaxinfer.model.transformer import DecoderLayer, rope_tables
from jaxinfer.model.weights import load_params
from jaxinfer.spec_decode.mtp import load_mtp
from jaxinfer.worker.kv import allocate_kv_cache
from jaxinfer.model.kernel_table import KernelTable
from pallas_kernels.attention.latent_reference import LATENT_REFERENCE
from pallas_kernels.attention.metadata import AttentionMetadata
from test_engine_support import assert_speculative_greedy_matches_golden

FIXTURE = Path(__file__).parent / "fixtures" / "models" / "deepseek_v3"


def _with_mtp_module(out: Path) -> Path:
    """The fixture plus an MTP module at layer 2: layer 1's decoder tensors (MoE, q LoRA)
    perturbed, random enorm / hnorm / eh_proj, shared_head from the model's norm and LM head."""
    rng = np.random.default_rng(7)
    tensors = load_file(FIXTURE / "model.safetensors")
    h = tensors["model.norm.weight"].shape[0]
    for name, w in list(tensors.items()):
        if name.startswith("model.layers.1."):
            noise = rng.normal(0, 0.05, w.shape).astype(w.dtype)
            tensors[name.replace("layers.1.", "layers.2.")] = w + noise
    tensors.update({
        "model.layers.2.enorm.weight": (1 + rng.normal(0, 0.1, h)).astype(np.float32),
        "model.layers.2.hnorm.weight": (1 + rng.normal(0, 0.1, h)).astype(np.float32),
        "model.layers.2.eh_proj.weight": rng.normal(0, 0.2, (h, 2 * h)).astype(np.float32),
        "model.layers.2.shared_head.norm.weight": tensors["model.norm.weight"],
        "model.layers.2.shared_head.head.weight": tensors["lm_head.weight"],
        "model.layers.2.embed_tokens.weight": tensors["model.embed_tokens.weight"],
    })
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    for f in ("config.json", "generation_config.json", "golden.npz"):
        shutil.copy(FIXTURE / f, out / f)
    return out


@pytest.fixture(scope="module")
def mtp_dir(tmp_path_factory):
    return _with_mtp_module(tmp_path_factory.mktemp("dsv3_mtp"))


def _rms(x, w, eps):
    return w * x / np.sqrt((x * x).mean(-1, keepdims=True) + eps)


def test_module_forward_matches_the_formula(mtp_dir):
    """Positions 0..n-2 of one prompt as one paged prefill of the module (the reference backend,
    the latent cache) against the dense formula: e = embed(x_{t+1}) (0 at t = 0),
    s = layer(eh_proj [enorm(e), hnorm(h_t)]), logits = head(norm(s)), h_t the target's
    final-normed hidden state (random here)."""
    target = load_config(mtp_dir)
    params = load_params(mtp_dir, target, jnp.float32)
    proposer = load_mtp(str(mtp_dir), target, jnp.float32)
    cfg, p = proposer.cfg, proposer.params
    tokens = np.asarray(np.load(mtp_dir / "golden.npz")["greedy_prompt"][:9], np.int32)
    n = len(tokens)
    # h_t: random (the target's own would cost a compile; the engine test below runs the
    # target's final-normed hidden through the module).
    hidden = np.random.default_rng(3).normal(0, 1, (n - 1, target.hidden_size)).astype(np.float32)
    embed = np.asarray(params["embed"]["embedding"])
    eps = target.rms_norm_eps

    # The dense reference (numpy glue; the decoder layer in its dense causal form).
    e = embed[tokens[1:]]
    e[0] = 0.0
    x = np.concatenate([_rms(e, np.asarray(p["enorm"]), eps),
                        _rms(hidden, np.asarray(p["hnorm"]), eps)], -1) @ np.asarray(p["eh_proj"])
    pos = np.arange(n - 1)
    cos, sin = rope_tables(cfg.layer, jnp.asarray(pos)[None])
    layer = DecoderLayer(cfg.layer, KernelTable(LATENT_REFERENCE), jnp.float32, True)
    s, delta, _ = jax.jit(lambda prm, x: layer.apply({"params": prm}, x, None, cos, sin))(
        p["layers_0"], jnp.asarray(x)[None])
    stream = np.asarray(s + delta)[0]
    want = _rms(stream, np.asarray(p["final_norm"]["weight"]), eps) @ np.asarray(
        p["lm_head"]["kernel"])

    block = 4
    kv = allocate_kv_cache(cfg.layer, 4, block, jnp.float32)
    md = AttentionMetadata(jnp.arange(n - 1, dtype=jnp.int32), jnp.asarray([0, n - 1], jnp.int32),
                           jnp.asarray([n - 1], jnp.int32), jnp.arange(4, dtype=jnp.int32)[None])
    step = jax.jit(lambda *a: cfg.step(*a, KernelTable(LATENT_REFERENCE))[:2])
    logits, got_stream = step(p, params["embed"]["embedding"], jnp.asarray(tokens[1:]),
                              jnp.asarray(hidden), jnp.asarray(pos), kv, md)
    np.testing.assert_allclose(np.asarray(got_stream), stream, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(logits), want, rtol=1e-4, atol=1e-4)


def test_greedy_with_mtp_speculation_matches_transformers(mtp_dir):
    golden = np.load(mtp_dir / "golden.npz")
    spec = {"method": "deepseek_mtp", "num_speculative_tokens": 2}
    assert_speculative_greedy_matches_golden(mtp_dir, spec, golden, block_size=4)


def test_mtp_refusals(tmp_path):
    # The fixture's config says num_nextn_predict_layers 1 (HF's V3 default) but its checkpoint
    # has no layer 2: refused, naming the missing tensor.
    target = load_config(FIXTURE)
    with pytest.raises(ConfigError, match="model.layers.2.enorm"):
        load_mtp(str(FIXTURE), target, jnp.float32)
    raw = json.loads((FIXTURE / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw, "num_nextn_predict_layers": 0}))
    with pytest.raises(ConfigError, match="num_nextn_predict_layers"):
        load_mtp(str(tmp_path), load_config(tmp_path), jnp.float32)
    with pytest.raises(ConfigError, match="speculative-model"):
        EngineArgs(model="x", speculative_config={"method": "mtp", "model": "d",
                                                  "num_speculative_tokens": 2}).spec_config()
    assert EngineArgs(model="x", speculative_config={"method": "deepseek_mtp",
                                                     "num_speculative_tokens": 2}
                      ).spec_config().method == "mtp"
