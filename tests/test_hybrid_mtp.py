"""Qwen3-Next's multi-token-prediction module (mtp.*, spec_decode/mtp.py) and an EAGLE-3 head
as speculative proposers over Gated DeltaNet layers, on the tiny random Qwen3-Next fixture in
float32: the module's step against the formula written out (vLLM's qwen3_next_mtp); greedy
tokens with MTP speculation equal the target alone's, token for token and logprobs within 1e-5,
while proposals are both accepted and rejected (a rejection rolls the states back and recomputes
the accepted tokens, core/kv_cache/state_rollback.py; without that roll-back the outputs
differ); no block held after the runs and an abort; the refusals."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxinfer.engine.llm_engine import LLMEngine
from jaxinfer.errors import ConfigError
from jaxinfer.model.config import load_config
from jaxinfer.model.kernel_table import KernelTable
from jaxinfer.model.transformer import DecoderLayer, rope_tables, train_forward
from jaxinfer.model.weights import load_params
from jaxinfer.sampling_params import SamplingParams
from jaxinfer.spec_decode.eagle import EagleProposer
from jaxinfer.spec_decode.mtp import load_mtp
from jaxinfer.worker.kv import allocate_kv_cache
from hybrid_support import GREEDY, assert_same_outputs, hybrid_args
from pallas_kernels.attention.metadata import AttentionMetadata
from test_eagle3 import random_head
from test_engine_support import assert_all_free

FIXTURE = Path(__file__).parent / "fixtures" / "models" / "qwen3_next"
BLOCK, NUM_BLOCKS, K = 4, 64, 3
GOLDEN = np.load(FIXTURE / "golden.npz")
PROMPT, TOKENS = GOLDEN["greedy_prompt"].tolist(), GOLDEN["greedy_tokens"].tolist()
# Two rows at different positions of HF's greedy run: its prompt, and its prompt with the first
# four tokens of the run.
REQUESTS = {"r0": (PROMPT, len(TOKENS)), "r1": (PROMPT + TOKENS[:4], len(TOKENS) - 4)}
# Pairs (seq[j], seq[j + 1]) of PROMPT[-1:] + TOKENS the module gets wrong. Row r0's decodes
# start at j = 1 and r1's at j = 5; with K = 3 these get the rows' proposals accepted in full,
# in part and not at all (a row advances by its accepted proposals plus one).
WRONG = {3, 9, 10}
MTP = json.dumps({"method": "qwen3_next_mtp", "num_speculative_tokens": K})


def _args(**overrides):
    """Speculation never paused (`overrides` with a speculative config)."""
    spec = {"speculative_min_acceptance": 0.0} if "speculative_config" in overrides else {}
    return hybrid_args(FIXTURE, NUM_BLOCKS, block_size=BLOCK, max_model_len=48,
                       long_prefill_chunk=16, **spec, **overrides)


def _run(engine: LLMEngine) -> dict:
    """{request id: (tokens, logprobs)} of the greedy runs of REQUESTS, all at once."""
    for rid, (prompt, n) in REQUESTS.items():
        engine.add_request(rid, prompt, SamplingParams(max_tokens=n, logprobs=0, **GREEDY))
    out = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                c = o.outputs[0]
                out[o.request_id] = list(c.token_ids), np.array([e.logprob for e in c.logprobs])
    assert_all_free(engine)
    return out


@pytest.fixture(scope="module")
def target():
    cfg = load_config(FIXTURE)
    return cfg, load_params(FIXTURE, cfg, jnp.float32, progress=False)


@pytest.fixture(scope="module")
def want(target):
    """The target alone: HF's greedy tokens, with their logprobs from one dense forward."""
    cfg, params = target
    seq = PROMPT + TOKENS
    logits = jax.jit(train_forward, static_argnums=1)(params, cfg, jnp.asarray(seq)[None])[0]
    logprobs = np.asarray(jax.nn.log_softmax(logits, -1))[np.arange(len(seq) - 1), seq[1:]]
    return {rid: (seq[len(prompt):], logprobs[len(prompt) - 1:])
            for rid, (prompt, _) in REQUESTS.items()}


def _rms(x, w):
    """Qwen3-Next's RMSNorm: (1 + w) times x over its root mean square."""
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-6) * (1 + w)


def _with_mtp_module(out: Path, follows: dict[int, int]) -> Path:
    """The fixture plus an `mtp.*` module that proposes `follows[u]` after token u: fc maps the
    normed embedding of each u onto the LM head's row of follows[u] (the hidden half small and
    random), its layer (layer 1's gated attention, layer 3's MoE with its shared expert, both
    perturbed) scaled down to a small correction, its norm weightless."""
    rng = np.random.default_rng(3)
    t = load_file(FIXTURE / "model.safetensors")
    for name, w in list(t.items()):
        for layer, parts in ((1, ("input_layernorm", "self_attn")),
                             (3, ("post_attention_layernorm", "mlp"))):
            rest = name.removeprefix(f"model.layers.{layer}.")
            if rest != name and rest.split(".")[0] in parts:
                w = w + rng.normal(0, 0.02, w.shape).astype(np.float32)
                if rest.endswith(("o_proj.weight", "down_proj.weight")):
                    w = w * 0.002
                t["mtp.layers.0." + rest] = w
    h = t["model.norm.weight"].shape[0]
    normed = _rms(t["model.embed_tokens.weight"][list(follows)], 0.0)
    rows = t["lm_head.weight"][list(follows.values())]
    proj = np.linalg.lstsq(normed, rows, rcond=None)[0].T  # proj @ normed[u] = rows[u]
    t.update({"mtp.fc.weight": np.concatenate([proj, rng.normal(0, 0.0005, (h, h))], 1),
              "mtp.pre_fc_norm_embedding.weight": np.zeros(h, np.float32),
              "mtp.pre_fc_norm_hidden.weight": rng.normal(0, 0.1, h).astype(np.float32),
              "mtp.norm.weight": np.zeros(h, np.float32)})
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.astype(np.float32) for k, v in t.items()}, out / "model.safetensors",
              metadata={"format": "pt"})
    shutil.copy(FIXTURE / "config.json", out / "config.json")
    return out


@pytest.fixture(scope="module")
def mtp_dir(tmp_path_factory, want):
    """A module that knows the target's greedy run (token -> the next: the first pair of a
    token that comes twice), the pairs WRONG wrong: its proposals are accepted in full, in part
    and not at all."""
    follows = {}
    seq = PROMPT[-1:] + TOKENS
    for j, (u, v) in enumerate(zip(seq, seq[1:])):
        follows.setdefault(u, (v + 1) % 384 if j in WRONG else v)
    return _with_mtp_module(tmp_path_factory.mktemp("qwen3_next_mtp"), follows)


def test_module_step_is_the_formula(target, mtp_dir):
    """Positions 0..n-2 as one paged prefill of the module against the dense formula (vLLM's
    qwen3_next_mtp): x = fc [norm_e(embed(x_{t+1})), norm_h(h_t)] (no mask at position 0),
    s = layer(x), the stream a next draft step reads is norm(s), logits = lm_head(norm(s)); the
    norms Qwen3-Next's (1 + w), the layer's MLP the family's MoE."""
    cfg, params = target
    proposer = load_mtp(str(mtp_dir), cfg, jnp.float32)
    mcfg, p = proposer.cfg, proposer.params
    assert mcfg.layer.layer_is_moe(0) and "shared_expert" in p["layers_0"]["moe"]
    tokens = np.asarray(PROMPT + TOKENS[:3], np.int32)
    n = len(tokens)
    hidden = np.random.default_rng(5).normal(0, 1, (n - 1, cfg.hidden_size)).astype(np.float32)
    embed = np.asarray(params["embed"]["embedding"])
    x = np.concatenate([_rms(embed[tokens[1:]], np.asarray(p["enorm"])),
                        _rms(hidden, np.asarray(p["hnorm"]))], -1) @ np.asarray(p["eh_proj"])
    pos = jnp.arange(n - 1)
    cos, sin = rope_tables(mcfg.layer, pos[None])
    layer = DecoderLayer(mcfg.layer, KernelTable(), jnp.float32, True)
    s, delta, _ = layer.apply({"params": p["layers_0"]}, jnp.asarray(x)[None], None, cos, sin)
    stream = _rms(np.asarray(s + delta)[0], np.asarray(p["final_norm"]["weight"]))
    want_logits = stream @ np.asarray(params["lm_head"]["kernel"])

    kv = allocate_kv_cache(mcfg.layer, 4, BLOCK, jnp.float32)
    md = AttentionMetadata(jnp.arange(n - 1, dtype=jnp.int32), jnp.asarray([0, n - 1], jnp.int32),
                           jnp.asarray([n - 1], jnp.int32), jnp.arange(4, dtype=jnp.int32)[None])
    logits, got_stream, _ = jax.jit(lambda *a: mcfg.step(*a, KernelTable()))(
        p, params["embed"]["embedding"], jnp.asarray(tokens[1:]), jnp.asarray(hidden), pos, kv, md)
    np.testing.assert_allclose(np.asarray(got_stream), stream, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(logits), want_logits, rtol=1e-4, atol=1e-4)


def test_mtp_greedy_equals_the_target_alone(target, want, mtp_dir, monkeypatch):
    """Accepted and rejected proposals through host-driven verifying steps (no on-device loop
    over states); an abort; then the same run with the states never rolled back differs."""
    cfg, params = target
    draft = load_mtp(str(mtp_dir), cfg, jnp.float32)
    engine = LLMEngine(cfg, params, None, _args(speculative_config=MTP), num_blocks=NUM_BLOCKS,
                       draft=draft)
    assert engine.spec.step.loop is None
    kinds, record = set(), engine.spec.metrics.record

    def spy(num_drafts, num_accepted):
        kinds.update("all" if a == n else "some" if a else "none"
                     for n, a in zip(num_drafts, num_accepted))
        record(num_drafts, num_accepted)
    monkeypatch.setattr(engine.spec.metrics, "record", spy)
    assert_same_outputs(_run(engine), want)
    assert kinds == {"all", "some", "none"}, kinds
    monkeypatch.undo()

    engine.add_request("aborted", PROMPT, SamplingParams(max_tokens=len(TOKENS), **GREEDY))
    for _ in range(5):
        engine.step()
    engine.abort("aborted")
    while engine.has_unfinished_requests():
        engine.step()
    assert_all_free(engine)

    kv = engine.scheduler.kv

    def keep_the_state(request_id, num_computed):
        req = kv._requests.get(request_id)
        if req is not None and req.verify is not None:
            kv._drop_verify(req.verify[2])
            req.verify = None
        return num_computed
    monkeypatch.setattr(kv, "settle_verify", keep_the_state)
    unrolled = _run(engine)
    with pytest.raises(AssertionError):
        assert_same_outputs(unrolled, want)


def test_eagle3_head_over_gated_deltanet_equals_the_target_alone(target, want):
    """A random EAGLE-3 head (its proposals rejected) reading three of the target's streams,
    Gated DeltaNet layers' among them."""
    cfg, params = target
    head_cfg, head_params = random_head(cfg)
    spec = {"method": "eagle3", "model": "in-process", "num_speculative_tokens": K}
    engine = LLMEngine(cfg, params, None, _args(speculative_config=spec), num_blocks=NUM_BLOCKS,
                       draft=EagleProposer(head_cfg, head_params))
    assert engine.spec.step.loop is None
    assert_same_outputs(_run(engine), want)
    m = engine.spec.metrics
    assert m.draft_tokens > m.accepted


def test_refusals(target):
    cfg, params = target
    with pytest.raises(ConfigError, match="--spec-loop-iterations 2: .*state-space"):
        LLMEngine(cfg, params, None, _args(speculative_config=MTP, spec_loop_iterations=2),
                  num_blocks=NUM_BLOCKS)
    assert _args(speculative_config=MTP).spec_config().method == "mtp"
    with pytest.raises(ConfigError, match="has no mtp.pre_fc_norm_embedding tensor"):
        load_mtp(str(FIXTURE), cfg, jnp.float32)


def test_a_gpu_keeps_the_automatic_decode_loop_off(target, monkeypatch):
    """fixed_state.automatic_decode_loop: over state-space layers on a GPU the automatic on-device
    decode loop stays off (its compile asked for the pool's size again on an H100); an explicit
    --decode-steps-per-call keeps its loop, and a CPU keeps the automatic one."""
    import jaxinfer.engine.llm_engine as llm_engine
    from jaxinfer.model.kernel_table import Platform
    cfg, params = target

    def loop_steps(**overrides) -> int:
        engine = LLMEngine(cfg, params, None, _args(**overrides), num_blocks=NUM_BLOCKS)
        return engine.scheduler.decode_steps_per_call

    assert loop_steps() == 8  # this CPU
    monkeypatch.setattr(llm_engine, "current_platform", lambda: Platform("gpu", (9, 0)))
    assert loop_steps() == 1
    assert loop_steps(decode_steps_per_call=4) == 4
