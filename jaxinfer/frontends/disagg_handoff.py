"""A request's hand-over from the prefill engine to the decode engine, on the host.

The prefill engine runs each request with its own sampling parameters but a one-token output limit
(`limit_to_first_token`). When that limit, and not a real finish, ends the sequence, the prefill
side's output processor marks it `HANDOFF` instead of finishing it (no finish metrics, no flushed
text): the client sees the first token as an ordinary streamed token. The decode side continues
the same request (`Handoff`): a new `Request` with the same id, seed and timestamps, and a choice
sequence whose tokens are the prompt plus the first token, `num_computed` = the prompt (its KV
arrives by transfer), sharing the prefill sequence's incremental detokenizer and logprobs.
"""

from __future__ import annotations

import dataclasses

import jax

from jaxinfer.core.kv_cache import FixedStateSpec
from jaxinfer.engine.output_processor import OutputProcessor
from jaxinfer.core.request import Request, Sequence, make_choice
from jaxinfer.model.tokenizer import Tokenizer

HANDOFF = "handoff"  # a prefill-side finish reason no client sees


def limit_to_first_token(req: Request) -> None:
    """Make the prefill engine stop `req` after its first sampled token (n == 1)."""
    req.choices[0].max_output = 1


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
        super().finish(seq, reason, stop_reason)


@dataclasses.dataclass(eq=False)
class Handoff:
    """One request between the two engines: its prompt blocks held on the prefill side (by
    `holder`, a fork of the sequence in the prefill KV manager) until the copy lands."""
    src_seq: Sequence     # the prefill side's sequence (its request is detached once reported)
    request: Request      # the decode side's request
    seq: Sequence         # ... and its sequence
    holder: str           # prefill KV manager id holding the prompt blocks
    src_tables: list[list[int]]  # one per KV group (Scheduler.hold_for_hand_over)
    first_block: int = 0  # blocks before it: already in the decode side's prefix cache
    dst_tables: list[list[int]] | None = None   # set once the decode side reserved them
    buffer: jax.Array | None = None       # in flight to the decode devices
    started: float = 0.0

    @property
    def request_id(self) -> str:
        return self.request.request_id

    def moved(self, tables: list[list[int]], specs, block_size: int) -> list[int]:
        """The block ids the copy moves, of `tables` (src_tables or dst_tables, in one order):
        an attention group's blocks of the prompt from `first_block`, a state-space layer's
        group its state's pages, whole (`specs`: the groups' KV-cache specs)."""
        last = -(-self.seq.prompt_len // block_size)
        return [block for table, spec in zip(tables, specs, strict=True)
                for block in (table if isinstance(spec, FixedStateSpec)
                              else table[self.first_block:last])]

    def sync_reported(self) -> None:
        """Carry over what the prefill side already reported (its outputs are made after the
        hand-over is recorded), so the decode side's next output starts after it."""
        self.seq.num_logprobs_reported = self.src_seq.num_logprobs_reported


def continuation(tokenizer: Tokenizer | None, src: Request, src_seq: Sequence) -> tuple[Request,
                                                                                         Sequence]:
    """The decode side's request and sequence continuing `src` after its first token."""
    req = Request(src.request_id, src.prompt_token_ids, src.params, src.seed, (), src.priority,
                  src.arrival_time, weight_version=src.weight_version,
                  final_output_only=src.final_output_only)
    req.stop_ids_row, req.stop_id_set = src.stop_ids_row, src.stop_id_set
    req.lora_id = src.lora_id  # registered on both sides under this id (lora_fan_out.py)
    for name in ("first_scheduled_time", "first_token_time", "last_token_time",
                 "num_cached_tokens", "prompt_logprobs"):
        setattr(req, name, getattr(src, name))
    seq = make_choice(tokenizer, req, 0, src_seq.prompt_len)
    seq.token_ids = list(src_seq.token_ids)
    seq.output = src_seq.output  # the incremental detokenizer and stop-string state go on
    seq.logprobs = src_seq.logprobs
    return req, seq
