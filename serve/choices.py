"""Pieces the completions and chat endpoints share: choice numbering across prompts, usage counts,
accumulating a choice over a stream of outputs, and token strings for logprobs."""

from __future__ import annotations

import dataclasses
import time
import uuid

from jaxinfer.core.outputs import CompletionOutput, RequestOutput, TokenLogprob

# JSON has no -Infinity; vLLM clamps logprobs the same way.
MIN_LOGPROB = -9999.0


def new_response_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def safe_logprob(x: float) -> float:
    return x if x > MIN_LOGPROB else MIN_LOGPROB  # also maps NaN and -inf to the floor


def token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def choice_index(prompt_index: int, output_index: int, n: int) -> int:
    """Choices of a multi-prompt request are numbered prompt by prompt, as in vLLM."""
    return prompt_index * n + output_index


class UsageCounter:
    """Tokens in, tokens out, over every prompt of one API request."""

    def __init__(self, prompts: list[list[int]], count_generated: bool = True):
        self.prompt_tokens = sum(len(p) for p in prompts)
        self._generated = [0] * len(prompts)
        self._cached = [0] * len(prompts)
        self._count_generated = count_generated  # False: the response leaves them out

    def update(self, prompt_index: int, out: RequestOutput) -> None:
        self._cached[prompt_index] = out.num_cached_tokens
        if self._count_generated:
            self._generated[prompt_index] = out.num_generated_tokens

    def as_dict(self) -> dict:
        completion = sum(self._generated)
        return {"prompt_tokens": self.prompt_tokens, "total_tokens": self.prompt_tokens + completion,
                "completion_tokens": completion,
                "prompt_tokens_details": {"cached_tokens": sum(self._cached)}}


@dataclasses.dataclass
class ChoiceState:
    """One choice accumulated over every output (for the non-streaming responses)."""
    text: str = ""
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None

    def add(self, c: CompletionOutput) -> None:
        self.text = c.text
        self.token_ids = c.token_ids  # (no copy per output: the last one holds every id)
        if c.new_logprobs:
            self.logprobs.extend(c.new_logprobs)
        self.finish_reason = c.finish_reason
        self.stop_reason = c.stop_reason


async def collect_choices(group, n: int, usage: UsageCounter) -> list[tuple[int, int, ChoiceState]]:
    """Run a RequestGroup to the end: [(choice index, prompt index, state)] in choice order."""
    states: dict[int, tuple[int, ChoiceState]] = {}
    async for prompt_index, out in group.outputs():
        usage.update(prompt_index, out)
        for c in out.outputs:
            idx = choice_index(prompt_index, c.index, n)
            state = states.setdefault(idx, (prompt_index, ChoiceState()))[1]
            state.add(c)
            state.prompt_logprobs = out.prompt_logprobs
    return [(idx, pi, state) for idx, (pi, state) in sorted(states.items())]
