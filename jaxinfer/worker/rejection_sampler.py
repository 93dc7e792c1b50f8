"""Exact speculative verification: k proposed tokens per row against the target's k + 1 logits.

A row proposes `d_0 .. d_{k-1}` (a draft model's samples from its distributions `q_j`, or an
n-gram match, a point mass `q_j = onehot(d_j)`). The target's forward gives logits at k + 1
positions; `p_j` is the target's distribution at position j after the request's own transforms
(penalties counting the proposals before j, the min_tokens ban, temperature, top-k / top-p /
min-p: `sampler.process_logits`, the same code the ordinary sampler runs). Then, in order:

- `d_j` is accepted with probability min(1, p_j(d_j) / q_j(d_j)) (a point mass: p_j(d_j));
- at the first rejection the row emits a sample of the normalised residual (p_j - q_j)+ (a point
  mass: p_j with d_j removed) and stops;
- when all k are accepted it emits a bonus sample of p_k.

So every row emits 1 + accepted tokens, distributed exactly as the target would sample them one at
a time (Leviathan et al. 2023, Chen et al. 2023). Greedy rows accept `d_j` iff it is the argmax.
A row with k = 0 emits the plain sample of p_0: the same token `sampler.sample` draws.

Randomness follows the sampler's rule (a function of the row's seed and output position only):
position j uses `row_gumbel(seed, out_pos + j)` for its sample, and an independent uniform (a
further `fold_in`) for its accept test.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxinfer.structured.bitmask import apply_token_bitmask
from jaxinfer.worker.sampler import (SamplerOutput, SamplerVariant, SamplingTensors,
                                     position_key, process_logits, raw_logprobs, row_gumbel,
                                     sampled_logprob)

_UNIFORM_STREAM = 0x5EC0  # folded into a position's key: the accept test's stream


def row_uniform(seed: jax.Array, out_pos: jax.Array) -> jax.Array:
    """U[0, 1) per row, independent of `row_gumbel(seed, out_pos)`."""
    def one(sd, pos):
        key = jax.random.fold_in(position_key(sd, pos), _UNIFORM_STREAM)
        return jax.random.uniform(key, (), jnp.float32)
    return jax.vmap(one)(seed, out_pos)


def expand_positions(t: SamplingTensors, drafts: jax.Array) -> SamplingTensors:
    """Per-row tensors -> per-(row, position) tensors, [S * (K + 1)] rows, row-major: position j
    samples output index out_pos + j, and its penalty history holds the proposals before j."""
    s, k = drafts.shape
    k1 = k + 1
    j = jnp.tile(jnp.arange(k1, dtype=jnp.int32), s)

    def rep(x):
        return None if x is None else jnp.repeat(x, k1, axis=0)

    out = jax.tree_util.tree_map(rep, t)
    out = dataclasses.replace(out, out_pos=out.out_pos + j)
    if t.history is not None:
        length = t.history.shape[1]
        known = jnp.sum(t.history >= 0, axis=1)                       # [S]
        col = jnp.arange(length)[None, None, :] - known[:, None, None]  # [S, 1, L]
        take = (col >= 0) & (col < jnp.arange(k1)[None, :, None])        # [S, K+1, L]
        proposed = jnp.take_along_axis(
            drafts[:, None, :], jnp.clip(col, 0, max(k - 1, 0)), axis=2) if k else col
        hist = jnp.where(take, proposed, t.history[:, None, :])
        out = dataclasses.replace(out, history=hist.reshape(s * k1, length))
    return out


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class VerifyOutput:
    sampled: SamplerOutput    # fields [K + 1, S, ...]: emitted tokens, -1 past a row's last
    num_accepted: jax.Array   # i32[S]: proposals accepted (the row emits num_accepted + 1)


def verify(logits: jax.Array, drafts: jax.Array, num_drafts: jax.Array, t: SamplingTensors,
           variant: SamplerVariant, draft_probs: jax.Array | None = None,
           greedy_only: bool = False) -> VerifyOutput:
    """logits f32[S, K+1, V] (the target at each row's k + 1 positions), drafts i32[S, K] with
    num_drafts i32[S] of them real, draft_probs f32[S, K, V] (None: each proposal is a point mass),
    t: the rows' tensors with out_pos at the first position -> the emitted tokens.
    `greedy_only` (static): every row is greedy, so only the argmax is computed (the same tokens;
    no distribution, noise or residual)."""
    s, k1, v = logits.shape
    flat_t = expand_positions(t, drafts)
    raw = logits.reshape(s * k1, v)
    if variant.masked:  # a grammar's row shares the step with speculating rows: keep its mask
        raw = apply_token_bitmask(raw, flat_t.token_bitmask)
    processed, scaled, greedy = process_logits(raw, flat_t, variant)
    processed, scaled = processed.reshape(s, k1, v), scaled.reshape(s, k1, v)
    greedy = greedy.reshape(s, k1)[:, 0]
    if greedy_only:
        return _verify_greedy(raw, processed, drafts, num_drafts, flat_t, variant)
    p = jax.nn.softmax(scaled, axis=-1)
    noise = row_gumbel(flat_t.seed, flat_t.out_pos, v).reshape(s, k1, v)
    argmax = jnp.argmax(processed, axis=-1).astype(jnp.int32)              # [S, K+1]
    plain = jnp.argmax(scaled + noise, axis=-1).astype(jnp.int32)          # a sample of p_j

    d = jnp.concatenate([drafts, jnp.zeros((s, 1), drafts.dtype)], axis=1)  # [S, K+1]
    if draft_probs is None:
        q = jax.nn.one_hot(d, v, dtype=p.dtype)
    else:
        q = jnp.concatenate([draft_probs, jnp.zeros((s, 1, v), p.dtype)], axis=1)
    p_d = jnp.take_along_axis(p, d[..., None], axis=-1)[..., 0]
    q_d = jnp.take_along_axis(q, d[..., None], axis=-1)[..., 0]
    u = row_uniform(flat_t.seed, flat_t.out_pos).reshape(s, k1)
    accept = jnp.where(greedy[:, None], d == argmax, u * q_d < p_d)
    real = jnp.arange(k1)[None, :] < num_drafts[:, None]
    accept &= real
    num_accepted = jnp.sum(jnp.cumprod(accept.astype(jnp.int32), axis=1), axis=1)

    residual = jnp.maximum(p - q, 0.0)
    has_mass = jnp.sum(residual, axis=-1) > 0
    resampled = jnp.argmax(jnp.log(residual) + noise, axis=-1).astype(jnp.int32)
    resampled = jnp.where(has_mass, resampled, plain)
    # The token at the first non-accepted position: a residual sample after a rejection, the plain
    # sample of p after the last proposal (the bonus token; with no proposals, the usual sample).
    last = jnp.where(greedy[:, None], argmax, jnp.where(real, resampled, plain))
    return _emitted(raw, d, last, num_accepted, flat_t, variant)


def _verify_greedy(raw, processed, drafts, num_drafts, flat_t: SamplingTensors,
                   variant: SamplerVariant) -> VerifyOutput:
    """`verify` for rows that are all greedy: a proposal is accepted iff it is the argmax, and the
    argmax follows the last accepted one."""
    s, k1, _ = processed.shape
    argmax = jnp.argmax(processed, axis=-1).astype(jnp.int32)              # [S, K+1]
    d = jnp.concatenate([drafts, jnp.zeros((s, 1), drafts.dtype)], axis=1)
    accept = (d == argmax) & (jnp.arange(k1)[None, :] < num_drafts[:, None])
    num_accepted = jnp.sum(jnp.cumprod(accept.astype(jnp.int32), axis=1), axis=1)
    return _emitted(raw, d, argmax, num_accepted, flat_t, variant)


def _emitted(raw, d, last, num_accepted, flat_t: SamplingTensors,
             variant: SamplerVariant) -> VerifyOutput:
    """Each row's accepted proposals `d`, then `last` at the first non-accepted position, -1 past
    it ([K + 1, S] fields), with their logprobs."""
    s, k1 = d.shape
    pos = jnp.arange(k1)[None, :]
    tokens = jnp.where(pos < num_accepted[:, None], d,
                       jnp.where(pos == num_accepted[:, None], last, -1)).astype(jnp.int32)

    def by_position(a):
        return jnp.swapaxes(a.reshape(s, k1, *a.shape[1:]), 0, 1)
    flat_tokens = jnp.maximum(tokens, 0).reshape(-1)
    if not variant.advanced:
        return VerifyOutput(SamplerOutput(tokens.T, by_position(sampled_logprob(raw, flat_tokens)),
                                          None, None), num_accepted)
    lp = raw_logprobs(raw, flat_tokens, flat_t)
    return VerifyOutput(SamplerOutput(tokens.T, by_position(lp.logprob), by_position(lp.top_ids),
                                      by_position(lp.top_logprobs)), num_accepted)


DRAFT_STREAM = 0x0D5AF7ED  # xor-ed into a row's seed for the draft's own noise


def propose_tokens(logits, ti: SamplingTensors, *, variant: SamplerVariant,
                   greedy_only: bool = False):
    """One draft position of S rows (a draft model's or an EAGLE head's logits): -> (proposals
    i32[S], their distributions q f32[S, V]) under the request's transforms; greedy rows propose
    the argmax, a point mass. `greedy_only` (static: every row is greedy): q is None."""
    processed, scaled, greedy = process_logits(logits, ti, variant)
    best = jnp.argmax(processed, axis=-1).astype(jnp.int32)
    if greedy_only:
        return best, None
    noise = row_gumbel(ti.seed ^ jnp.uint32(DRAFT_STREAM), ti.out_pos, logits.shape[-1])
    d = jnp.where(greedy, best, jnp.argmax(scaled + noise, axis=-1).astype(jnp.int32))
    q = jnp.where(greedy[:, None], jax.nn.one_hot(best, logits.shape[-1], dtype=jnp.float32),
                  jax.nn.softmax(scaled, axis=-1))
    return d, q
