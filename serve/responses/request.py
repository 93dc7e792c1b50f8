"""A `/v1/responses` body -> the equivalent chat body, every Responses field checked first (a 400
naming it). `input` is a string or a list of items: messages (role + text or text parts),
`function_call` and `function_call_output` items (a tool round trip), `reasoning` items (dropped:
chat templates leave earlier reasoning out); `instructions` become the system message."""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxinfer.sampling_params import short_repr
from serve.errors import bad_request
from serve.request_fields import log_unknown_fields

ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
TEXT_PARTS = ("input_text", "output_text", "text")
EFFORTS = ("minimal", "low", "medium", "high")
SUMMARIES = ("auto", "concise", "detailed")
# Fields taken as they are: checked by the chat path, whose field names the errors then carry.
PASSED = ("model", "temperature", "top_p", "stream", "user", "parallel_tool_calls", "top_k", "seed",
          "stop", "min_p", "repetition_penalty", "ignore_eos", "priority", "chat_template_kwargs")
# Chat field -> the Responses field a chat-path error names.
RENAMED_PARAMS = {"max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens",
                  "response_format": "text", "messages": "input", "prompt": "input"}
NO_OPS = {"background": (None, False), "truncation": (None, "disabled"), "service_level": (None,),
          "prompt": (None,), "conversation": (None,)}
KNOWN = frozenset(PASSED) | frozenset(NO_OPS) | {
    "input", "instructions", "max_output_tokens", "text", "tools", "tool_choice", "reasoning",
    "previous_response_id", "store", "metadata", "include", "top_logprobs", "max_tool_calls"}
MAX_METADATA = 16


@dataclasses.dataclass
class ResponsesRequest:
    chat_body: dict                 # for serve.protocol.parse_generation(chat=True)
    input_messages: list[dict]      # this turn's messages (without instructions), for the store
    previous_response_id: str | None
    store: bool
    metadata: dict
    echo_fields: dict               # request fields the response object repeats


def _text_of(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where}.content must be a string or a list of text parts", "input")
    texts = []
    for j, part in enumerate(content):
        if not (isinstance(part, dict) and part.get("type") in TEXT_PARTS
                and isinstance(part.get("text"), str)):
            raise bad_request(f"{where}.content[{j}]: only text parts ({', '.join(TEXT_PARTS)}) are "
                              "supported", "input")
        texts.append(part["text"])
    return "\n".join(texts)


def _str_field(item: dict, key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not value and key != "arguments":
        raise bad_request(f"{where}.{key} must be a non-empty string", "input")
    return value


def input_messages(value: Any) -> list[dict]:
    """`input` as chat messages; consecutive function calls become one assistant message."""
    if isinstance(value, str):
        if not value:
            raise bad_request("input is empty", "input")
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise bad_request("input must be a string or a non-empty list of items", "input")
    out: list[dict] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"{where} must be an object", "input")
        kind = item.get("type", "message")
        if kind == "message":
            role = ROLES.get(item.get("role"))
            if role is None:
                raise bad_request(f"{where}.role must be one of {sorted(ROLES)}", "input")
            out.append({"role": role, "content": _text_of(item.get("content"), where)})
        elif kind == "function_call":
            call = {"id": _str_field(item, "call_id", where), "type": "function",
                    "function": {"name": _str_field(item, "name", where),
                                 "arguments": _str_field(item, "arguments", where)}}
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls") is not None:
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": _str_field(item, "call_id", where),
                        "content": _text_of(output, where)})
        elif kind != "reasoning":
            raise bad_request(f"{where}.type {short_repr(kind)} is not supported (message, function_call, "
                              "function_call_output, reasoning)", "input")
    return out


def _text_format(value: Any) -> tuple[dict | None, dict]:
    """`text: {format: {...}}` -> (chat's response_format, the `text` the response echoes: only the
    format's own fields, whatever else the object carried)."""
    if not isinstance(value, dict):
        raise bad_request("text must be an object with a 'format'", "text")
    fmt = value.get("format")
    if fmt is None:
        return None, {"format": {"type": "text"}}
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise bad_request("text.format must be an object with a string 'type'", "text")
    kind = fmt["type"]
    if kind in ("text", "json_object"):
        return {"type": kind}, {"format": {"type": kind}}
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise bad_request("text.format.schema must be a JSON schema object", "text")
        for key, kinds in (("name", str), ("description", str), ("strict", bool)):
            if fmt.get(key) is not None and not isinstance(fmt[key], kinds):
                raise bad_request(f"text.format.{key} must be a {kinds.__name__}", "text")
        echo = {"type": "json_schema", **{k: fmt[k] for k in ("name", "schema", "description", "strict")
                                          if fmt.get(k) is not None}}
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name"), "schema": fmt["schema"]}}, \
            {"format": echo}
    raise bad_request(f"text.format.type {short_repr(kind)} is not supported (text, json_object, "
                      "json_schema)", "text")


def _tools(value: Any) -> list[dict]:
    """Responses' flat function tools (their own fields only: what the response echoes)."""
    if not isinstance(value, list):
        raise bad_request("tools must be a list of function tools", "tools")
    out = []
    for i, tool in enumerate(value):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise bad_request(f"tools[{i}]: only tools of type 'function' are supported", "tools")
        if tool.get("strict") is not None and not isinstance(tool["strict"], bool):
            raise bad_request(f"tools[{i}].strict must be true or false", "tools")
        out.append({"type": "function", **{k: tool[k] for k in ("name", "description", "parameters", "strict")
                                           if tool.get(k) is not None}})
    return out


def _chat_tools(tools: list[dict]) -> list[dict]:
    """Responses' flat function tools -> chat's nested ones."""
    return [{"type": "function", "function": {k: tool[k] for k in ("name", "description", "parameters")
                                              if k in tool}} for tool in tools]


def _tool_choice(value: Any) -> tuple[Any, Any]:
    """(chat's tool_choice, the Responses one the response echoes)."""
    if value is None or isinstance(value, str):
        return value, value or "auto"
    if isinstance(value, dict) and value.get("type") == "function":
        return {"type": "function", "function": {"name": value.get("name")}}, \
            {"type": "function", "name": value.get("name")}
    raise bad_request(f"tool_choice={short_repr(value)}: must be 'none', 'auto', 'required' or "
                      "{'type': 'function', 'name': ...}", "tool_choice")


def _reasoning(value: Any) -> dict:
    """`reasoning` as the response echoes it: its effort and summary, nothing else it carried."""
    if not isinstance(value, dict):
        raise bad_request("reasoning must be an object", "reasoning")
    out = {}
    for key, accepted in (("effort", EFFORTS), ("summary", SUMMARIES)):
        if value.get(key) is not None and value[key] not in accepted:
            raise bad_request(f"reasoning.{key}={short_repr(value[key])}: must be one of "
                              f"{', '.join(accepted)}", "reasoning")
        out[key] = value.get(key)
    return out


def _metadata(value: Any) -> dict:
    if value is None:
        return {}
    if not (isinstance(value, dict) and len(value) <= MAX_METADATA
            and all(isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512
                    for k, v in value.items())):
        raise bad_request(f"metadata must map at most {MAX_METADATA} keys (<= 64 characters) to strings "
                          "(<= 512 characters)", "metadata")
    return value


def _bool(body: dict, name: str, default: bool) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"{name}={short_repr(value)}: must be true or false", name)
    return value


def parse_responses_body(body: dict) -> ResponsesRequest:
    log_unknown_fields(body, KNOWN, "/v1/responses")
    for name, accepted in NO_OPS.items():
        if body.get(name) not in accepted:
            raise bad_request(f"{name}={short_repr(body.get(name))} is not supported by this server", name)
    for name in ("include", "top_logprobs", "max_tool_calls"):
        if body.get(name) not in (None, []):
            raise bad_request(f"{name} is not supported by this server", name)
    messages = input_messages(body.get("input"))
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise bad_request("instructions must be a string", "instructions")
    previous = body.get("previous_response_id")
    if previous is not None and (not isinstance(previous, str) or not previous):
        raise bad_request("previous_response_id must be a non-empty string", "previous_response_id")
    chat = {k: body[k] for k in PASSED if body.get(k) is not None}
    if body.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = body["max_output_tokens"]
    text = {"format": {"type": "text"}}
    if body.get("text") is not None:
        fmt, text = _text_format(body["text"])
        if fmt is not None:
            chat["response_format"] = fmt
    tools = _tools(body["tools"]) if body.get("tools") else []
    if tools:
        chat["tools"] = _chat_tools(tools)
    choice, echo_choice = _tool_choice(body.get("tool_choice"))
    if choice is not None:
        chat["tool_choice"] = choice
    reasoning = _reasoning(body["reasoning"]) if body.get("reasoning") is not None else None
    if reasoning is not None and (effort := reasoning["effort"]):
        kwargs = chat.get("chat_template_kwargs")
        if isinstance(kwargs, dict):  # (anything else is the chat path's 400)
            chat["chat_template_kwargs"] = {"reasoning_effort": effort, **kwargs}
        elif kwargs is None:
            chat["chat_template_kwargs"] = {"reasoning_effort": effort}
    system = [{"role": "system", "content": instructions}] if instructions else []
    chat["messages"] = system + messages  # the previous turns go between (handlers.py)
    # What the response repeats of the request, as checked and normalized above: keys of these
    # objects that nothing reads are neither echoed nor stored (serve/responses/store.py).
    echo = {"instructions": instructions, "max_output_tokens": body.get("max_output_tokens"),
            "temperature": body.get("temperature"), "top_p": body.get("top_p"),
            "tools": tools, "tool_choice": echo_choice,
            "parallel_tool_calls": body.get("parallel_tool_calls", True) is not False,
            "text": text, "reasoning": reasoning, "previous_response_id": previous}
    return ResponsesRequest(chat, messages, previous, _bool(body, "store", True),
                            _metadata(body.get("metadata")), echo)
