"""A streamed response: the Responses API's event sequence, each event numbered by
`sequence_number`:

    response.created, response.in_progress,
    per reasoning item: output_item.added, content_part.added, reasoning_text.delta...,
        reasoning_text.done, content_part.done, output_item.done
    per message item: output_item.added, content_part.added, output_text.delta...,
        output_text.done, content_part.done, output_item.done
    per function call: output_item.added, function_call_arguments.delta,
        function_call_arguments.done, output_item.done
    response.completed, or response.incomplete (status "incomplete") when max_output_tokens ran
    out: OpenAI's last event names how the response ended

The reasoning split and the tool parser run on the text deltas exactly as for a streamed chat
completion, so the items are those of the same request answered whole."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Awaitable, Callable

from serve.choices import UsageCounter
from serve.responses.output import (function_call_item, message_item, new_id, reasoning_item,
                                    text_part, usage)

_PART = {"reasoning": "reasoning_text", "message": "output_text"}


class _EventWriter:
    """The items of one stream and the events that build them."""

    def __init__(self):
        self.seq = 0
        self.items: list[dict] = []
        self.open: dict | None = None  # the reasoning or message item receiving text
        self.text = ""

    def event(self, kind: str, **fields) -> dict:
        out = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return out

    def _where(self) -> dict:
        return {"item_id": self.open["id"], "output_index": len(self.items) - 1, "content_index": 0}

    def close(self) -> list[dict]:
        item = self.open
        if item is None:
            return []
        self.open = None
        kind = _PART[item["type"]]
        where = {"item_id": item["id"], "output_index": len(self.items) - 1, "content_index": 0}
        if item["type"] == "reasoning":
            item.update(reasoning_item(item["id"], self.text))
            part = item["content"][0] if item["content"] else {"type": kind, "text": ""}
        else:
            item.update(message_item(item["id"], self.text))
            part = item["content"][0]
        done = f"response.{kind}.done"
        logprobs = {"logprobs": []} if kind == "output_text" else {}
        return [self.event(done, **where, text=self.text, **logprobs),
                self.event("response.content_part.done", **where, part=part),
                self.event("response.output_item.done", output_index=len(self.items) - 1, item=item)]

    def add_text(self, item_type: str, delta: str) -> list[dict]:
        out = []
        if self.open is not None and self.open["type"] != item_type:
            out += self.close()
        if self.open is None:
            self.text = ""
            item_id = new_id("rs" if item_type == "reasoning" else "msg")
            make = reasoning_item if item_type == "reasoning" else message_item
            self.open = make(item_id, None, "in_progress")
            self.open["content"] = []
            self.items.append(self.open)
            kind = _PART[item_type]
            out.append(self.event("response.output_item.added", output_index=len(self.items) - 1,
                                  item=dict(self.open)))
            part = text_part("") if kind == "output_text" else {"type": kind, "text": ""}
            out.append(self.event("response.content_part.added", **self._where(), part=part))
        if not delta:
            return out
        self.text += delta
        extra = {"logprobs": []} if item_type == "message" else {}
        out.append(self.event(f"response.{_PART[item_type]}.delta", **self._where(), delta=delta, **extra))
        return out

    def add_call(self, call: dict) -> list[dict]:
        out = self.close()
        item = function_call_item(new_id("fc"), call)
        self.items.append(item)
        index = len(self.items) - 1
        out.append(self.event("response.output_item.added", output_index=index,
                              item={**item, "arguments": "", "status": "in_progress"}))
        out.append(self.event("response.function_call_arguments.delta", item_id=item["id"],
                              output_index=index, delta=item["arguments"]))
        out.append(self.event("response.function_call_arguments.done", item_id=item["id"],
                              output_index=index, arguments=item["arguments"]))
        out.append(self.event("response.output_item.done", output_index=index, item=item))
        return out


async def response_events(group, req, skeleton: Callable[..., dict],
                          on_complete: Callable[[dict], Awaitable[None]]) -> AsyncGenerator[dict, None]:
    """The events of one response. `skeleton(status, output, usage, finish_reason)` makes the
    response object; `on_complete` receives the final one (the store)."""
    w = _EventWriter()
    counter = UsageCounter(req.prompts)
    yield w.event("response.created", response=skeleton("in_progress", [], None))
    yield w.event("response.in_progress", response=skeleton("in_progress", [], None))
    tools = req.tools if req.tools is not None and req.tools.parser is not None else None
    reasoning_stream = req.reasoning.stream() if req.reasoning is not None else None
    tool_stream = tools.parser.stream() if tools is not None else None
    finish_reason = None
    async for _, out in group.outputs():
        counter.update(0, out)
        for c in out.outputs:
            finished = c.finish_reason is not None
            reasoning, text, calls = "", c.new_text, []
            if reasoning_stream is not None:
                reasoning, text = reasoning_stream.feed(text, finished)
            if tools is not None:
                text, calls = tools.stream_deltas(tool_stream, text, finished)
            if reasoning:
                for e in w.add_text("reasoning", reasoning):
                    yield e
            if text:
                for e in w.add_text("message", text):
                    yield e
            for call in calls:
                for e in w.add_call(call):
                    yield e
            if finished:
                finish_reason = c.finish_reason
    for e in w.close():
        yield e
    if not any(item["type"] in ("message", "function_call") for item in w.items):
        for e in w.add_text("message", "") + w.close():  # an empty answer is still a message
            yield e
    final = skeleton("completed", w.items, usage(counter), finish_reason)
    await on_complete(final)
    last = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
    yield w.event(last, response=final)
