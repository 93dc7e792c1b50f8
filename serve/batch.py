"""`jaxinfer batch`: an OpenAI Batch file through one offline engine. Each line is validated by the
server's own request parsing (protocol.parse_generation) and answered by its own response builders
(completions.full_completion, chat.full_chat), so a line's body is what the HTTP endpoint would
answer. Requests are added to the engine as a window of up to `max_pending` lines that is refilled
as lines finish: the engine always has the whole window to batch, and each answer is appended (and
flushed) as soon as its line is done, which is what makes a run resumable."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterable
from typing import IO

from jaxinfer.core.outputs import RequestOutput
from jaxinfer.core.waiting_queue import PROMPT_INDEX_SEP
from jaxinfer.engine.protocol import EngineClient
from jaxinfer.errors import InvalidRequestError, TokenizerError
from serve.batch_file import BatchLine, output_line
from serve.chat import echo_prefix, full_chat
from serve.choices import now
from serve.completions import full_completion
from serve.errors import APIError, as_api_error, error_body
from serve.limits import RequestLimits
from serve.protocol import GenerationRequest, parse_generation
from serve.tools import ToolOptions


@dataclasses.dataclass
class EngineView:
    """What request parsing and the response builders read of an engine (AsyncEngine's names)."""
    tokenizer: object
    model_config: object
    max_model_len: int
    model_name: str
    served_model_names: list[str]
    grammars: object  # structured-output grammars (jaxinfer/structured/grammar.py)
    lora_requests: dict = dataclasses.field(default_factory=dict)  # adapter name -> LoRARequest

    @property
    def model_names(self) -> list[str]:
        return [*self.served_model_names, *self.lora_requests]

    @classmethod
    def of(cls, engine) -> "EngineView":
        loras = {r.lora_name: r for r in engine.list_loras()}
        return cls(engine.tokenizer, engine.cfg, engine.max_model_len, engine.model_name,
                   engine.config.model.served_model_names, engine.grammars, loras)


class FinishedGroup:
    """A RequestGroup's `outputs()` over requests that already finished: each prompt's final output
    with every choice's logprobs (as the streamed outputs would have added up)."""

    def __init__(self, outputs: list[RequestOutput]):
        self._outputs = outputs

    async def outputs(self):
        for i, out in enumerate(self._outputs):
            yield i, dataclasses.replace(out, outputs=[dataclasses.replace(c, new_logprobs=c.logprobs)
                                                       for c in out.outputs])


@dataclasses.dataclass
class Pending:
    line: BatchLine
    req: GenerationRequest
    engine_ids: list[str]
    outputs: dict[str, RequestOutput] = dataclasses.field(default_factory=dict)  # final, by id
    remaining: int = 0


class BatchRunner:
    def __init__(self, engine: EngineClient, out: IO[str], limits: RequestLimits | None = None,
                 max_pending: int = 1024,
                 tool_options: ToolOptions = ToolOptions()):
        self.engine = engine
        self.view = EngineView.of(engine)
        self.out = out
        self.limits = limits or RequestLimits()
        self.tool_options = tool_options
        self.max_pending = max_pending
        self.pending: dict[str, Pending] = {}     # engine request id -> its line
        self.open_lines = 0
        self.loop = asyncio.new_event_loop()       # runs the (never suspending) response builders
        self.counts = {"ok": 0, "failed": 0, "skipped": 0}

    def _write(self, line: str, ok: bool) -> None:
        self.out.write(line)
        self.out.flush()
        self.counts["ok" if ok else "failed"] += 1

    def _refuse(self, line: BatchLine, exc: BaseException) -> None:
        err = as_api_error(exc)
        if err is None:
            raise exc
        self._write(output_line(line.custom_id, err.status, error_body(err.status, err.message, err.param)),
                    ok=False)

    def add(self, line: BatchLine) -> None:
        """Validate a line and add its engine requests (answering it at once if it is refused)."""
        if line.error is not None:
            self._write(output_line(line.custom_id, error=line.error), ok=False)
            return
        try:
            req = parse_generation(line.body, self.view, self.limits, chat=line.chat,
                                   tool_options=self.tool_options)
            if req.stream:  # a batch answer is one body, never a stream (as OpenAI's Batch API)
                raise APIError(400, "stream is not supported in a batch file", "stream")
        except (APIError, InvalidRequestError, TokenizerError) as e:
            self._refuse(line, e)
            return
        engine_id, _ = req.ids("batch")
        p = Pending(line, req, [f"{engine_id}{PROMPT_INDEX_SEP}{i}" for i in range(len(req.prompts))])
        added = 0
        try:
            for rid, prompt in zip(p.engine_ids, req.prompts):
                self.engine.add_request(rid, prompt, req.params, req.priority, final_output_only=True,
                                        lora_request=req.lora_request)
                added += 1
        except InvalidRequestError as e:
            for rid in p.engine_ids[:added]:
                self.engine.abort(rid)
            self._refuse(line, e)
            return
        p.remaining = len(p.engine_ids)
        for rid in p.engine_ids:
            self.pending[rid] = p
        self.open_lines += 1

    def _finish(self, p: Pending) -> None:
        group, req = FinishedGroup([p.outputs[rid] for rid in p.engine_ids]), p.req
        _, response_id = req.ids("chatcmpl" if p.line.chat else "cmpl")
        if p.line.chat:
            body = full_chat(self.view, group, req, echo_prefix(p.line.body.get("messages"), req),
                             response_id, now())
        else:
            body = full_completion(self.view, group, req, response_id, now())
        self._write(output_line(p.line.custom_id, 200, self.loop.run_until_complete(body)), ok=True)

    def _close(self, p: Pending) -> None:
        for rid in p.engine_ids:
            self.pending.pop(rid, None)
        self.open_lines -= 1

    def step(self) -> None:
        """One engine step; answers the lines it finished."""
        for out in self.engine.step():
            p = self.pending.get(out.request_id)
            if p is None or not out.finished:
                continue
            p.outputs[out.request_id] = out
            p.remaining -= 1
            if p.remaining == 0:
                self._close(p)
                self._finish(p)
        for rid, error in self.engine.take_failed():
            p = self.pending.get(rid)
            if p is None:
                continue
            for other in p.engine_ids:
                if other != rid and other in self.pending:
                    self.engine.abort(other)
            self._close(p)
            self._refuse(p.line, error)

    def run(self, lines: Iterable[BatchLine], progress=None, skip: frozenset[str] | set[str] = frozenset()
            ) -> dict[str, int]:
        """Answer every line whose custom_id is not in `skip` (counted as "skipped"); a custom_id
        seen twice in the input is refused the second time."""
        seen: set[str] = set()
        for line in lines:
            if line.custom_id in skip:
                self.counts["skipped"] += 1
            elif line.custom_id in seen:
                self._write(output_line(line.custom_id, error=f"line {line.line_number}: duplicate "
                                                              f"custom_id {line.custom_id[:80]!r}"), ok=False)
            else:
                if line.custom_id is not None:
                    seen.add(line.custom_id)
                self.add(line)
            while self.open_lines >= self.max_pending:
                self.step()
                self._tick(progress)
            self._tick(progress)
        while self.open_lines:
            self.step()
            self._tick(progress)
        self.loop.close()
        return self.counts

    def _tick(self, progress) -> None:
        if progress is not None:
            progress.update(sum(self.counts.values()) - progress.n)
