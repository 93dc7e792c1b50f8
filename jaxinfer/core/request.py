"""Request and sequence state on the host.

A `Request` is what a client asked for: one prompt, one `SamplingParams`, `n` choices. A `Sequence`
is what the scheduler schedules and the KV-cache manager holds blocks for. With n == 1 the request
has one sequence covering prompt and output. With n > 1 a *prompt sequence* first computes the
prompt's KV except its last token; then n *choice sequences* are forked from its blocks (shared, ref
counted) and each computes the last prompt token itself, so each samples its own first token and
copy-on-write clones only the shared, partly filled last block.

Token accounting of a sequence (`pending` = sampled on the device, not yet seen by the host, when the
engine schedules one step ahead):

    token_ids (known)  |  pending  ->  num_tokens = len(token_ids) + num_pending
    num_computed: tokens whose KV is written or scheduled to be written
"""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING

import numpy as np

from jaxinfer.core.outputs import TokenLogprob
from jaxinfer.core.sampled_logprobs import SampledLogprobs
from jaxinfer.core.stop_checker import OutputText
from jaxinfer.sampling_params import MAX_STOP_TOKEN_IDS, SamplingParams

if TYPE_CHECKING:
    from jaxinfer.model.tokenizer import Tokenizer
    from jaxinfer.structured.grammar import CompiledGrammar


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Request:
    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 seed: int, eos_token_ids: tuple[int, ...], priority: int = 0,
                 arrival_time: float | None = None, grammar: CompiledGrammar | None = None, *,
                 weight_version: int = 0, final_output_only: bool = False):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.seed = seed  # params.seed, or one drawn from the engine's generator
        self.priority = priority
        self.grammar = grammar  # structured output: each choice matches it (jaxinfer/structured/)
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.num_cached_tokens = 0  # prompt tokens found in the prefix cache at first admission
        self.lora_id = 0  # its LoRA adapter's lora_int_id (0: the base model)
        stop = [] if params.ignore_eos else list(eos_token_ids)
        stop += [t for t in params.stop_token_ids if t not in stop]
        # EOS ids + stop_token_ids, fixed width for the jitted step (validated to fit).
        self.stop_ids_row = np.full(MAX_STOP_TOKEN_IDS, -1, np.int32)
        self.stop_ids_row[:len(stop)] = stop[:MAX_STOP_TOKEN_IDS]
        self.stop_id_set = frozenset(stop)
        # Top-k/top-p/min-p, top logprobs or penalties: needs the full sampler variant (every
        # variant returns the sampled token's logprob, all that logprobs=0 asks for).
        self.needs_full_sampler = (params.uses_truncation or bool(params.logprobs)
                                   or params.uses_penalties)
        # Prompt logprobs by prompt position (written by the steps that compute them; the first
        # token has none), None when not requested.
        self.prompt_logprobs: list[TokenLogprob | None] | None = (
            None if params.prompt_logprobs is None else [None] * len(self.prompt_token_ids))
        # An embedding request's pooled final hidden states (worker/hidden_reads.py), float32[H].
        self.pooled: np.ndarray | None = None
        # Every prompt position is computed (no prefix-cache hit) and its hidden states read.
        self.reads_prompt_hidden = params.prompt_logprobs is not None or params.pooling is not None
        # Choice sequences by index; filled at admission (n == 1) or at the fork (n > 1).
        self.choices: list[Sequence | None] = [None] * params.n
        self.prompt_seq: Sequence | None = None
        self.weight_version = weight_version  # the engine's at admission (see RequestOutput)
        # The caller reads only the finished output (LLM.generate): step() builds none before,
        # then one with every choice's whole text.
        self.final_output_only = final_output_only

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def finished(self) -> bool:
        """Every choice has its finish reason (the output processor's decision; the scheduler
        frees its blocks when the engine hands it the step)."""
        for c in self.choices:  # (a loop, not all(): read for every request every step)
            if c is None or c.finish_reason is None:
                return False
        return True

    def num_generated_tokens(self) -> int:
        n = 0
        for c in self.choices:  # (a loop, not sum(): read for every streamed output)
            if c is not None:
                n += c.num_output_tokens
        return n

    def detach(self) -> None:
        """Drop the sequences' references back to this finished request, so request and sequences
        are freed by reference counting: a server would otherwise leave one reference cycle per
        request to the cyclic garbage collector, whose full passes pause the process."""
        for seq in (self.prompt_seq, *self.choices):
            if seq is not None:
                seq.request = None


class Sequence:
    """One schedulable unit: a choice of a request, or (n > 1) the shared prompt computation."""

    def __init__(self, seq_id: str, request: Request, index: int, token_ids: list[int],
                 num_computed: int = 0):
        self.seq_id = seq_id
        self.request = request
        self.index = index  # choice index; -1 for an n > 1 prompt sequence
        self.token_ids = token_ids
        self.prompt_len = request.num_prompt_tokens if index >= 0 else len(token_ids)
        self.num_pending = 0
        self.num_computed = num_computed
        self.status = SeqStatus.WAITING
        self.slot = -1  # row of the device's last-sampled-token array while running
        self.lora_slot = 0  # its adapter's slot in the LoRA stacks while running (0: none)
        self.admit_order = -1
        self.scheduled_in = -1  # the scheduler step that last scheduled it
        self.token_limit = 1 << 62  # set when it starts running (set_token_limit)
        # Speculative decoding: holds KV slots of proposals until the step is processed; tokens
        # whose KV the draft model's cache holds (valid up to num_computed; spec_decode/draft.py).
        self.speculated = False
        self.draft_computed = 0
        params = request.params
        # Per-choice seed, so the n choices differ and choice 0 samples as an n == 1 request would.
        self.seed = (request.seed + max(index, 0) * 0x9E3779B9) % (1 << 32)
        self.max_output = params.max_tokens  # None: until the context is full
        self.output: OutputText | None = None  # set by the engine for choice sequences
        # A choice's own matcher of the request's grammar, advanced by each accepted token.
        self.grammar = (request.grammar.new_matcher()
                        if request.grammar is not None and index >= 0 else None)
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.finish_reported = False  # a RequestOutput carried the finish reason
        # One entry per output token, when requested (None: not requested).
        self.logprobs = None if params.logprobs is None else SampledLogprobs(params.logprobs)
        # Since the previous RequestOutput:
        self.new_token_ids: list[int] = []
        self.num_logprobs_reported = 0

    @property
    def is_prompt_seq(self) -> bool:
        return self.index < 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids) + self.num_pending

    @property
    def num_output_tokens(self) -> int:
        return 0 if self.is_prompt_seq else len(self.token_ids) - self.prompt_len

    @property
    def num_to_compute(self) -> int:
        return self.num_tokens - self.num_computed

    def set_token_limit(self, max_model_len: int) -> None:
        """`token_limit`: once the tokens known or in flight reach it (max_tokens or the context),
        the sequence is not scheduled again; it finishes when its last token is processed."""
        if self.is_prompt_seq:
            self.token_limit = 1 << 62
        elif self.max_output is None:
            self.token_limit = max_model_len
        else:
            self.token_limit = min(self.prompt_len + self.max_output, max_model_len)

    def loop_steps_allowed(self) -> int:
        """Decode iterations a scheduled decode (its in-flight token counted) may run on the device:
        the first samples the in-flight token, each later one adds a token within `token_limit`."""
        return 1 + max(self.token_limit - self.num_tokens, 0)

    def __repr__(self) -> str:
        return (f"Sequence({self.seq_id!r}, {self.status.value}, tokens={self.num_tokens}, "
                f"computed={self.num_computed}, pending={self.num_pending})")


def make_choice(tokenizer: Tokenizer | None, req: Request, index: int,
                num_computed: int) -> Sequence:
    """Choice `index` of `req` as a sequence over the whole prompt, `num_computed` tokens of which
    already have KV (a fork of the n > 1 prompt sequence), with its output text state."""
    seq = Sequence(f"{req.request_id}#{index}", req, index, list(req.prompt_token_ids), num_computed)
    p = req.params
    seq.output = OutputText(tokenizer, req.prompt_token_ids, p.stop, p.include_stop_str_in_output,
                            p.skip_special_tokens)
    req.choices[index] = seq
    return seq
