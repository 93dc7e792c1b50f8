"""What a proposer is, and the speculation policy the scheduler consults.

A `Proposer` suggests up to k next tokens for a sequence whose tokens are all known on the host.
Host-side proposers (n-gram lookup) return the tokens themselves when the step is scheduled.
Device-side proposers (a draft model; an EAGLE-style head would be one too, reading the target's
hidden states) return how many tokens they will propose as placeholders and fill them on the
device in `propose_on_device`, right before the target verifies them, in the same dispatch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from jaxinfer.spec_decode.gate import AcceptanceGate

if TYPE_CHECKING:
    from jaxinfer.core.request import Sequence
    from jaxinfer.core.scheduler import ScheduledSeq
    from jaxinfer.spec_decode.config import SpeculativeConfig


class Proposer(Protocol):
    # True: `plan` returns placeholders and the runner calls `propose_on_device`.
    on_device: bool

    def begin_step(self) -> None:
        """A new step is being scheduled (per-step budgets start again)."""

    def plan(self, seq: Sequence, max_tokens: int) -> list[int]:
        """Up to `max_tokens` proposed next tokens of `seq` (all its tokens are known); [] for
        none. On-device proposers return that many placeholders."""


class Speculator:
    """The policy: which scheduled decodes speculate and how far. A step speculates only while at
    most `disable_by_batch_size` sequences run (past the crossover, verifying k + 1 tokens per
    row costs more than the accepted tokens save) and none waits (admissions first: their
    prefills dominate the step, and the batch is about to grow); a request may opt out
    (`SamplingParams.speculative_decoding`); structured-output rows never speculate; and the
    acceptance gate (`spec_decode/gate.py`) pauses it while proposals are rarely accepted."""

    def __init__(self, config: SpeculativeConfig, proposer: Proposer):
        self.config = config
        self.proposer = proposer
        self.gate = AcceptanceGate(config.min_acceptance)
        # Verifying iterations per on-device loop (spec_decode/spec_loop.py); 1: no loop.
        self.iterations = 1

    def active(self, num_running: int, num_waiting: int) -> bool:
        return (num_running <= self.config.disable_by_batch_size and not num_waiting
                and self.gate.open)

    def begin_step(self) -> None:
        self.proposer.begin_step()

    def propose(self, seq: Sequence, budget: int) -> list[int]:
        """Proposals for a decode of `seq` scheduled with `budget` tokens left in the step."""
        # A grammar's row needs its bitmask before every token: structured output never speculates.
        if (seq.num_pending or seq.is_prompt_seq or seq.grammar is not None
                or not seq.request.params.speculative_decoding):
            return []
        # Each accepted proposal adds a token: the k + 1 emitted must fit the sequence's limit.
        k = min(self.config.num_speculative_tokens, budget - 1,
                seq.token_limit - len(seq.token_ids) - 1)
        return self.proposer.plan(seq, k) if k > 0 else []

    def loop_iterations(self, scheduler, decodes: list[ScheduledSeq]) -> int:
        """Iterations to run a step's speculating decodes for in one on-device loop, 1 for none:
        a loop needs every decode speculating (so all rows take the same path), at most the
        decode loop's sequences, none reading its token history on the host (penalties), room in
        the step's token budget, and KV slots for each row's N (k + 1) tokens (capped where its
        limit stops it: a row proposes at most limit - 1 tokens past its input), reserved here."""
        n, k = self.iterations, self.config.num_speculative_tokens
        if (n <= 1 or len(decodes) > scheduler.decode_loop_max_seqs
                or len(decodes) * (k + 1) > scheduler.max_num_batched_tokens
                or any(not d.proposal or not d.emits or d.seq.request.params.uses_penalties
                       for d in decodes)):
            return 1
        for d in decodes:
            if not scheduler.grow(d.seq, min(d.start + n * (k + 1), d.seq.token_limit - 1),
                                  first_query_pos=d.start):
                return 1  # what it did reserve goes back with the proposals' (truncate)
        return n
