"""Turn a finished step's sampled tokens into sequence state, finish decisions and RequestOutputs.

Runs on the host after `StepHandle.result()`. For each emitting row: append the token(s), detokenize,
check (in this order) stop token ids / EOS, stop strings, a completed grammar (structured output:
the row's matcher advances with each token), max_tokens and the context limit, and set a finished
sequence's finish reason. It touches no KV state: `process` returns the step's
sequences, which the engine hands to `Scheduler.update_from_output` (finished ones free their
blocks, full blocks enter the prefix cache).
"""

from __future__ import annotations

import time

from jaxinfer.engine.metrics import EngineMetrics, observe_many
from jaxinfer.core.outputs import CompletionOutput, IdsSoFar, RequestOutput
from jaxinfer.core.request import Request, Sequence, SeqStatus
from jaxinfer.worker.hidden_reads import record as record_hidden_reads
from jaxinfer.worker.runner import StepHandle


class OutputProcessor:
    def __init__(self, metrics: EngineMetrics, max_model_len: int, eos_token_ids: tuple[int, ...]):
        self.metrics = metrics
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        # Requests whose results could not be applied (a host-side failure in detokenizing or stop
        # checking, say): the engine fails them after the step, the other rows go on.
        self.failed: list[tuple[str, BaseException]] = []
        # The step's inter-token gaps (seconds -> tokens), observed once per distinct gap.
        self._gaps: dict[float, int] = {}
        # Per row: (sequence, pending tokens that arrived, proposals accepted), for the scheduler,
        # which alone writes num_pending and num_computed (Scheduler.tokens_arrived).
        self._counts: list[tuple[Sequence, int, int]] = []

    def take_counts(self) -> list[tuple[Sequence, int, int]]:
        """The rows' token counts since the previous call (see `_counts`)."""
        counts, self._counts = self._counts, []
        return counts

    def take_failed(self) -> list[tuple[str, BaseException]]:
        """The requests whose results could not be applied since the previous call."""
        failed, self.failed = self.failed, []
        return failed

    def process(self, handle: StepHandle) -> tuple[list[Request], list[Sequence]]:
        """Apply a step's results. Returns the requests that have something new to report, and the
        step's sequences that were still live, in step order, for `Scheduler.update_from_output`.
        A failure to fetch the results (the device) raises; a failure on one row is recorded in
        `failed` and its sequence left out of the live ones (the engine fails its request)."""
        res = handle.result()
        if handle.hidden_reads is not None:  # before the tokens: the first output carries them
            record_hidden_reads(handle.hidden_reads, res.hidden)
        now = time.monotonic()
        touched: dict[str, Request] = {}
        live: list[Sequence] = []
        steps = res.tokens.shape[0]
        tokens = res.tokens.tolist()
        logprobs = None if res.logprob is None else res.logprob.tolist()
        num_new_tokens = 0
        for r, entry in enumerate(handle.sched.scheduled):
            seq = entry.seq
            if seq.status is SeqStatus.FINISHED:  # aborted, or finished while this step ran
                continue
            try:
                num_new_tokens += self._process_row(seq, entry, r, res, tokens, logprobs, steps,
                                                    now, touched, handle.loop_row_steps)
            except Exception as e:  # fails this row's request, not the step
                self.failed.append((seq.request.request_id, e))
                continue
            live.append(seq)
        self.metrics.generation_tokens.inc(num_new_tokens)
        for gap, count in self._gaps.items():
            observe_many(self.metrics.inter_token_latency, gap, count)
        self._gaps.clear()
        return list(touched.values()), live

    def _process_row(self, seq: Sequence, entry, r: int, res, tokens, logprobs, steps: int,
                     now: float, touched: dict[str, Request], row_steps) -> int:
        num_new_tokens = arrived = accepted = 0
        if entry.emits:
            # A decode loop counted each of its row's steps as pending when it was dispatched
            # (Scheduler.loop_dispatched); a speculative step counts its first token only.
            loop_steps = None if row_steps is None else int(row_steps[r])
            for j in range(steps):
                if tokens[j][r] < 0:  # past the row's last token (finished, or rejected)
                    break
                if j == 0 or loop_steps is not None:
                    arrived += 1
                else:  # an accepted proposal: the previous token was this position's input
                    accepted += 1
                store = seq.logprobs
                if store is not None and logprobs is not None:
                    k = store.k
                    if k:
                        store.append(tokens[j][r], logprobs[j][r], res.top_ids[j, r, :k].tolist(),
                                     res.top_logprobs[j, r, :k].tolist())
                    else:
                        store.append(tokens[j][r], logprobs[j][r])
                self._append(seq, tokens[j][r], now)
                num_new_tokens += 1
                touched[seq.request.request_id] = seq.request
                if seq.finish_reason is not None:
                    break
            if loop_steps is not None:  # the steps after the row finished: never coming
                arrived = loop_steps
            self._counts.append((seq, arrived, accepted))
        return num_new_tokens

    def _append(self, seq: Sequence, token: int, now: float) -> None:
        req = seq.request
        params = req.params
        seq.token_ids.append(token)
        seq.new_token_ids.append(token)
        if seq.grammar is not None:
            seq.grammar.accept(token)
        if req.first_token_time is None:
            req.first_token_time = now
            self.metrics.time_to_first_token.observe(now - req.arrival_time)
        elif req.last_token_time is not None:
            gap = now - req.last_token_time
            self._gaps[gap] = self._gaps.get(gap, 0) + 1
        req.last_token_time = now
        n_out = seq.num_output_tokens
        past_min = n_out > params.min_tokens  # this token's output index >= min_tokens
        if token in req.stop_id_set and past_min:
            if params.include_stop_str_in_output:
                seq.output.add_token(token, check_stop=False)
            reason = None if token in self.eos_token_ids and token not in params.stop_token_ids \
                else token
            self.finish(seq, "stop", reason)
            return
        stop_str = seq.output.add_token(token, check_stop=past_min)
        if stop_str is not None:
            self.finish(seq, "stop", stop_str)
        elif seq.grammar is not None and seq.grammar.terminated:
            self.finish(seq, "stop", None)  # the grammar is complete: nothing but EOS could follow
        elif (seq.max_output is not None and n_out >= seq.max_output) \
                or len(seq.token_ids) >= self.max_model_len:
            self.finish(seq, "length", None)

    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None) -> None:
        """Set the finish reason (the scheduler frees the blocks when it is handed the sequence)
        and record the request's metrics if it is now finished."""
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        if seq.output is not None:
            seq.output.finish()
        req = seq.request
        if req.finished:
            now = time.monotonic()
            self.metrics.e2e_request_latency.observe(now - req.arrival_time)
            if req.first_scheduled_time is not None:
                self.metrics.request_queue_time.observe(req.first_scheduled_time - req.arrival_time)
            self.metrics.prompt_tokens.inc(req.num_prompt_tokens)
            self.metrics.request_success(reason)


def make_request_output(req: Request, full: bool = False) -> RequestOutput:
    """The request's output since its previous one (`full`: every choice, whole text). An
    unfinished choice's `token_ids` is a view, not a copy: copying them made each streamed output
    O(length)."""
    outs = []
    for i, seq in enumerate(req.choices):
        if seq is None:
            if full:
                outs.append(CompletionOutput(i, "", [], "", [], None, None, None))
            continue
        if not full and not seq.new_token_ids and (seq.finish_reason is None or seq.finish_reported):
            continue  # nothing new since the previous output
        new_text = seq.output.take_new_text()
        lps = seq.logprobs  # views: no per-token objects unless a caller reads them
        # (a choice's last output, which LLM.generate returns, holds a list: copied once)
        ids = (seq.token_ids[seq.prompt_len:] if full or seq.finish_reason is not None
               else IdsSoFar(seq.token_ids, seq.prompt_len))
        outs.append(CompletionOutput(
            index=i, text=seq.output.emitted_text, token_ids=ids,
            new_text=new_text, new_token_ids=seq.new_token_ids,
            new_logprobs=None if lps is None else lps.view(seq.num_logprobs_reported),
            finish_reason=seq.finish_reason, stop_reason=seq.stop_reason,
            logprobs=None if lps is None else lps.view()))
        seq.new_token_ids = []
        if lps is not None:
            seq.num_logprobs_reported = len(lps)
        if seq.finish_reason is not None:
            seq.finish_reported = True
    return RequestOutput(req.request_id, req.prompt_token_ids, outs, req.finished,
                         req.num_prompt_tokens, req.num_generated_tokens(), req.prompt_logprobs,
                         req.num_cached_tokens, req.weight_version,
                         None if req.pooled is None or not req.finished else req.pooled.tolist())
