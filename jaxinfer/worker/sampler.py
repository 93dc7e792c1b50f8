"""Token sampling inside the jitted step: one row of logits per sequence, each with its own parameters.

Per row: penalties (repetition / presence / frequency, vLLM's definitions) -> `min_tokens` ban of the
stop ids -> greedy (temperature 0) or temperature + top-k / top-p / min-p filtering + Gumbel-max
sampling. Logprobs are of the model's raw distribution (before penalties and temperature), as vLLM's
default `raw_logprobs`. Every variant returns the sampled token's logprob beside the token (one
log-sum-exp over the logits already on the device, so an RL rollout asking for `logprobs=0` runs the
base variant at the base variant's speed); only the top alternatives need the full variant.

Reproducibility: a row's random noise comes from `fold_in(fold_in(key(0), seed), output_position)`,
drawn in vocabulary order, so a seeded request samples the same tokens whatever else is in the batch,
whichever compiled variant runs it and however many decode steps run per host call.

Compiled variants (static `SamplerVariant`): the base variant is argmax(logits / T + gumbel), cheap;
`advanced` adds the vocabulary sort that top-k / top-p / min-p need plus top logprobs; `penalties` adds the
[S, V] token-count scatter; `masked` applies each row's packed token bitmask (structured output,
jaxinfer/structured/) to the logits before anything else, as vLLM applies its grammar bitmask, so
logprobs are of the constrained distribution too. Inside a variant, the sort, the scatter and the
logprobs' top-k run only when some row of the batch uses them (`lax.cond`). The engine
compiles three: BASE_SAMPLER, FULL_SAMPLER (both extras) and MASKED_SAMPLER (every extra and the
bitmask); it picks the base one whenever no row of the batch needs more and the masked one only for
a batch holding a constrained row, so unconstrained batches never carry a mask.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxinfer.sampling_params import MAX_LOGPROBS
from jaxinfer.structured.bitmask import apply_token_bitmask

NEG_INF = -jnp.inf


class SamplerVariant(NamedTuple):
    advanced: bool = False   # top-k / top-p / min-p and top logprobs
    penalties: bool = False  # repetition / presence / frequency penalties
    masked: bool = False     # a token bitmask per row (structured output)


BASE_SAMPLER = SamplerVariant(False, False)
FULL_SAMPLER = SamplerVariant(True, True)
MASKED_SAMPLER = SamplerVariant(True, True, True)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SamplingTensors:
    """Per-row sampling inputs, padded to the step's sequence bucket S (padding rows are greedy)."""
    temperature: jax.Array   # f32[S]; 0 = greedy
    top_k: jax.Array         # i32[S]; 0 = off
    top_p: jax.Array         # f32[S]; 1 = off
    min_p: jax.Array         # f32[S]; 0 = off
    seed: jax.Array          # u32[S]
    out_pos: jax.Array       # i32[S]: index of the token being sampled among the row's outputs
    min_tokens: jax.Array    # i32[S]: stop_ids are banned while out_pos < min_tokens
    stop_ids: jax.Array      # i32[S, K]: EOS (unless ignore_eos) + stop_token_ids; -1 = none
    # Alternatives each row reports with its logprob (advanced only; None: compute them).
    num_top_logprobs: jax.Array | None = None    # i32[S]
    # Penalty inputs (None unless SamplerVariant.penalties).
    repetition_penalty: jax.Array | None = None  # f32[S]
    presence_penalty: jax.Array | None = None    # f32[S]
    frequency_penalty: jax.Array | None = None   # f32[S]
    history: jax.Array | None = None             # i32[S, L]: prompt then output ids; -1 = none
    prompt_len: jax.Array | None = None          # i32[S]: how many leading history ids are prompt
    # Allowed tokens, packed (None unless SamplerVariant.masked); unconstrained rows allow all.
    token_bitmask: jax.Array | None = None       # i32[S, ceil(V/32)]


class SamplerOutput(NamedTuple):
    tokens: jax.Array              # i32[S]
    logprob: jax.Array | None      # f32[S]: raw logprob of the sampled token
    top_ids: jax.Array | None      # i32[S, MAX_LOGPROBS] (advanced only)
    top_logprobs: jax.Array | None  # f32[S, MAX_LOGPROBS] (advanced only)


def token_counts(history: jax.Array, prompt_len: jax.Array, vocab_size: int
                 ) -> tuple[jax.Array, jax.Array]:
    """(output-token counts i32[S, V], seen-anywhere mask bool[S, V]) from padded histories."""
    s, length = history.shape
    rows = jnp.broadcast_to(jnp.arange(s)[:, None], history.shape)
    ids = jnp.where(history < 0, vocab_size, history)  # padding -> dropped
    is_output = jnp.arange(length)[None, :] >= prompt_len[:, None]
    counts = jnp.zeros((s, vocab_size), jnp.int32).at[rows, ids].add(
        is_output.astype(jnp.int32), mode="drop")
    seen = jnp.zeros((s, vocab_size), jnp.bool_).at[rows, ids].set(True, mode="drop")
    return counts, seen


def apply_penalties(logits: jax.Array, counts: jax.Array, seen: jax.Array,
                    t: SamplingTensors) -> jax.Array:
    """vLLM's penalties: repetition divides positive / multiplies negative logits of every token seen
    in prompt or output; frequency subtracts count * f; presence subtracts p once per output token."""
    rep = t.repetition_penalty[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - t.frequency_penalty[:, None] * counts
    return logits - t.presence_penalty[:, None] * (counts > 0)


def ban_stop_ids(logits: jax.Array, t: SamplingTensors) -> jax.Array:
    """min_tokens: a row still short of its minimum cannot sample EOS or a stop token id."""
    s, v = logits.shape
    banned = (t.out_pos < t.min_tokens)[:, None] & (t.stop_ids >= 0)
    ids = jnp.where(banned, t.stop_ids, v)  # not banned -> out of range -> dropped
    rows = jnp.broadcast_to(jnp.arange(s)[:, None], ids.shape)
    return logits.at[rows, ids].set(NEG_INF, mode="drop")


def position_key(seed: jax.Array, out_pos: jax.Array) -> jax.Array:
    """The random key of one row's output position: sampling depends on (seed, position) only."""
    return jax.random.fold_in(jax.random.fold_in(jax.random.key(0), seed), out_pos)


def row_gumbel(seed: jax.Array, out_pos: jax.Array, vocab_size: int) -> jax.Array:
    """Gumbel noise f32[S, V] in vocabulary order, a function of (seed, output position) only."""
    def one(sd, pos):
        return jax.random.gumbel(position_key(sd, pos), (vocab_size,), jnp.float32)
    return jax.vmap(one)(seed, out_pos)


def truncation_cutoff(scaled: jax.Array, t: SamplingTensors) -> jax.Array:
    """The smallest logit each row keeps after top-k, top-p and min-p (f32[S, 1])."""
    v = scaled.shape[-1]
    sorted_logits = -jnp.sort(-scaled, axis=-1)  # descending
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    rank = jnp.arange(v)[None, :]
    keep = jnp.ones_like(sorted_logits, dtype=jnp.bool_)
    k = t.top_k[:, None]
    keep &= (k <= 0) | (rank < k)
    # top-p: keep a token while the mass before it is below p (so the first token always stays).
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep &= mass_before < t.top_p[:, None]
    keep &= probs >= t.min_p[:, None] * probs[:, :1]
    keep = keep.at[:, 0].set(True)
    # keep is a prefix of the sorted order, so the cutoff is the last kept sorted logit.
    last_kept = jnp.sum(keep, axis=-1, keepdims=True) - 1
    return jnp.take_along_axis(sorted_logits, last_kept, axis=-1)


def process_logits(logits: jax.Array, t: SamplingTensors, variant: SamplerVariant
                   ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The row transforms before the draw: -> (logits after penalties and the min_tokens ban,
    whose argmax is the greedy token; those logits / temperature with everything below the
    top-k / top-p / min-p cutoff at -inf, whose softmax is the distribution sampled; greedy
    bool[S]). Speculative verification applies the same transforms to target and draft."""
    v = logits.shape[-1]
    # The full variant runs for any row that needs one of its extras (logprobs, say); the costly
    # parts (the [S, V] count scatter, the vocabulary sort) are skipped on the device when no row
    # of the batch uses them, which leaves the result unchanged (neutral penalties, no cutoff).
    if variant.penalties:
        def penalised(lg):
            counts, seen = token_counts(t.history, t.prompt_len, v)
            return apply_penalties(lg, counts, seen, t)
        uses = jnp.any((t.repetition_penalty != 1) | (t.presence_penalty != 0)
                       | (t.frequency_penalty != 0))
        logits = jax.lax.cond(uses, penalised, lambda lg: lg, logits)
    logits = ban_stop_ids(logits, t)
    greedy = t.temperature <= 0.0
    scaled = logits / jnp.where(greedy, 1.0, t.temperature)[:, None]
    if variant.advanced:
        truncates = jnp.any((t.top_k > 0) | (t.top_p < 1) | (t.min_p > 0))
        cutoff = jax.lax.cond(truncates, lambda sc: truncation_cutoff(sc, t),
                              lambda sc: jnp.full((sc.shape[0], 1), NEG_INF, sc.dtype), scaled)
        scaled = jnp.where(scaled >= cutoff, scaled, NEG_INF)
    return logits, scaled, greedy


def sample(logits: jax.Array, t: SamplingTensors, variant: SamplerVariant) -> SamplerOutput:
    """logits f32[S, V] -> sampled tokens (and raw logprobs in the advanced variant)."""
    if variant.masked:  # the grammar's tokens only; logprobs too are of the constrained model
        logits = apply_token_bitmask(logits, t.token_bitmask)
    raw = logits
    logits, scaled, greedy = process_logits(logits, t, variant)
    # The noise (S x V draws) only when some row samples: an all-greedy batch skips it.
    sampled = jax.lax.cond(
        jnp.all(greedy), lambda sc: jnp.zeros(sc.shape[0], jnp.int32),
        lambda sc: jnp.argmax(sc + row_gumbel(t.seed, t.out_pos, sc.shape[-1]), axis=-1
                              ).astype(jnp.int32),
        scaled)
    tokens = jnp.where(greedy, jnp.argmax(logits, axis=-1), sampled).astype(jnp.int32)
    if not variant.advanced:
        return SamplerOutput(tokens, sampled_logprob(raw, tokens), None, None)
    return raw_logprobs(raw, tokens, t)


def sampled_logprob(raw: jax.Array, tokens: jax.Array, lse: jax.Array | None = None) -> jax.Array:
    """f32[S]: log_softmax(raw)[row, token] as raw[token] - logsumexp(raw): a reduction over the
    vocabulary and a gather, never an [S, V] log-softmax array. `lse`: f32[S] logsumexp(raw),
    when the caller has it already."""
    chosen = jnp.take_along_axis(raw, tokens[:, None], axis=-1)[:, 0]
    return chosen - (jax.nn.logsumexp(raw, axis=-1) if lse is None else lse)


def raw_logprobs(raw: jax.Array, tokens: jax.Array, t: SamplingTensors) -> SamplerOutput:
    """`tokens` with their logprobs under the raw model distribution and the top alternatives
    (computed like `sampled_logprob`, so a token's logprob is the same in every variant)."""
    v = raw.shape[-1]
    k = min(MAX_LOGPROBS, v)
    lse = jax.nn.logsumexp(raw, axis=-1)  # one pass over the vocabulary for both uses

    def top(lg):
        top_raw, top_ids = jax.lax.top_k(lg, k)
        return top_raw - lse[:, None], top_ids

    def no_top(lg):  # no row reports alternatives (RL rollouts ask for logprobs=0): skip top-k
        return jnp.full((lg.shape[0], k), NEG_INF, lg.dtype), jnp.zeros((lg.shape[0], k), jnp.int32)

    wants_top = True if t.num_top_logprobs is None else jnp.any(t.num_top_logprobs > 0)
    top_lp, top_ids = jax.lax.cond(wants_top, top, no_top, raw)
    return SamplerOutput(tokens, sampled_logprob(raw, tokens, lse), top_ids.astype(jnp.int32),
                         top_lp)
