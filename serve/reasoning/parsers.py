"""Reasoning parsers (vLLM's `--reasoning-parser` names): a chat output -> (reasoning, content).

- `deepseek_r1` (DeepSeek-R1 and its distills): the template opens `<think>` in the prompt, so the
  output is reasoning from its first token (a leading `<think>` the model repeats is dropped) up
  to `</think>`; the rest is content. An output cut short before `</think>` is all reasoning.
- `qwen3` (Qwen3, QwQ): reasoning when the output starts with `<think>` or the prompt left a
  `<think>` open (the thinking-only templates); then up to `</think>`. Otherwise, as with
  `chat_template_kwargs: {"enable_thinking": false}` (the template closes an empty think block in
  the prompt), the whole output is content.
- `gpt_oss` (gpt-oss, OpenAI's harmony format): the `analysis` channel
  (`<|channel|>analysis<|message|>` ... `<|end|>`) is reasoning, every other channel
  (`<|start|>assistant<|channel|>final<|message|>` ...) content; the markup is dropped. Harmony's
  markers are special tokens, so the request keeps special tokens in its text.

Unlike vLLM's qwen3 parser, which calls an unfinished `<think>` block content when the output is
whole but reasoning while it streams, these parsers decide from what they have already seen, so a
stream and the whole text always split the same way.
"""

from __future__ import annotations

from serve.reasoning.splitter import CONTENT, DROP, REASONING, MarkerSplitter, State

THINK, END_THINK = "<think>", "</think>"


class ReasoningParser:
    name: str = ""
    keeps_special_tokens = False  # the markers are special tokens the detokenizer would drop

    def states(self) -> dict[str, State]:
        raise NotImplementedError

    def start_state(self, prompt_text: str) -> str:
        raise NotImplementedError

    def answer_marker(self, prompt_text: str) -> str | None:
        """The text whose tokens end the reasoning (a structured-output grammar starts after them),
        or None when the output starts with the answer."""
        raise NotImplementedError

    def stream(self, prompt_text: str = "") -> MarkerSplitter:
        return MarkerSplitter(self.states(), self.start_state(prompt_text))

    def split(self, text: str, prompt_text: str = "") -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole output; None where there is none."""
        s = self.stream(prompt_text)
        r1, c1 = s.feed(text)
        r2, c2 = s.finish()
        return (r1 + r2) or None, (c1 + c2) or None


def _think_states(otherwise: str) -> dict[str, State]:
    return {"start": State(DROP, {THINK: "think"}, prefix_only=True, otherwise=otherwise),
            "think": State(REASONING, {END_THINK: "answer"}),
            "answer": State(CONTENT, {})}


class DeepSeekR1Parser(ReasoningParser):
    name = "deepseek_r1"

    def states(self) -> dict[str, State]:
        return _think_states(otherwise="think")

    def start_state(self, prompt_text: str) -> str:
        return "start"

    def answer_marker(self, prompt_text: str) -> str | None:
        return END_THINK


class Qwen3Parser(ReasoningParser):
    name = "qwen3"

    def states(self) -> dict[str, State]:
        return _think_states(otherwise="answer")

    def start_state(self, prompt_text: str) -> str:
        # The prompt's last <think> not closed after it: the template started the thinking.
        opened = prompt_text.rfind(THINK)
        return "think" if opened >= 0 and prompt_text.rfind(END_THINK) < opened else "start"

    def answer_marker(self, prompt_text: str) -> str | None:
        # enable_thinking=false: the template closed an empty think block at the prompt's end.
        return None if prompt_text.rstrip().endswith(END_THINK) else END_THINK


CHANNEL, MESSAGE, START = "<|channel|>", "<|message|>", "<|start|>"
MESSAGE_ENDS = ("<|end|>", "<|return|>", "<|call|>")
FINAL_CHANNEL = CHANNEL + "final" + MESSAGE  # the answer's channel opens (vLLM's end of reasoning)


def _harmony_channel(header: str) -> str:
    """`analysis`, or `commentary to=functions.f <|constrain|>json`, ... -> the body's state."""
    words = header.split()
    return "analysis" if words and words[0] == "analysis" else "answer"


class GptOssParser(ReasoningParser):
    name = "gpt_oss"
    keeps_special_tokens = True

    def states(self) -> dict[str, State]:
        def state(channel: str, markers: dict[str, str]) -> State:
            return State(channel, markers, header_until=MESSAGE, header_state=_harmony_channel)
        body_ends = {**{end: "between" for end in MESSAGE_ENDS}, CHANNEL: "header"}
        return {"start": state(CONTENT, {CHANNEL: "header", START: "between"}),
                "between": state(DROP, {CHANNEL: "header"}),  # a role name after <|start|>
                "analysis": state(REASONING, body_ends),
                "answer": state(CONTENT, body_ends)}

    def start_state(self, prompt_text: str) -> str:
        return "start"

    def answer_marker(self, prompt_text: str) -> str | None:
        return FINAL_CHANNEL


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    p.name: p for p in (DeepSeekR1Parser, Qwen3Parser, GptOssParser)}
