"""Chat `tools` and `tool_choice`, as vLLM takes them.

The tools reach the chat template (`tools=`), whatever the choice. `tool_choice`:
- `none`: the model answers in text;
- `auto` (the default when tools are given): the model may call tools in its own format, which the
  `--tool-call-parser` (hermes, llama3_json) turns into `tool_calls`; needs
  `--enable-auto-tool-choice`, as in vLLM;
- `required`: a JSON-schema grammar makes the output an array of {name, parameters} calls;
- `{"type": "function", "function": {"name": ...}}`: the grammar makes the output that function's
  arguments (its `parameters` schema).
Every mistake is a 400 naming `tools` or `tool_choice`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
from typing import Any

from aiohttp import web

from jaxinfer.sampling_params import short_repr
from jaxinfer.structured.params import StructuredOutputsParams
from serve.errors import bad_request
from serve.tool_parsers import PARSERS, NamedCallParser, RequiredCallsParser

_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
MAX_TOOLS = 128


@dataclasses.dataclass(frozen=True)
class ToolOptions:
    enable_auto_tool_choice: bool = False  # --enable-auto-tool-choice
    tool_call_parser: str | None = None    # --tool-call-parser

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "ToolOptions":
        return cls(getattr(args, "enable_auto_tool_choice", False), getattr(args, "tool_call_parser", None))


TOOL_OPTIONS: web.AppKey[ToolOptions] = web.AppKey("tool_options")


def add_tool_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="let the model call tools on its own (tool_choice 'auto'); needs "
                        "--tool-call-parser")
    g.add_argument("--tool-call-parser", choices=sorted(PARSERS), default=None,
                   help="the model's tool-call format: hermes (<tool_call> JSON, Hermes/Qwen) or "
                        "llama3_json (Llama 3.1 JSON)")


def check_tool_args(args: argparse.Namespace) -> None:
    if getattr(args, "enable_auto_tool_choice", False) and not getattr(args, "tool_call_parser", None):
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (hermes or llama3_json)")


@dataclasses.dataclass
class ToolRequest:
    """A chat request's tools: what the template gets, and how the output becomes tool calls."""
    tools: list[dict]                  # for the chat template
    parser: Any = None                 # None: the output is plain content (tool_choice "none")
    structured: StructuredOutputsParams | None = None  # the grammar of a forced call
    forced_name: str | None = None     # a named tool_choice
    parallel: bool = True              # parallel_tool_calls=false: at most one call

    def finish_reason(self, engine_reason: str | None, called: bool) -> str | None:
        """OpenAI's finish_reason: "tool_calls" when the model stopped after calling tools, except
        for a named function (OpenAI answers a forced call with "stop")."""
        if called and engine_reason == "stop" and not self.forced_name:
            return "tool_calls"
        return engine_reason

    def message(self, text: str, prefix: str = "") -> tuple[dict, bool]:
        """(the assistant message of a finished choice, whether it calls tools)."""
        if self.parser is None:
            return {"role": "assistant", "content": prefix + text, "tool_calls": []}, False
        content, calls = self.parser.parse(text)
        calls = calls if self.parallel else calls[:1]
        content = prefix + content if content is not None else (prefix or None)
        return {"role": "assistant", "content": content,
                "tool_calls": [c.as_dict() for c in calls]}, bool(calls)

    def stream_deltas(self, stream, text: str, finished: bool) -> tuple[str, list[dict]]:
        """A choice's (content, tool-call deltas) for its next chunk."""
        content, deltas = stream.feed(text)
        if finished:
            more, late = stream.finish()
            content, deltas = content + more, deltas + late
        return content, deltas if self.parallel else [d for d in deltas if d["index"] == 0]


def _check_tools(tools: Any) -> dict[str, dict]:
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise bad_request(f"tools must be a list of at most {MAX_TOOLS} function tools", "tools")
    by_name = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or tool.get("type", "function") != "function":
            raise bad_request(f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}", "tools")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise bad_request(f"tools[{i}].function.name must be 1 to 64 letters, digits, '_', '.' or "
                              f"'-' (got {short_repr(name)})", "tools")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise bad_request(f"tools[{i}].function.parameters must be a JSON schema object", "tools")
        by_name[name] = fn
    return by_name


def _params_schema(fn: dict) -> dict:
    return fn.get("parameters") or {"type": "object", "properties": {}}


def required_schema(functions: dict[str, dict]) -> dict:
    """An array of at least one {name, parameters} call of the given functions."""
    return {"type": "array", "minItems": 1, "items": {"anyOf": [
        {"type": "object", "additionalProperties": False, "required": ["name", "parameters"],
         "properties": {"name": {"enum": [name]}, "parameters": _params_schema(fn)}}
        for name, fn in functions.items()]}}


def tool_request(body: dict, options: ToolOptions) -> ToolRequest | None:
    """The request's tools and choice, validated; None when it has neither."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if not tools:
        if choice not in (None, "none"):
            raise bad_request(f"tool_choice={short_repr(choice)} needs tools", "tool_choice")
        return None
    functions = _check_tools(tools)
    parallel = body.get("parallel_tool_calls") is not False
    if choice is None:
        choice = "auto"  # OpenAI's and vLLM's default when tools are given
    if choice == "none":
        return ToolRequest(tools)
    if choice == "auto":
        if not (options.enable_auto_tool_choice and options.tool_call_parser):
            raise bad_request('"auto" tool choice requires --enable-auto-tool-choice and '
                              "--tool-call-parser to be set", "tool_choice")
        return ToolRequest(tools, PARSERS[options.tool_call_parser](), parallel=parallel)
    if choice == "required":
        schema = required_schema(functions)
        if not parallel:
            schema["maxItems"] = 1
        return ToolRequest(tools, RequiredCallsParser(), StructuredOutputsParams(
            json=schema, field="tool_choice"), parallel=parallel)
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if not (isinstance(choice, dict) and choice.get("type", "function") == "function"
            and isinstance(name, str)):
        raise bad_request(f"tool_choice={short_repr(choice)}: must be 'none', 'auto', 'required' or "
                          "{'type': 'function', 'function': {'name': ...}}", "tool_choice")
    if name not in functions:
        raise bad_request(f"tool_choice names {short_repr(name)}, which is not among the tools",
                          "tool_choice")
    return ToolRequest(tools, NamedCallParser(name), StructuredOutputsParams(
        json=_params_schema(functions[name]), field="tool_choice"), name)


def template_message(msg: dict) -> dict:
    """An assistant message's tool calls with their `arguments` as objects, as chat templates
    (and vLLM) expect them; the client sends them as JSON text."""
    calls = msg.get("tool_calls")
    if not isinstance(calls, list):
        return msg
    out = []
    for call in calls:
        fn = call.get("function") if isinstance(call, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
            try:
                call = {**call, "function": {**fn, "arguments": json.loads(fn["arguments"])}}
            except json.JSONDecodeError:
                pass  # the template gets the text as sent
        out.append(call)
    return {**msg, "tool_calls": out}
