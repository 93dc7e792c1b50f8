"""The rejection sampler on given p / q (no model): emitted tokens follow the target distribution
(chi-square at temperature 1, with and without top-p), greedy accepts exactly the argmax prefix,
(also through the all-greedy fast path), and a row without proposals samples what the ordinary
sampler samples."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.worker.rejection_sampler import verify
from jaxinfer.worker.sampler import BASE_SAMPLER, FULL_SAMPLER, sample
from test_sampler import tensors

V = 6
N = 6000
# Chi-square critical values at significance 0.001 by degrees of freedom (fixed seeds: the test is
# deterministic; a wrong sampler is off by far more).
CHI2_CRIT = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52}

TARGET = np.array([[1.2, 0.3, -0.4, 0.9, -1.0, 0.1],
                   [-0.5, 1.0, 0.2, 0.0, 0.6, -1.2],
                   [0.3, 0.3, 0.3, -0.3, 1.5, 0.0]], np.float32)  # [K+1, V]
DRAFT = np.array([[0.2, 1.1, -0.2, 0.1, 0.4, -0.6],
                  [0.9, -0.3, 0.5, 0.0, -0.8, 0.2]], np.float32)    # [K, V]


# Jitted as the engine runs them (eagerly, every op compiles on its own: ~10 s a test).
_verify = jax.jit(verify, static_argnums=4)
_sample = jax.jit(sample, static_argnums=2)


def _softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _top_p_dist(logits, top_p):
    if logits.ndim > 1:
        return np.stack([_top_p_dist(row, top_p) for row in logits])
    p = _softmax(logits)
    order = np.argsort(-p)
    keep = np.zeros_like(p, bool)
    mass = 0.0
    for i in order:
        if mass < top_p:
            keep[i] = True
        mass += p[i]
    out = np.where(keep, p, 0)
    return out / out.sum()


def _chi2(counts, probs):
    support = probs > 0
    assert counts[~support].sum() == 0, "a token outside the target's support was emitted"
    n = counts.sum()
    expected = n * probs[support]
    return ((counts[support] - expected) ** 2 / expected).sum(), support.sum() - 1


def _run(point_mass: bool, top_p: float):
    """N rows sharing the logits, each with its own seed and its own proposals drawn from q."""
    rng = np.random.default_rng(0)
    q = _top_p_dist(DRAFT, top_p)
    # A point mass is exact whatever the proposal rule: here it ignores q after drawing from it.
    drafts = np.stack([rng.choice(V, N, p=q[j]) for j in range(2)], axis=1)
    logits = jnp.broadcast_to(jnp.asarray(TARGET), (N, 3, V))
    t = tensors(N, top_p=np.full(N, top_p, np.float32))
    probs = None if point_mass else jnp.broadcast_to(jnp.asarray(q, jnp.float32), (N, 2, V))
    out = _verify(logits, jnp.asarray(drafts, jnp.int32),
                                            jnp.full(N, 2, jnp.int32), t, FULL_SAMPLER, probs)
    return np.asarray(out.sampled.tokens), np.asarray(out.num_accepted), drafts


@pytest.mark.parametrize("point_mass", [False, True], ids=["draft_q", "point_mass"])
@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_emitted_tokens_follow_the_target_distribution(point_mass, top_p):
    tokens, accepted, drafts = _run(point_mass, top_p)
    target = _top_p_dist(TARGET, top_p)
    assert ((tokens >= 0).sum(0) == accepted + 1).all()
    # Position 0 is always emitted: it follows p_0.
    stat, df = _chi2(np.bincount(tokens[0], minlength=V), target[0])
    assert stat < CHI2_CRIT[df], (stat, df)
    # Position 1 is emitted iff proposal 0 was accepted; given that, it follows p_1.
    has1 = tokens[1] >= 0
    assert (tokens[0][has1] == drafts[has1, 0]).all()
    assert has1.sum() > 500
    stat, df = _chi2(np.bincount(tokens[1][has1], minlength=V), target[1])
    assert stat < CHI2_CRIT[df], (stat, df)


def test_acceptance_rate_matches_the_overlap_of_p_and_q():
    """P(accept proposal 0) = sum_x min(p(x), q(x)) for a draft sampled from q."""
    _, accepted, _ = _run(False, 1.0)
    expected = np.minimum(_softmax(TARGET[0]), _softmax(DRAFT[0])).sum()
    assert abs((accepted >= 1).mean() - expected) < 0.03


@pytest.mark.parametrize("variant", [BASE_SAMPLER, FULL_SAMPLER], ids=["base", "full"])
def test_greedy_accepts_exactly_the_argmax_prefix(variant):
    """Through the general path and the all-greedy fast path (greedy_only), which must agree on
    every output, logprobs included."""
    s = 4
    logits = jnp.asarray(np.random.default_rng(1).normal(size=(s, 4, V)), jnp.float32)
    best = np.asarray(jnp.argmax(logits, -1))
    drafts = best[:, :3].copy()
    drafts[1, 1] = (best[1, 1] + 1) % V  # row 1: rejected at position 1
    drafts[2, 0] = (best[2, 0] + 1) % V  # row 2: rejected at position 0
    num = np.array([3, 3, 3, 1], np.int32)  # row 3: one proposal only
    t = tensors(s, temperature=np.zeros(s, np.float32))
    out, fast = (jax.jit(verify, static_argnums=(4, 6))(
        logits, jnp.asarray(drafts, jnp.int32), jnp.asarray(num), t, variant, None, greedy)
        for greedy in (False, True))
    jax.tree_util.tree_map(np.testing.assert_array_equal, out, fast)
    toks = np.asarray(out.sampled.tokens).T
    assert list(np.asarray(out.num_accepted)) == [3, 1, 0, 1]
    np.testing.assert_array_equal(toks[0], best[0])
    np.testing.assert_array_equal(toks[1], [best[1, 0], best[1, 1], -1, -1])
    np.testing.assert_array_equal(toks[2], [best[2, 0], -1, -1, -1])
    np.testing.assert_array_equal(toks[3], [best[3, 0], best[3, 1], -1, -1])


def test_no_proposals_sample_what_the_sampler_samples():
    s = 64
    logits = jnp.asarray(np.random.default_rng(2).normal(size=(s, 3, V)), jnp.float32)
    t = tensors(s, out_pos=np.full(s, 5, np.int32), top_k=np.full(s, 4, np.int32))
    out = _verify(logits, jnp.zeros((s, 2), jnp.int32), jnp.zeros(s, jnp.int32), t, FULL_SAMPLER)
    plain = _sample(logits[:, 0], t, FULL_SAMPLER)
    np.testing.assert_array_equal(np.asarray(out.sampled.tokens[0]), np.asarray(plain.tokens))
    np.testing.assert_allclose(np.asarray(out.sampled.logprob[0]), np.asarray(plain.logprob),
                               rtol=1e-6)
    assert (np.asarray(out.sampled.tokens[1:]) == -1).all()


def test_penalties_count_the_proposals_before_each_position():
    """A large frequency penalty makes position j avoid every proposal before it: greedy rows then
    accept a repeated proposal only where it is not yet penalised."""
    s = 1
    logits = jnp.zeros((s, 3, V), jnp.float32).at[:, :, 2].set(1.0)  # token 2 is the argmax
    hist = np.full((s, 8), -1, np.int32)
    hist[0, :2] = [0, 1]  # prompt of 2 tokens
    t = tensors(s, temperature=np.zeros(s, np.float32), frequency_penalty=np.full(s, 5.0, np.float32),
                history=hist, prompt_len=np.full(s, 2, np.int32))
    out = _verify(logits, jnp.asarray([[2, 2]], jnp.int32), jnp.full(s, 2, jnp.int32), t, FULL_SAMPLER)
    # position 0 accepts 2; position 1 has 2 penalised by 5 -> argmax is 0 -> rejection emits 0
    assert np.asarray(out.sampled.tokens)[:, 0].tolist() == [2, 0, -1]
