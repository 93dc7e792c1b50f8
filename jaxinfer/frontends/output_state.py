"""The server process's side of a request served by an engine-core process (vLLM V1's
OutputProcessor, vllm/v1/engine/output_processor.py): it turns the core's token-id diffs into
RequestOutputs, detokenizing, matching stop strings and keeping the logprobs here.

Each choice's state grows by the new tokens only: nothing cumulative is copied per step
(`CompletionOutput.token_ids` is an `IdsSoFar` view of the choice's own list, fixed at the
output's length: a stream may read an output after later ones were applied).
A stop string found here ends the choice here; the client then finishes it in the core
(`finish_choice`), whose tokens for it that were already on their way are dropped.
The text rules are the engine's own (OutputProcessor._append): a stop token's text is left out
unless include_stop_str_in_output, stop strings count only past min_tokens.
"""

from __future__ import annotations

import functools
import pickle

from jaxinfer.core.outputs import CompletionOutput, IdsSoFar, RequestOutput
from jaxinfer.core.sampled_logprobs import SampledLogprobs
from jaxinfer.core.stop_checker import OutputText
from jaxinfer.frontends.core_messages import ChoiceDelta, CoreOutput
from jaxinfer.sampling_params import SamplingParams


class ChoiceState:
    __slots__ = ("text", "token_ids", "logprobs", "num_logprobs_reported", "finish_reason",
                 "stop_reason", "finish_reported")

    def __init__(self, text: OutputText, k: int | None):
        self.text = text
        self.token_ids: list[int] = []
        self.logprobs = None if k is None else SampledLogprobs(k)
        self.num_logprobs_reported = 0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.finish_reported = False

    def finish(self, reason: str, stop_reason) -> None:
        self.finish_reason, self.stop_reason = reason, stop_reason
        self.text.finish()


class RequestState:
    """One request's output state in the server process."""

    def __init__(self, request_id: str, prompt_ids: list[int], params: SamplingParams, tokenizer,
                 eos_token_ids: tuple[int, ...]):
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.params = params
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        n = params.n if isinstance(params.n, int) and params.n > 0 else 1
        self.choices: list[ChoiceState | None] = [None] * n
        self.num_cached_tokens = 0
        self.weight_version = 0
        self.prompt_logprobs = None
        self.embedding = None

    @functools.cached_property
    def stop_ids(self) -> frozenset[int]:
        """Read at the first output, after the core has validated `params`: the state is made
        before the request is sent, and an unchecked field (`stop_token_ids: false`) must get
        the core's 400, not fail here."""
        stop = [] if self.params.ignore_eos else list(self.eos_token_ids)
        return frozenset(stop + list(self.params.stop_token_ids))

    def _choice(self, index: int) -> ChoiceState:
        c = self.choices[index]
        if c is None:
            p = self.params
            c = self.choices[index] = ChoiceState(
                OutputText(self.tokenizer, self.prompt_ids, p.stop, p.include_stop_str_in_output,
                           p.skip_special_tokens), p.logprobs)
        return c

    @property
    def finished(self) -> bool:
        return all(c is not None and c.finish_reason is not None for c in self.choices)

    def apply(self, out: CoreOutput) -> tuple[RequestOutput | None, list[tuple[int, str]]]:
        """The core's news -> this request's RequestOutput (None when nothing is new to report),
        and the choices a stop string ended here: (index, stop string), to finish in the core."""
        self.num_cached_tokens = out.num_cached_tokens
        self.weight_version = out.weight_version
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = pickle.loads(out.prompt_logprobs)
        if out.embedding is not None:
            self.embedding = out.embedding
        stopped = []
        report = []
        for delta in out.outputs:
            c = self._choice(delta.index)
            if c.finish_reason is not None:
                continue  # stopped here already: the core's later tokens are dropped
            new = self._add_tokens(c, delta)
            if c.finish_reason is not None:
                stopped.append((delta.index, c.stop_reason))
            elif delta.finish_reason is not None:
                c.finish(delta.finish_reason, delta.stop_reason)
            report.append((delta.index, c, new))
        return self._output(report), stopped

    def _add_tokens(self, c: ChoiceState, delta: ChoiceDelta) -> list[int]:
        """Append the delta's tokens up to a stop string, if one ends the choice here."""
        p, ids, store = self.params, delta.token_ids, c.logprobs
        k = 0 if store is None else store.k
        for j, token in enumerate(ids):
            c.token_ids.append(token)
            if store is not None and delta.logprobs is not None:
                if k:
                    store.append(token, delta.logprobs[j], delta.top_ids[j * k:(j + 1) * k],
                                 delta.top_logprobs[j * k:(j + 1) * k])
                else:
                    store.append(token, delta.logprobs[j])
            past_min = len(c.token_ids) > p.min_tokens
            if token in self.stop_ids and past_min:
                if p.include_stop_str_in_output:
                    c.text.add_token(token, check_stop=False)
                continue  # (the core finished the choice on it)
            stop_str = c.text.add_token(token, check_stop=past_min)
            if stop_str is not None:
                c.finish("stop", stop_str)
                return ids[:j + 1]
        return ids

    def _output(self, report) -> RequestOutput | None:
        outs = []
        for index, c, new in report:
            if not new and (c.finish_reason is None or c.finish_reported):
                continue
            new_text = c.text.take_new_text()
            lps = c.logprobs
            outs.append(CompletionOutput(
                index=index, text=c.text.emitted_text, token_ids=IdsSoFar(c.token_ids),
                new_text=new_text, new_token_ids=new,
                new_logprobs=None if lps is None else lps.view(c.num_logprobs_reported),
                finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                logprobs=None if lps is None else lps.view()))
            if lps is not None:
                c.num_logprobs_reported = len(lps)
            if c.finish_reason is not None:
                c.finish_reported = True
        if not outs:
            return None
        return self._request_output(outs)

    def _request_output(self, outs: list[CompletionOutput]) -> RequestOutput:
        finished = self.finished
        generated = sum(len(c.token_ids) for c in self.choices if c is not None)
        return RequestOutput(self.request_id, self.prompt_ids, outs, finished, len(self.prompt_ids),
                             generated, self.prompt_logprobs, self.num_cached_tokens,
                             self.weight_version, self.embedding if finished else None)

    def abort_output(self, reason: str = "abort") -> RequestOutput:
        """Every unfinished choice finished with `reason` (an abort asked by the server)."""
        outs = []
        for i in range(len(self.choices)):
            c = self._choice(i)
            if c.finish_reason is None:
                c.finish(reason, None)
                new_text = c.text.take_new_text()
                outs.append(CompletionOutput(
                    i, c.text.emitted_text, IdsSoFar(c.token_ids), new_text, [], None, reason, None,
                    None if c.logprobs is None else c.logprobs.view()))
                c.finish_reported = True
        return self._request_output(outs)
