"""What the engine hands back for a request: per-choice text and token deltas, finish reasons, usage.

These are the streaming units of `LLMEngine.step()` and `AsyncEngine.generate()`; `LLM.generate`
returns the final RequestOutput of each prompt, whose `outputs` then hold every choice in index
order.
"""

from __future__ import annotations

import collections.abc
import dataclasses
from collections.abc import Sequence


class IdsSoFar(collections.abc.Sequence):
    """`ids[start:n]` of a list that only grows, `n` its length when the view was made: a choice's
    token_ids as of one output, without copying them (a stream may read an output after later
    ones were made)."""

    __slots__ = ("_ids", "_start", "_n")

    def __init__(self, ids: list[int], start: int = 0):
        self._ids, self._start, self._n = ids, start, len(ids) - start

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, index):
        if isinstance(index, slice):
            return self._ids[self._start:self._start + self._n][index]
        if not -self._n <= index < self._n:
            raise IndexError("token index out of range")
        return self._ids[self._start + index % self._n]

    def __iter__(self):
        return iter(self._ids[self._start:self._start + self._n])

    def __eq__(self, other) -> bool:
        if isinstance(other, (IdsSoFar, list, tuple)):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    __hash__ = None

    def __add__(self, other) -> list[int]:  # (`prompt + out.token_ids` as with a list)
        return list(self) + list(other)

    def __radd__(self, other) -> list[int]:
        return list(other) + list(self)

    def __repr__(self) -> str:
        return f"IdsSoFar({list(self)!r})"


@dataclasses.dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the `logprobs` most likely alternatives (id, logprob), best first
    rank: int | None = None  # 1 + how many tokens are likelier (prompt logprobs only)


@dataclasses.dataclass
class CompletionOutput:
    index: int                      # choice index (0..n-1)
    text: str                       # all text generated so far (stop strings removed unless included)
    token_ids: Sequence[int]        # all generated ids so far (an IdsSoFar view from the engine)
    new_text: str                   # text since the previous RequestOutput of this choice
    new_token_ids: list[int]        # ids since the previous RequestOutput of this choice
    # One per new token when logprobs was requested. From the engine: LogprobsView sequences
    # (sampled_logprobs.py), whose TokenLogprobs are made on access.
    new_logprobs: Sequence[TokenLogprob] | None
    finish_reason: str | None       # None while running; "stop" | "length" | "abort"
    stop_reason: int | str | None   # the stop token id or stop string that ended it, if any
    logprobs: Sequence[TokenLogprob] | None = None  # one per token of token_ids, when requested

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]  # only the choices that changed since the previous output
    finished: bool                   # True once every choice has finished
    num_prompt_tokens: int
    num_generated_tokens: int        # usage so far (all choices)
    # SamplingParams.prompt_logprobs: one entry per prompt token (None for the first), complete
    # from the first output on; None when not requested.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    num_cached_tokens: int = 0       # prompt tokens served from the prefix cache
    # Which weights produced the tokens: 0 as loaded, +1 per LLMEngine.update_weights. A request
    # runs on one version only (an update aborts the requests in flight).
    weight_version: int = 0
    # An embedding request's pooled hidden state (SamplingParams.pooling), once it has finished:
    # raw (not normalized), float32 values as Python floats.
    embedding: list[float] | None = None


def merge_outputs(first: RequestOutput, later: RequestOutput) -> RequestOutput:
    """Two consecutive outputs of one request as one: each choice's deltas joined (text, ids,
    logprobs), everything cumulative (text, token_ids, usage, finish) from `later`. A streaming
    consumer that fell behind sends one event for both (vLLM's RequestOutputCollector)."""
    choices = {c.index: c for c in first.outputs}
    for c in later.outputs:
        before = choices.get(c.index)
        if before is not None:
            c = dataclasses.replace(
                c, new_text=before.new_text + c.new_text,
                new_token_ids=[*before.new_token_ids, *c.new_token_ids],
                new_logprobs=_joined(before.new_logprobs, c.new_logprobs))
        choices[c.index] = c
    return dataclasses.replace(later, outputs=[choices[i] for i in sorted(choices)])


def _joined(a: Sequence | None, b: Sequence | None) -> Sequence | None:
    if a is None or b is None:
        return b if a is None else a
    follows = getattr(a, "followed_by", None)
    joined = follows(b) if follows is not None else None
    return joined if joined is not None else [*a, *b]
