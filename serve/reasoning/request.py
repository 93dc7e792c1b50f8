"""A chat request's reasoning: the server's `--reasoning-parser`, the request's `include_reasoning`,
and the per-choice split of the output into reasoning and content, whole or streamed."""

from __future__ import annotations

import argparse
import dataclasses

from aiohttp import web

from jaxinfer.structured.params import StructuredOutputsParams
from serve.errors import bad_request
from serve.reasoning.parsers import REASONING_PARSERS, ReasoningParser
from serve.reasoning.splitter import MarkerSplitter

REASONING_PARSER: web.AppKey[ReasoningParser | None] = web.AppKey("reasoning_parser")


def add_reasoning_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--reasoning-parser", choices=sorted(REASONING_PARSERS), default=None,
                   help="split the model's reasoning from its answer in chat and Responses output: "
                        "deepseek_r1 and qwen3 (<think> ... </think>), gpt_oss (harmony channels)")


def parser_from_args(args: argparse.Namespace) -> ReasoningParser | None:
    name = getattr(args, "reasoning_parser", None)
    return REASONING_PARSERS[name]() if name else None


@dataclasses.dataclass
class ReasoningRequest:
    parser: ReasoningParser
    prompt_text: str       # the rendered prompt (whether the template opened a think block)
    include: bool = True   # include_reasoning: false drops the reasoning from the response

    def split(self, text: str) -> tuple[str | None, str | None]:
        reasoning, content = self.parser.split(text, self.prompt_text)
        return (reasoning if self.include else None), content

    def stream(self) -> "ReasoningStream":
        return ReasoningStream(self.parser.stream(self.prompt_text), self.include)


class ReasoningStream:
    """One choice's streamed split: (reasoning delta, content delta) per text delta."""

    def __init__(self, splitter: MarkerSplitter, include: bool):
        self._splitter = splitter
        self._include = include

    def feed(self, delta: str, finished: bool) -> tuple[str, str]:
        reasoning, content = self._splitter.feed(delta)
        if finished:
            more_r, more_c = self._splitter.finish()
            reasoning, content = reasoning + more_r, content + more_c
        return (reasoning if self._include else ""), content


def reasoning_request(body: dict, parser: ReasoningParser | None,
                      prompt_text: str) -> ReasoningRequest | None:
    """The request's reasoning split, or None without a parser."""
    if parser is None:
        return None
    include = body.get("include_reasoning", True)
    if include is None:
        include = True
    if not isinstance(include, bool):
        raise bad_request(f"include_reasoning={include!r}: must be true or false", "include_reasoning")
    return ReasoningRequest(parser, prompt_text, include)


def constrain_answer_only(structured: StructuredOutputsParams | None, reasoning: ReasoningRequest | None,
                          tokenizer) -> StructuredOutputsParams | None:
    """A structured-output constraint of a reasoning request applies to the answer, not the
    thinking (as in vLLM): the engine starts the grammar after the parser's end-of-reasoning
    marker, which travels with the request as token ids."""
    if structured is None or reasoning is None:
        return structured
    marker = reasoning.parser.answer_marker(reasoning.prompt_text)
    if marker is None:
        return structured
    end = tuple(tokenizer.encode(marker, add_special_tokens=False))
    return dataclasses.replace(structured, reasoning_end_token_ids=end)
