"""Prompt logprobs: the logprob of each prompt token given the tokens before it, computed in the
step that prefills it.

The forward normally makes logits only at each row's last token. A step holding prompt tokens of a
request that asked for prompt logprobs runs the forward variant that also returns the final hidden
states (`return_hidden`, a static flag: other steps compile and run as before), and then
`prompt_logprobs_fn`: for the P hidden rows that predict a prompt token (P padded to a power of two)
it applies the LM head a chunk of rows at a time, takes the log-softmax and keeps only the target
token's logprob and rank and the top MAX_LOGPROBS alternatives. No prompt x vocabulary array ever
exists, on the device (one chunk x vocabulary at a time) or on the host (P x (2 + 2K) numbers).

Which rows: a row at position j of a sequence predicts token j + 1; it is a prompt token when
j + 1 < prompt length (the last prompt position predicts the first generated token instead). An
n > 1 prompt sequence covers the prompt minus its last token, so the logprobs are computed once per
request; a recomputation after preemption writes the same values again.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.core.outputs import TokenLogprob
from jaxinfer.model.config import ModelConfig
from jaxinfer.model.transformer import lm_head
from jaxinfer.sampling_params import MAX_LOGPROBS
from jaxinfer.worker.buckets import pow2_rows

# Rows whose [rows, vocab] logits exist at once on the device.
ROW_CHUNK = 64
MIN_ROWS = 16


@dataclasses.dataclass
class PromptLogprobRows:
    """The rows of one step that predict prompt tokens of requests that asked (host data)."""
    token_index: np.ndarray   # i32[P]: row in the step's flat token array; padding 0
    targets: np.ndarray       # i32[P]: the prompt token each row predicts; padding 0
    owners: list[tuple[object, int]]  # (request, prompt position of the target), one per real row


def gather_rows(rows) -> PromptLogprobRows | None:
    """From a step's scheduled sequences (decodes first, then prefills: the flat token order of
    `build_step_batch`), the rows that predict prompt tokens of requests asking for prompt
    logprobs; None when there are none (the usual case: one attribute test per row)."""
    index: list[int] = []
    targets: list[int] = []
    owners: list[tuple[object, int]] = []
    offset = 0
    for entry in rows:
        req = entry.seq.request
        if req.prompt_logprobs is not None:
            prompt = req.prompt_token_ids
            for j in range(entry.start, min(entry.start + entry.num_tokens, len(prompt) - 1)):
                index.append(offset + j - entry.start)
                targets.append(prompt[j + 1])
                owners.append((req, j + 1))
        offset += entry.num_tokens
    if not owners:
        return None
    size = pow2_rows(len(owners), MIN_ROWS)
    token_index = np.zeros(size, np.int32)
    token_index[:len(index)] = index
    target_ids = np.zeros(size, np.int32)
    target_ids[:len(targets)] = targets
    return PromptLogprobRows(token_index, target_ids, owners)


def prompt_logprobs(params, hidden: jax.Array, token_index: jax.Array, targets: jax.Array, *,
                    cfg: ModelConfig) -> dict[str, jax.Array]:
    """hidden [T, H] (final-normed), token_index / targets i32[P] -> the targets' logprobs and
    ranks and the top MAX_LOGPROBS alternatives of each row."""
    rows = hidden[token_index]
    k = min(MAX_LOGPROBS, cfg.vocab_size)

    def one(args):
        h, target = args
        logprobs = jax.nn.log_softmax(lm_head(params, cfg, h[None])[0])
        chosen = logprobs[target]
        rank = 1 + jnp.sum(logprobs > chosen).astype(jnp.int32)
        top_lp, top_ids = jax.lax.top_k(logprobs, k)
        return chosen, rank, top_ids.astype(jnp.int32), top_lp

    chosen, rank, top_ids, top_lp = jax.lax.map(one, (rows, targets),
                                                batch_size=min(ROW_CHUNK, rows.shape[0]))
    return {"logprob": chosen, "rank": rank, "top_ids": top_ids, "top_logprobs": top_lp}


@functools.lru_cache(maxsize=None)
def prompt_logprobs_fn(cfg: ModelConfig):
    return jax.jit(functools.partial(prompt_logprobs, cfg=cfg))


def record(sel: PromptLogprobRows, out: dict[str, np.ndarray]) -> None:
    """Write a finished step's prompt logprobs into their requests (`Request.prompt_logprobs`)."""
    lp, rank = out["logprob"].tolist(), out["rank"].tolist()
    top_ids, top_lp = out["top_ids"], out["top_logprobs"]
    targets = sel.targets.tolist()
    for i, (req, pos) in enumerate(sel.owners):
        k = req.params.prompt_logprobs
        req.prompt_logprobs[pos] = TokenLogprob(
            targets[i], lp[i], list(zip(top_ids[i, :k].tolist(), top_lp[i, :k].tolist())), rank[i])
