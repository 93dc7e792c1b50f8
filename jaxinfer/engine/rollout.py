"""Rollouts as arrays: `LLM.generate` results padded into the numpy arrays RL code trains on.

    outs = llm.generate(prompts, SamplingParams(n=4, temperature=1.0, max_tokens=64, logprobs=0))
    batch = to_rollout_batch(outs, max_completion_len=64)
    tokens, loss_mask, old_logprobs = batch.packed()   # for a dense training forward

One row per (prompt, choice), prompts in order and each prompt's choices in index order; `group`
says which prompt a row came from (what GRPO normalises advantages over). Padding is on the right,
with `pad_id`; masks say which entries are real. Lengths default to the longest in the batch; pass
fixed ones so a jitted training step sees one shape every iteration. Nothing is ever truncated.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable, Sequence

import numpy as np

from jaxinfer.core.outputs import RequestOutput, TokenLogprob
from jaxinfer.core.sampled_logprobs import LogprobsView


@dataclasses.dataclass
class RolloutBatch:
    prompt_ids: np.ndarray          # i32[B, P], right-padded
    prompt_mask: np.ndarray         # bool[B, P]
    completion_ids: np.ndarray      # i32[B, T], right-padded
    completion_mask: np.ndarray     # bool[B, T]
    logprobs: np.ndarray | None     # f32[B, T]: each sampled token's logprob (0 at padding)
    top_ids: np.ndarray | None      # i32[B, T, K]: the K most likely tokens (top_k given)
    top_logprobs: np.ndarray | None  # f32[B, T, K]
    finish_reasons: np.ndarray      # str[B]: "stop" | "length" | "abort" ("" while running)
    weight_versions: np.ndarray     # i32[B]: the engine weights that produced the row
    group: np.ndarray               # i32[B]: index of the row's prompt in the outputs list

    @property
    def prompt_lens(self) -> np.ndarray:
        return self.prompt_mask.sum(1).astype(np.int32)

    @property
    def completion_lens(self) -> np.ndarray:
        return self.completion_mask.sum(1).astype(np.int32)

    def packed(self, pad_id: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """Each row's prompt then completion from position 0, right-padded to P + T:
        (tokens i32[B, P+T], loss_mask bool[B, P+T-1], old_logprobs f32[B, P+T-1] or None), where
        column j of the last two refers to predicting tokens[:, j + 1] from tokens[:, :j + 1]: the
        alignment of `train_forward(params, cfg, tokens[:, :-1])` against targets tokens[:, 1:]."""
        b, p = self.prompt_ids.shape
        t = self.completion_ids.shape[1]
        tokens = np.full((b, p + t), pad_id, np.int32)
        tokens[:, :p][self.prompt_mask] = self.prompt_ids[self.prompt_mask]
        # Where each real completion token goes: right after its row's prompt.
        rows, cols = np.nonzero(self.completion_mask)
        dest = self.prompt_lens[rows] + cols
        tokens[rows, dest] = self.completion_ids[rows, cols]
        loss_mask = np.zeros((b, p + t - 1), bool)
        loss_mask[rows, dest - 1] = True
        old = None
        if self.logprobs is not None:
            old = np.zeros((b, p + t - 1), np.float32)
            old[rows, dest - 1] = self.logprobs[rows, cols]
        return tokens, loss_mask, old


def to_rollout_batch(outputs: list[RequestOutput], *, max_prompt_len: int | None = None,
                     max_completion_len: int | None = None, pad_id: int = 0,
                     top_k: int | None = None) -> RolloutBatch:
    """Pad final RequestOutputs (as `LLM.generate` returns them) into a RolloutBatch.

    Logprobs come from requests sampled with `logprobs` set (0: the sampled token's only; top_k
    needs logprobs >= top_k): all rows or none. Raises ValueError when a prompt or completion is
    longer than the length asked for, or logprobs are missing from some rows only."""
    rows = [(g, out, c) for g, out in enumerate(outputs) for c in out.outputs]
    if not rows:
        raise ValueError("no completions to batch")
    b = len(rows)
    prompt_lens = np.fromiter((len(out.prompt_token_ids) for _, out, _ in rows), np.int64, b)
    completion_lens = np.fromiter((len(c.token_ids) for _, _, c in rows), np.int64, b)
    p, t = int(prompt_lens.max()), max(int(completion_lens.max()), 1)
    for name, want, have in (("max_prompt_len", max_prompt_len, p),
                             ("max_completion_len", max_completion_len, t)):
        if want is not None and want < have:
            raise ValueError(f"{name}={want} is shorter than a row of {have} tokens")
    p, t = max_prompt_len or p, max_completion_len or t
    with_lp = [c.logprobs is not None and len(c.logprobs) == len(c.token_ids) for _, _, c in rows]
    if any(with_lp) and not all(with_lp):
        raise ValueError("some completions have logprobs and some not: sample all with logprobs")
    if top_k is not None and not all(with_lp):
        raise ValueError("top_k needs completions sampled with logprobs >= top_k")
    # Masks are prefixes of each row, so boolean indexing fills them with the rows' values
    # concatenated in row order: one numpy assignment per array, no per-row Python.
    prompt_mask = np.arange(p)[None, :] < prompt_lens[:, None]
    completion_mask = np.arange(t)[None, :] < completion_lens[:, None]
    n_prompt, n_completion = int(prompt_lens.sum()), int(completion_lens.sum())
    batch = RolloutBatch(
        prompt_ids=np.full((b, p), pad_id, np.int32), prompt_mask=prompt_mask,
        completion_ids=np.full((b, t), pad_id, np.int32), completion_mask=completion_mask,
        logprobs=np.zeros((b, t), np.float32) if all(with_lp) else None,
        top_ids=np.full((b, t, top_k), pad_id, np.int32) if top_k else None,
        top_logprobs=np.full((b, t, top_k), -np.inf, np.float32) if top_k else None,
        finish_reasons=np.array([c.finish_reason or "" for _, _, c in rows]),
        weight_versions=np.array([out.weight_version for _, out, _ in rows], np.int32),
        group=np.array([g for g, _, _ in rows], np.int32))
    batch.prompt_ids[prompt_mask] = np.fromiter(
        itertools.chain.from_iterable(out.prompt_token_ids for _, out, _ in rows), np.int32,
        n_prompt)
    batch.completion_ids[completion_mask] = np.fromiter(
        itertools.chain.from_iterable(c.token_ids for _, _, c in rows), np.int32, n_completion)
    if batch.logprobs is not None:
        batch.logprobs[completion_mask] = np.fromiter(
            itertools.chain.from_iterable(_values(c.logprobs) for _, _, c in rows), np.float32,
            n_completion)
    if top_k and n_completion:
        tops = [_top(c.logprobs, top_k) for _, _, c in rows if c.token_ids]
        fewest = min(ids.shape[1] for ids, _ in tops)
        if fewest < top_k:
            raise ValueError(f"top_k={top_k} but the completions were sampled with "
                             f"logprobs={fewest}")
        batch.top_ids[completion_mask] = np.concatenate([ids for ids, _ in tops])
        batch.top_logprobs[completion_mask] = np.concatenate([lps for _, lps in tops])
    return batch


# The engine's outputs hold LogprobsViews, read as flat lists; other sequences of TokenLogprob
# (outputs built by hand) go token by token.
def _values(lps: Sequence[TokenLogprob]) -> Iterable[float]:
    return lps.values() if isinstance(lps, LogprobsView) else (lp.logprob for lp in lps)


def _top(lps: Sequence[TokenLogprob], top_k: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids i32[len, <= top_k], logprobs f32[len, <= top_k]): fewer columns when sampled with
    fewer alternatives."""
    if isinstance(lps, LogprobsView):
        return lps.top(min(top_k, lps.k))
    width = min(top_k, min(len(lp.top) for lp in lps))
    pairs = np.array([lp.top[:width] for lp in lps], np.float64).reshape(len(lps), width, 2)
    return pairs[..., 0].astype(np.int32), pairs[..., 1].astype(np.float32)
