"""A request's hand-over from the prefill engine to the decode engine, on the host.

The prefill engine runs each request with its own sampling parameters but a one-token output limit
(`limit_to_first_token`). When that limit, and not a real finish, ends the sequence, the prefill
side's output processor marks it `HANDOFF` instead of finishing it (no finish metrics, no flushed
text): the client sees the first token as an ordinary streamed token. The decode side continues
the same request (`Transit`): a new `Request` with the same id, seed and timestamps, and per
choice handed off (`Handoff`; n > 1: the prefill engine computes the prompt once and forks it,
each choice sampling its own first token as in a plain engine) a sequence whose tokens are the
prompt plus the first token, `num_computed` = the prompt (its KV arrives by transfer), sharing the
prefill sequence's incremental detokenizer and logprobs. A choice whose first token finished it
(EOS, a stop string) is carried over finished.
"""

from __future__ import annotations

import dataclasses

import jax

from jaxinfer.core.kv_cache import FixedStateSpec
from jaxinfer.engine.output_processor import OutputProcessor
from jaxinfer.core.request import Request, Sequence, SeqStatus, make_choice
from jaxinfer.model.tokenizer import Tokenizer

HANDOFF = "handoff"  # a prefill-side finish reason no client sees


def limit_to_first_token(req: Request) -> None:
    """Make the prefill engine stop each of `req`'s choices after its first sampled token (an
    n > 1 prompt sequence passes the limit on to the choices it forks into)."""
    for seq in (req.prompt_seq, *req.choices):
        if seq is not None:
            seq.max_output = 1


class HandoffOutputProcessor(OutputProcessor):
    """The prefill engine's output processor: a sequence stopped only by the one-token limit is
    handed off, not finished. EOS, a stop string, max_tokens = 1 or a full context finish it for
    real, on the prefill side."""

    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None) -> None:
        max_tokens = seq.request.params.max_tokens
        if (reason == "length" and seq.max_output == 1 and max_tokens != 1
                and len(seq.token_ids) < self.max_model_len):
            seq.finish_reason = HANDOFF
            return
        if any(c is not None and c.finish_reason == HANDOFF for c in seq.request.choices):
            # The request goes on on the decode side, whose last finish records its metrics.
            seq.finish_reason, seq.stop_reason = reason, stop_reason
            seq.output.finish()
            return
        super().finish(seq, reason, stop_reason)


@dataclasses.dataclass(eq=False)
class Handoff:
    """One choice between the two engines: its prompt blocks held on the prefill side (by
    `holder`, a fork of the sequence in the prefill KV manager) until the copy lands."""
    transit: Transit
    src_seq: Sequence     # the prefill side's sequence (its request is detached once reported)
    holder: str           # prefill KV manager id holding the prompt blocks
    src_tables: list[list[int]]  # one per KV group (Scheduler.hold_for_hand_over)
    seq: Sequence | None = None  # the decode side's, once its request's continuation is built
    first_block: int = 0  # blocks before it: already in the decode side's prefix cache
    dst_tables: list[list[int]] | None = None   # set once the decode side reserved them
    buffer: jax.Array | None = None       # in flight to the decode devices
    started: float = 0.0
    landed: bool = False

    def moved(self, tables: list[list[int]], specs, block_size: int) -> list[int]:
        """The block ids the copy moves, of `tables` (src_tables or dst_tables, in one order):
        an attention group's blocks of the prompt from `first_block`, a state-space layer's
        group its state's pages, whole (`specs`: the groups' KV-cache specs)."""
        last = -(-self.seq.prompt_len // block_size)
        return [block for table, spec in zip(tables, specs, strict=True)
                for block in (table if isinstance(spec, FixedStateSpec)
                              else table[self.first_block:last])]


@dataclasses.dataclass(eq=False)
class Transit:
    """One request between the two engines: a `Handoff` per choice the prefill side handed off.
    Its continuation (`request`) is built once every choice has left the prefill side (handed
    off, or finished there); the decode side adopts it once every copy has landed."""
    src: Request          # the prefill side's request
    handoffs: list[Handoff] = dataclasses.field(default_factory=list)
    request: Request | None = None  # the decode side's

    @property
    def request_id(self) -> str:
        return self.src.request_id

    def continue_on(self, tokenizer: Tokenizer | None) -> None:
        """Build the decode side's request, its choices' sequences given to their hand-overs."""
        self.request = continuation(tokenizer, self.src)
        for h in self.handoffs:
            h.seq = self.request.choices[h.src_seq.index]

    def sync_reported(self) -> None:
        """Carry over what the prefill side already reported (its outputs are made after the
        hand-over is recorded), so the decode side's next output starts after it."""
        for src, seq in zip(self.src.choices, self.request.choices):
            seq.num_logprobs_reported = src.num_logprobs_reported
            if src.finish_reason != HANDOFF:  # finished on the prefill side
                seq.finish_reported = src.finish_reported


def continuation(tokenizer: Tokenizer | None, src: Request) -> Request:
    """The decode side's request continuing `src` after each choice's first token: a choice
    handed off continues running, one that finished on the prefill side stays finished."""
    req = Request(src.request_id, src.prompt_token_ids, src.params, src.seed, (), src.priority,
                  src.arrival_time, weight_version=src.weight_version,
                  final_output_only=src.final_output_only)
    req.stop_ids_row, req.stop_id_set = src.stop_ids_row, src.stop_id_set
    req.lora_id = src.lora_id  # registered on both sides under this id (lora_fan_out.py)
    for name in ("first_scheduled_time", "first_token_time", "last_token_time",
                 "num_cached_tokens", "prompt_logprobs"):
        setattr(req, name, getattr(src, name))
    for src_seq in src.choices:
        seq = make_choice(tokenizer, req, src_seq.index, src_seq.prompt_len)
        seq.token_ids = list(src_seq.token_ids)
        seq.output = src_seq.output  # the incremental detokenizer and stop-string state go on
        seq.logprobs = src_seq.logprobs
        if src_seq.finish_reason != HANDOFF:
            seq.finish_reason, seq.stop_reason = src_seq.finish_reason, src_seq.stop_reason
            seq.status = SeqStatus.FINISHED
    return req
