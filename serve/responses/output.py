"""Responses API objects: the output items of one finished choice (reasoning, message, function
calls), the response object around them, and the assistant messages that continue the
conversation from them."""

from __future__ import annotations

import uuid

from serve.choices import UsageCounter


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def reasoning_item(item_id: str, text: str, status: str = "completed") -> dict:
    return {"type": "reasoning", "id": item_id, "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}] if text else []}


def text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(item_id: str, text: str | None, status: str = "completed") -> dict:
    return {"type": "message", "id": item_id, "role": "assistant", "status": status,
            "content": [text_part(text)] if text is not None else []}


def function_call_item(item_id: str, call: dict, status: str = "completed") -> dict:
    """`call`: a chat tool call ({id, type, function: {name, arguments}})."""
    return {"type": "function_call", "id": item_id, "call_id": call["id"], "status": status,
            "name": call["function"]["name"], "arguments": call["function"]["arguments"]}


def output_items(reasoning: str | None, content: str | None, calls: list[dict]) -> list[dict]:
    items = []
    if reasoning:
        items.append(reasoning_item(new_id("rs"), reasoning))
    if content or not calls:
        items.append(message_item(new_id("msg"), content or ""))
    items += [function_call_item(new_id("fc"), call) for call in calls]
    return items


def usage(counter: UsageCounter) -> dict:
    u = counter.as_dict()
    return {"input_tokens": u["prompt_tokens"], "output_tokens": u["completion_tokens"],
            "total_tokens": u["total_tokens"],
            "input_tokens_details": {"cached_tokens": u["prompt_tokens_details"]["cached_tokens"]},
            "output_tokens_details": {"reasoning_tokens": 0}}


def response_object(response_id: str, created: int, model: str, echo: dict, metadata: dict,
                    status: str, output: list[dict], usage_dict: dict | None,
                    finish_reason: str | None = None) -> dict:
    incomplete = {"reason": "max_output_tokens"} if finish_reason == "length" else None
    if incomplete is not None and status == "completed":
        status = "incomplete"
    return {"id": response_id, "object": "response", "created_at": created, "model": model,
            "status": status, "error": None, "incomplete_details": incomplete, "output": output,
            "usage": usage_dict, "metadata": metadata, "background": False, "store": True,
            "truncation": "disabled", "user": None, **echo}


def conversation_messages(output: list[dict]) -> list[dict]:
    """The assistant turn of a response as chat messages (its reasoning left out, as templates do)."""
    text = "".join(p["text"] for item in output if item["type"] == "message" for p in item["content"])
    calls = [{"id": item["call_id"], "type": "function",
              "function": {"name": item["name"], "arguments": item["arguments"]}}
             for item in output if item["type"] == "function_call"]
    message = {"role": "assistant", "content": text or None}
    if calls:
        message["tool_calls"] = calls
    return [message]
