"""Embeddings: LLM.embed on a fixture of each kind of family equals a float32 reference of the same
pooling (the model's dense forward run directly; cosine >= 0.99999), with prompts prefilled in
several chunks and batched together; the pooling configuration read from sentence-transformers
files; Matryoshka `dimensions`; and /v1/embeddings through the official openai client on the shared
server (--task embed): float and base64, strings and token arrays, batched, errors naming the field,
KV blocks all back afterwards."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import openai
import pytest

from jaxinfer.engine.pooling import PoolingConfig, check_dimensions, finish_embedding, pooling_config
from jaxinfer.errors import InvalidRequestError
from server_harness import MODEL, add_app, check_error_shape, post_raw, wait_pool_free

pytestmark = pytest.mark.slow  # minutes on the CI machine: xdist starts its group first (conftest.py)

FIXTURES = Path(__file__).parent / "fixtures" / "models"
# One family per kind of forward whose hidden states the pooling reads (the pooling is the same
# code for all; each family's compile is the cost, and every family's forward is
# test_hf_parity's): llama, mistral_window (a sliding window), gemma3 (Gemma's norms and scaled
# embeddings, sliding and full layers), gpt_oss (sinks, MoE), deepseek_v2 (MLA), qwen3_moe (q/k
# norms, MoE). The *_fused/ and *_mxfp4/ fixtures are other files of the same weights.
FAMILIES = ["deepseek_v2", "gemma3", "gpt_oss", "llama", "mistral_window", "qwen3_moe"]
METHODS = ("last", "mean", "cls")


@functools.partial(jax.jit, static_argnums=0)
def _hidden(cfg, params, tokens, positions):
    """The final hidden states, jitted: run eagerly, each of the forward's ops compiled apart
    (~45 s a family on CI)."""
    from jaxinfer.model.transformer import Transformer
    from jaxinfer.model.kernel_table import REFERENCE_KERNELS
    return Transformer(cfg, REFERENCE_KERNELS, jnp.float32).apply({"params": params}, tokens, positions,
                                                          return_hidden=True)[2]


def reference_pool(cfg, params, prompts: list[list[int]], method: str) -> list[np.ndarray]:
    """The dense causal forward over the prompts right-padded to one length (padding comes after
    every real position, so it changes none of them), pooled in numpy."""
    length = max(len(p) for p in prompts)
    tokens = jnp.array([p + [0] * (length - len(p)) for p in prompts])
    positions = jnp.broadcast_to(jnp.arange(length), tokens.shape)
    hidden = np.asarray(_hidden(cfg, params, tokens, positions))
    out = []
    for h, p in zip(hidden, prompts):
        h = h[:len(p)]
        out.append({"last": h[-1], "mean": h.mean(0), "cls": h[0]}[method])
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_llm_embed_matches_the_float32_reference(family):
    from jaxinfer.engine.args import EngineArgs
    from jaxinfer.frontends.llm import LLM
    from jaxinfer.engine.llm_engine import LLMEngine
    from jaxinfer.model.config import load_config
    from jaxinfer.model.weights import load_params
    cfg = load_config(FIXTURES / family)
    params = load_params(FIXTURES / family, cfg, jnp.float32, progress=False)
    # 16-token steps: the 21-token prompt is prefilled in two chunks next to the short one.
    args = EngineArgs(model=str(FIXTURES / family), max_model_len=64, block_size=4, num_blocks=32,
                      max_num_seqs=4, max_num_batched_tokens=16, long_prefill_chunk=16,
                      compilation_cache_dir=None, warmup=False, dtype="float32",
                      background_compile=False, attention_backend="reference")
    engine = LLMEngine(cfg, params, None, args, num_blocks=32)
    rng = np.random.default_rng(FAMILIES.index(family))
    # Every method and a chunked prefill on one family; one step of one method on the others (the
    # pooling is the same code for every family; each family's compile is the cost).
    lengths, methods = ((5, 21), METHODS) if family == "llama" else \
        ((5, 9), [METHODS[FAMILIES.index(family) % len(METHODS)]])
    prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in lengths]
    for method in methods:
        got = LLM(engine=engine).embed(prompts, pooling=method, normalize=False, use_tqdm=False)
        for g, ref in zip(got, reference_pool(cfg, params, prompts, method)):
            cos = float(g @ ref / np.linalg.norm(g) / np.linalg.norm(ref))
            assert cos >= 0.99999 and np.allclose(g, ref, rtol=1e-3, atol=1e-4), (method, cos)
    assert engine.scheduler.kv.num_free_blocks == engine.scheduler.kv.num_blocks


def test_device_pooling_of_ragged_chunks_matches_numpy():
    """A step's flat rows: a decode row, then chunks of embedding requests (mean over a middle
    chunk, last in and not in its chunk, cls) and a plain prefill; each request's sum is one
    segment of the step, summed on the device."""
    from types import SimpleNamespace as NS
    from jaxinfer.worker.hidden_reads import gather_pooling_rows, pool

    def entry(method, n, start, num):
        params = NS(pooling=method)
        return NS(seq=NS(request=NS(params=params, num_prompt_tokens=n)), start=start, num_tokens=num)
    rows = [entry(None, 9, 8, 1), entry("mean", 30, 10, 12), entry("last", 7, 0, 7),
            entry("last", 40, 0, 16), entry(None, 5, 0, 5), entry("cls", 6, 0, 6)]
    hidden = np.random.default_rng(0).standard_normal((64, 8)).astype(np.float32)
    p = gather_pooling_rows(rows)
    got = np.asarray(pool(jnp.asarray(hidden), p.start, p.count, p.weight))
    want = [hidden[1:13].sum(0) / 30, hidden[19], np.zeros(8), hidden[41]]
    assert len(p.owners) == 4 and got.shape == (4, 8)
    np.testing.assert_allclose(got, np.stack(want), rtol=1e-5, atol=1e-6)
    assert [from_start for _, from_start in p.owners] == [False, True, True, True]


def test_pooling_config_from_sentence_transformers_files(tmp_path):
    assert pooling_config(tmp_path) == PoolingConfig("last", True, False, None)
    (tmp_path / "modules.json").write_text(json.dumps([
        {"idx": 0, "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": False}))
    (tmp_path / "config.json").write_text(json.dumps({"matryoshka_dimensions": [8, 16]}))
    cfg = pooling_config(tmp_path)
    assert (cfg.method, cfg.normalize, cfg.detected, cfg.matryoshka) == ("mean", False, True, (8, 16))
    check_dimensions(cfg, 16, 32)
    with pytest.raises(InvalidRequestError, match="trained for"):
        check_dimensions(cfg, 12, 32)
    with pytest.raises(InvalidRequestError, match="does not support Matryoshka"):
        check_dimensions(PoolingConfig(), 12, 32)
    v = finish_embedding([3.0, 4.0, 12.0], True, 2)
    assert np.allclose(v, [0.6, 0.8])


# ---- /v1/embeddings -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def embed_client(server):
    url = add_app(server, "embed", task="embed")
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_openai_client_embeddings(server, embed_client):
    texts = ["The quick brown fox", "Hello world! Serving language models over HTTP"]
    floats = embed_client.embeddings.create(model=MODEL, input=texts, encoding_format="float")
    b64 = embed_client.embeddings.create(model=MODEL, input=texts)  # the client asks for base64
    assert [d.index for d in floats.data] == [0, 1]
    for f, b in zip(floats.data, b64.data):
        assert len(f.embedding) == server.engine.model_config.hidden_size
        assert np.allclose(f.embedding, b.embedding, atol=1e-6)
        assert abs(np.linalg.norm(f.embedding) - 1) < 1e-5  # last-token pooling, normalized
    ids = server.engine.tokenizer.encode(texts[0], add_special_tokens=True)
    by_ids = embed_client.embeddings.create(model=MODEL, input=[ids], encoding_format="float")
    assert np.allclose(by_ids.data[0].embedding, floats.data[0].embedding, atol=1e-5)
    assert floats.usage.prompt_tokens == floats.usage.total_tokens > len(ids)
    wait_pool_free(server)


@pytest.mark.parametrize("body,param", [
    ({}, "input"), ({"input": ""}, "input"), ({"input": [[]]}, "input"), ({"input": [10**6]}, "input"),
    ({"input": "x" * 10}, None), ({"input": "hi", "dimensions": 4}, "dimensions"),
    ({"input": "hi", "dimensions": 0}, "dimensions"), ({"input": "hi", "encoding_format": "int8"},
                                                        "encoding_format"),
    ({"input": "hi", "user": 3}, "user"), ({"input": "hi", "priority": 1.5}, "priority"),
    ({"input": [1] * 400}, "input"),
])
def test_bad_embedding_requests_are_400s(server, embed_client, body, param):
    raw_body = json.dumps({"model": MODEL, **body}).encode()
    status, _, raw = post_raw(server.urls["embed"], "/v1/embeddings", raw_body)
    if param is None:
        assert status == 200, raw
        return
    assert status == 400, raw
    check_error_shape(raw, 400, param)


def test_generation_server_refuses_embeddings(server):
    status, _, raw = post_raw(server.urls["main"], "/v1/embeddings", b'{"input": "hi"}')
    assert status == 400
    check_error_shape(raw, 400, "model")


def test_a_non_finite_embedding_is_an_error_not_invalid_json():
    from serve.embeddings import _encode
    from serve.errors import APIError
    assert _encode(np.array([0.5, -1.0], np.float32), False) == [0.5, -1.0]
    for bad in (np.nan, np.inf):
        for as_base64 in (False, True):
            with pytest.raises(APIError) as e:
                _encode(np.array([0.5, bad], np.float32), as_base64)
            assert e.value.status == 500
