"""Tool calls in model output -> OpenAI `tool_calls`, whole or as streamed deltas.

Parsers (vLLM's `--tool-call-parser` names):
- `hermes` (Hermes, Qwen2.5/Qwen3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any
  number, after optional content;
- `llama3_json` (Llama 3.1/3.2): the output is `{"name": ..., "parameters": {...}}` objects
  (separated by `;`), optionally after `<|python_tag|>`.
A text that does not parse as the format's calls is content, as in vLLM. Forced calls (tool_choice
`required` or a named function, generated under a JSON-schema grammar) have parsers of their own.

Each parser gives `parse(text) -> (content, calls)` and `stream() -> ToolStream`, whose
`feed(delta)` and `finish()` return (content delta, new tool-call deltas) so that a stream never
shows markup that turns out to be a call.
"""

from __future__ import annotations

import abc
import dataclasses
import json
import re
import uuid


@dataclasses.dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = dataclasses.field(default_factory=lambda: f"chatcmpl-tool-{uuid.uuid4().hex}")

    def as_dict(self) -> dict:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def call_from_object(obj, args_key: str) -> ToolCall | None:
    """{"name": str, args_key: object or JSON text} -> ToolCall (None if it is not that)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", {}))
    if isinstance(args, str):
        return ToolCall(obj["name"], args)
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _delta(index: int, call: ToolCall) -> dict:
    return {"index": index, **call.as_dict()}


class ToolStream(abc.ABC):
    """Streaming state of one choice: `feed` text deltas, then `finish` once."""

    def __init__(self):
        self.calls: list[ToolCall] = []

    def _emit(self, calls: list[ToolCall]) -> list[dict]:
        out = [_delta(len(self.calls) + i, c) for i, c in enumerate(calls)]
        self.calls += calls
        return out

    @abc.abstractmethod
    def feed(self, delta: str) -> tuple[str, list[dict]]:
        """(content to send, tool-call deltas to send) after this text delta."""

    @abc.abstractmethod
    def finish(self) -> tuple[str, list[dict]]:
        """What is still held back, once the choice has finished."""


# ---- hermes ---------------------------------------------------------------------------------------

class HermesParser:
    START, END = "<tool_call>", "</tool_call>"
    _CALL = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(?!.*<tool_call>)(.*)", re.DOTALL)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        start = text.find(self.START)
        if start < 0:
            return text, []
        calls = []
        for closed, unclosed in self._CALL.findall(text):
            call = _json_call(closed or unclosed, "arguments")
            if call is None:
                return text, []
            calls.append(call)
        content = text[:start]
        return (content if content.strip() else None), calls

    def stream(self) -> ToolStream:
        return _HermesStream()


def _json_call(text: str, args_key: str) -> ToolCall | None:
    try:
        return call_from_object(json.loads(text), args_key)
    except json.JSONDecodeError:
        return None


def _marker_prefix_len(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class _HermesStream(ToolStream):
    def __init__(self):
        super().__init__()
        self.buffer = ""
        self.in_call = False
        self.seen_call = False  # content is what precedes the first call

    def feed(self, delta: str) -> tuple[str, list[dict]]:
        self.buffer += delta
        content, calls = "", []
        while True:
            if not self.in_call:
                idx = self.buffer.find(HermesParser.START)
                if idx < 0:
                    keep = _marker_prefix_len(self.buffer, HermesParser.START)
                    if not self.seen_call:
                        content += self.buffer[:len(self.buffer) - keep]
                    self.buffer = self.buffer[len(self.buffer) - keep:]
                    break
                if not self.seen_call:
                    content += self.buffer[:idx]
                self.buffer = self.buffer[idx + len(HermesParser.START):]
                self.in_call = True
            end = self.buffer.find(HermesParser.END)
            if end < 0:
                break
            content += self._call(self.buffer[:end], calls, HermesParser.END)
            self.buffer = self.buffer[end + len(HermesParser.END):]
            self.in_call = False
        return content, self._emit(calls)

    def _call(self, body: str, calls: list[ToolCall], end: str) -> str:
        """Parse one call's body into `calls`; a body that is not a call is content (before any
        call), as the whole-text parser keeps it."""
        call = _json_call(body, "arguments")
        if call is not None:
            calls.append(call)
            self.seen_call = True
            return ""
        return "" if self.seen_call else HermesParser.START + body + end

    def finish(self) -> tuple[str, list[dict]]:
        rest, self.buffer = self.buffer, ""
        if self.in_call:
            calls: list[ToolCall] = []
            content = self._call(rest, calls, "")
            return content, self._emit(calls)
        return ("" if self.seen_call else rest), []


# ---- llama3_json ----------------------------------------------------------------------------------

PYTHON_TAG = "<|python_tag|>"


def _llama3_calls(text: str) -> list[ToolCall] | None:
    """The `;`-separated call objects of a whole text, or None if it is not exactly that."""
    decoder = json.JSONDecoder()
    calls, i = [], 0
    while True:
        while i < len(text) and (text[i].isspace() or (text[i] == ";" and calls)):
            i += 1
        if i == len(text):
            return calls or None
        try:
            obj, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return None
        call = call_from_object(obj, "parameters")
        if call is None:
            return None
        calls.append(call)


def _llama3_body(text: str) -> str | None:
    """The text after an optional <|python_tag|>, if it opens a JSON object; else None."""
    body = text.lstrip()
    if body.startswith(PYTHON_TAG):
        body = body[len(PYTHON_TAG):].lstrip()
    return body if body.startswith("{") else None


class Llama3JsonParser:
    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        body = _llama3_body(text)
        calls = _llama3_calls(body) if body is not None else None
        return (text, []) if calls is None else (None, calls)

    def stream(self) -> ToolStream:
        return _Llama3Stream(self)


class _Llama3Stream(ToolStream):
    """Content streams as it comes unless the output opens like the parser's calls; then it is held
    and parsed whole at the end (content again if it was not calls after all)."""

    def __init__(self, parser):
        super().__init__()
        self.parser = parser
        self.buffer = ""
        self.holding: bool | None = None  # undecided until the first non-blank characters

    def feed(self, delta: str) -> tuple[str, list[dict]]:
        self.buffer += delta
        if self.holding is None:
            head = self.buffer.lstrip()
            if not head or (PYTHON_TAG.startswith(head) and head != PYTHON_TAG):
                return "", []  # undecided yet
            self.holding = head.startswith(PYTHON_TAG) or head.startswith("{")
        if self.holding:
            return "", []
        out, self.buffer = self.buffer, ""
        return out, []

    def finish(self) -> tuple[str, list[dict]]:
        rest, self.buffer = self.buffer, ""
        if not rest:
            return "", []
        content, calls = self.parser.parse(rest)
        return content or "", self._emit(calls)


# ---- forced calls (tool_choice "required" or a named function) -----------------------------------

class NamedCallParser:
    """The output is the named function's arguments (its parameters' JSON schema constrained it)."""

    def __init__(self, name: str):
        self.name = name

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        return None, [ToolCall(self.name, text)]

    def stream(self) -> ToolStream:
        return _NamedStream(self.name)


class _NamedStream(ToolStream):
    def __init__(self, name: str):
        super().__init__()
        self.name = name

    def feed(self, delta: str) -> tuple[str, list[dict]]:
        if not self.calls:  # the first delta names the function; later ones extend its arguments
            return "", self._emit([ToolCall(self.name, delta)])
        return "", [{"index": 0, "function": {"arguments": delta}}] if delta else []

    def finish(self) -> tuple[str, list[dict]]:
        return "", ([] if self.calls else self._emit([ToolCall(self.name, "")]))


class RequiredCallsParser:
    """The output is a JSON array of {"name", "parameters"} objects (a grammar made it one)."""

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        try:
            items = json.loads(text)
        except json.JSONDecodeError:  # cut short by max_tokens
            return text, []
        calls = [call_from_object(item, "parameters") for item in items] if isinstance(items, list) else []
        return (None, calls) if calls and all(calls) else (text, [])

    def stream(self) -> ToolStream:
        return _HeldStream(self)


class _HeldStream(ToolStream):
    def __init__(self, parser):
        super().__init__()
        self.parser, self.text = parser, ""

    def feed(self, delta: str) -> tuple[str, list[dict]]:
        self.text += delta
        return "", []

    def finish(self) -> tuple[str, list[dict]]:
        content, calls = self.parser.parse(self.text)
        return content or "", self._emit(calls)


PARSERS = {"hermes": HermesParser, "llama3_json": Llama3JsonParser}
