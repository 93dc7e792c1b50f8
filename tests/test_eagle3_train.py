"""EAGLE-3 training on CPU: a tiny run of the training-time-test update lowers its loss; the
TTT forward's step j equals the served chain's step j (same keys: real positions <= t, then the
chain's own); the engine's proposals equal the dense head's (what training optimises is what
serving proposes)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.model.transformer import forward_aux
from jaxinfer.spec_decode import eagle_head as head
from jaxinfer.spec_decode import eagle_train as train
from test_eagle3 import random_head
from test_engine_support import tiny_model

# (eagerly, each op of the target's forward compiles on its own)
_forward_aux = jax.jit(forward_aux, static_argnums=1, static_argnames="layers")


def test_tiny_training_run_lowers_its_loss():
    target_cfg, target_params = tiny_model()
    cfg, hp = random_head(target_cfg, std=0.02)
    s = train.TrainSettings(k=2, lr=3e-3, warmup_steps=2, total_steps=30, compute_dtype="float32")
    step, opt = train.make_train_step(cfg, target_cfg, s)
    tokens = jax.random.randint(jax.random.key(1), (4, 16), 2, target_cfg.vocab_size)
    mask = jnp.ones(tokens.shape, jnp.float32)
    w = train.trainable(hp)
    state = opt.init(w)
    losses = []
    for _ in range(30):
        w, state, loss, agree = step(w, state, hp["d2t"], target_params,
                                     target_params["embed"]["embedding"], tokens, mask)
        losses.append(float(loss))
    assert np.isfinite(losses).all() and agree.shape == (2,)
    # The floor is the target's own entropy (soft labels), well above 0: 10% is most of the way.
    assert losses[-1] < 0.9 * losses[0], losses


def test_ttt_steps_equal_the_served_chain():
    """Step j at index t of the TTT forward == the chain rooted at t, run step by step with
    explicit keys (step 0's at positions <= t, then the chain's own), as the proposer runs it."""
    target_cfg, target_params = tiny_model()
    cfg, hp = random_head(target_cfg, std=0.2)
    embed = target_params["embed"]["embedding"]
    tokens = jax.random.randint(jax.random.key(2), (1, 10), 2, target_cfg.vocab_size)
    _, _, aux = _forward_aux(target_params, target_cfg, tokens, None, None, None,
                             layers=cfg.aux_layers)
    k, n = 3, tokens.shape[1]
    keys, values, outs = [], [], []
    hidden = head.fuse(hp, aux)
    pos = jnp.arange(n)[None]
    for j in range(k):
        normed, hidden = head.layer(hp, cfg, embed, train._shift(tokens, 1 + j), hidden, pos + j,
                                    train._ttt_attend(keys, values, cfg.layer.score_scale))
        outs.append(normed)
    t = 4
    group = cfg.layer.num_heads // cfg.layer.num_kv_heads
    chain_k, chain_v = [keys[0][0, :t + 1]], [values[0][0, :t + 1]]
    h = head.fuse(hp, aux[0, t])[None]
    tok = tokens[0, t + 1]
    for j in range(k):
        def attend(q, kk, vv):
            ks = jnp.concatenate(chain_k + ([kk] if j else []), 0)
            vs = jnp.concatenate(chain_v + ([vv] if j else []), 0)
            if j:
                chain_k.append(kk)
                chain_v.append(vv)
            ks, vs = jnp.repeat(ks, group, 1), jnp.repeat(vs, group, 1)
            p = jax.nn.softmax(jnp.einsum("qhd,khd->hqk", q, ks) * cfg.layer.score_scale, -1)
            return jnp.einsum("hqk,khd->qhd", p, vs)
        normed, h = head.layer(hp, cfg, embed, tok[None], h, jnp.array([t + j]), attend)
        np.testing.assert_allclose(normed[0], outs[j][0, t], atol=1e-4, rtol=1e-4)
        tok = tokens[0, t + 2 + j]


def test_served_proposals_equal_the_dense_head():
    """Through the engine (greedy, k = 2): each verifying step's first proposal for a decode at
    position s is the dense (TTT step 0) head's argmax at index s - 1 over the final sequence; the
    second, where the first was the true token, is TTT step 1's -- the stream cache, catch-up and
    chain read what training reads."""
    from jaxinfer.sampling_params import SamplingParams
    from jaxinfer.spec_decode.eagle import EagleProposer
    from test_eagle3 import tiny_engine
    from test_engine_support import prompt_ids, run_all

    target_cfg, target_params = tiny_model()
    cfg, hp = random_head(target_cfg, std=0.3)
    seen = []

    class Recording(EagleProposer):
        def propose(self, sched, batch, v, variant):
            v, q = super().propose(sched, batch, v, variant)
            drafts = np.asarray(v.drafts)
            seen.extend((e.start, drafts[r].tolist()) for r, e in enumerate(sched.decodes)
                        if e.proposal)
            return v, q

    e = tiny_engine(Recording(cfg, hp), spec_loop_iterations=1)  # host-driven: `propose` runs
    e.add_request("a", prompt_ids(3, 9), SamplingParams(max_tokens=14, temperature=0.0,
                                                        ignore_eos=True))
    out = run_all(e)["a"][0][0]
    tokens = jnp.asarray([prompt_ids(3, 9) + out])
    embed = target_params["embed"]["embedding"]
    _, _, aux = _forward_aux(target_params, target_cfg, tokens, None, None, None,
                             layers=cfg.aux_layers)
    keys, values, best = [], [], []
    hidden = head.fuse(hp, aux)
    pos = jnp.arange(tokens.shape[1])[None]
    for j in range(2):
        normed, hidden = head.layer(hp, cfg, embed, train._shift(tokens, 1 + j), hidden, pos + j,
                                    train._ttt_attend(keys, values, cfg.layer.score_scale))
        best.append(np.asarray(jnp.argmax(head.target_logits(hp, normed, embed.shape[0]), -1))[0])
    assert len(seen) >= 4
    for s, (d1, d2) in seen:
        assert d1 == best[0][s - 1], (s, d1)
        if d1 == int(tokens[0, s + 1]):  # (a random head: seldom)
            assert d2 == best[1][s - 1], (s, d2)
