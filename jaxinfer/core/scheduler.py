"""The iteration-level scheduler: which sequences run in the next step, and how many tokens each.

Every step (vLLM V1's policy, chunked prefill always on):
1. running sequences with one token to compute (decodes) first, in priority then admission order;
   if the KV pool cannot give one a slot, the running sequence with the lowest priority, most
   recently admitted, is preempted by recompute (blocks freed, requeued at the front);
2. then running sequences part-way through their prompt (chunked prefill), up to
   `long_prefill_chunk` tokens each, within the step's token budget (`max_num_batched_tokens`); one
   that cannot get blocks waits, unless no sequence at all could be scheduled: then the most
   recently admitted running sequence is preempted, so prefills never wait for each other forever;
   when the step decodes, steps 2 and 3 fill it up to `max_step_tokens_while_decoding` tokens in
   all (at least a quarter of that; 0: none), a cap the engine's ITL target may set every step;
3. then, if nothing was preempted, waiting sequences are admitted while the budget,
   `max_num_seqs` and free blocks (after the prefix-cache match) allow, in the order (priority,
   prompt index, arrival): lower `priority` value first, then round-robin across the prompts of
   many-prompt requests, then FCFS (core/waiting_queue.py).

The scheduler never looks at token *values*, so the engine can schedule step N+1 while step N's
sampled tokens are still on the device (see llm_engine.py). Sequences whose known + in-flight tokens
already reach their limit are not scheduled again: they finish when their last token is processed.

The scheduler owns the `KVCacheManager` and is the only caller of it: the runner gets each
scheduled sequence's block ids and the step's block copies as plain data in the `SchedulerOutput`,
and the engine hands every processed step back (`tokens_arrived`, then `update_from_output`:
finished sequences free their blocks, newly full blocks enter the prefix cache). It alone writes
a sequence's progress (`num_computed`, `num_pending`: tests/test_scheduler_ownership.py).
"""

from __future__ import annotations

import itertools
import time
from typing import Callable, Iterable

from jaxinfer.core.kv_cache import KVCacheManager, PrefixCacheStats
from jaxinfer.core.kv_loads import KVLoads
from jaxinfer.core.request import Request, Sequence, SeqStatus
from jaxinfer.core.scheduler_output import ScheduledSeq, SchedulerOutput
from jaxinfer.core.waiting_queue import WaitingQueue


class Scheduler:
    def __init__(self, kv_manager: KVCacheManager, *, max_num_seqs: int,
                 max_num_batched_tokens: int, long_prefill_chunk: int, max_model_len: int,
                 decode_steps_per_call: int = 1, decode_loop_max_seqs: int | None = None,
                 max_step_tokens_while_decoding: int | None = None,
                 make_choice: Callable[[Request, int, int], Sequence] | None = None):
        self.kv = kv_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.long_prefill_chunk = long_prefill_chunk
        self.max_model_len = max_model_len
        self.decode_steps_per_call = decode_steps_per_call
        self.decode_loop_max_seqs = decode_loop_max_seqs or max_num_seqs
        self.max_step_tokens_while_decoding = max_step_tokens_while_decoding
        # Builds choice `index` of a request (n > 1 fork), given the tokens already computed.
        self.make_choice = make_choice
        self._waiting = WaitingQueue(long_prefill_chunk)
        self.running: list[Sequence] = []
        self._free_slots = list(range(max_num_seqs - 1, -1, -1))
        self._admit_counter = itertools.count()
        self._slots_reserved = 0  # sum of _slot_cost over running sequences
        self._priorities_used = False
        self._step_counter = 0
        self.num_preemptions = 0
        # Speculative decoding policy and proposer (spec_decode.proposer.Speculator), or None.
        self.speculator = None
        # LoRA adapters' device slots (core/lora_slots.py), or None (no LoRA): a sequence is
        # admitted only once its adapter has a slot. Requests whose adapter could not be loaded
        # at admission: (request id, error), for the engine to fail (`take_failed`).
        self.lora_slots = None
        self._failed: list[tuple[str, Exception]] = []
        # Sequences whose prefix is coming back from the host KV tier (None: no host tier).
        self.loads = KVLoads(kv_manager) if kv_manager.host is not None else None

    # ---- queues ---------------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def num_waiting_to_decode(self) -> int:
        """Waiting sequences, as many as free slots, whose tokens one prefill chunk computes: each
        decodes from the step after its admission (the ITL target's batch to come)."""
        return max(0, min(self._waiting.num_short, self.max_num_seqs - len(self.running)))

    def kv_cache_stats(self) -> tuple[float, int, int, PrefixCacheStats]:
        """(fraction of the KV blocks held by live sequences, blocks in use, all blocks,
        prefix-cache counters)."""
        kv = self.kv
        return kv.usage, kv.pool.num_used_blocks, kv.num_blocks, kv.stats

    def _slot_cost(self, seq: Sequence) -> int:
        # An n > 1 prompt sequence reserves room for all the choices it will fork into.
        return seq.request.params.n if seq.is_prompt_seq else 1

    def reset_prefix_cache(self, keep_host: bool = False) -> int:
        """Forget every cached prefix (new weights, or a released KV cache; `keep_host`: not the
        host tier's, for a released cache): how many blocks that returned to the free list."""
        return self.kv.reset_prefix_cache(keep_host)

    def add(self, seq: Sequence) -> None:
        self._priorities_used |= seq.request.priority != 0
        seq.status = SeqStatus.WAITING
        self._waiting.push(seq)

    def add_running(self, seq: Sequence) -> None:
        """Start a sequence whose KV blocks the manager already holds (a disaggregated hand-over,
        jaxinfer/disagg): it runs from the next step and is preemptible like any running one.
        The caller checked that a slot is free."""
        self._priorities_used |= seq.request.priority != 0
        self._start_running(seq)

    def enable_speculation(self, speculator) -> None:
        """Let decodes carry proposals: `speculator` (spec_decode.proposer.Speculator) is the
        policy asked each step and the proposer."""
        self.speculator = speculator

    def enable_lora(self, slots) -> None:
        """Admit a sequence only once its adapter has one of `slots` (core/lora_slots.py)."""
        self.lora_slots = slots

    # ---- disaggregation: prompts handed from a prefill engine's scheduler to a decode engine's ----
    def hold_for_hand_over(self, seq: Sequence) -> tuple[str, list[list[int]]]:
        """A prompt handed off: cache its full blocks and hold them under a new id (a fork) until
        the copy lands, whatever this scheduler does with `seq`. The holder id and its block
        tables (one per KV group: a state-space layer's group holds its state's pages)."""
        self.kv.cache_blocks(seq.seq_id, seq.token_ids, seq.prompt_len)
        holder = f"{seq.seq_id}#transfer"
        self.kv.fork(seq.seq_id, holder)
        return holder, [list(t) for t in self.kv.get_block_tables(holder)]

    def reserve_hand_over(self, seq: Sequence) -> tuple[int, list[list[int]]] | None:
        """Its adapter's slot and blocks for a sequence arriving from a prefill engine (prompt +
        first token), after matching the prompt in the prefix cache (not counted in the hit-rate
        stats: the prefill side's lookup is the request's). (prompt tokens cached, block tables
        as `hold_for_hand_over`'s), or None when the slots or the pool cannot hold it now;
        InvalidRequestError when its adapter cannot be loaded. `add_running` starts it once its
        KV has landed. A model with state-space layers matches nothing: a hit would resume from
        the snapshot pages of the prefix cache, and the hand-over brings the state whole."""
        if self.lora_slots is not None and not self.lora_slots.acquire(seq):
            return None
        prompt_len = seq.prompt_len
        cached = self.kv.get_computed_blocks(seq.seq_id, seq.token_ids[:prompt_len],
                                             match=not self.kv.groups.has_fixed_state, count=False,
                                             namespace=self._cache_namespace(seq))
        if not self.kv.allocate_slots(seq.seq_id, prompt_len + 1 - cached):
            self.drop_hand_over(seq)
            return None
        return cached, [list(t) for t in self.kv.get_block_tables(seq.seq_id)]

    def drop_hand_over(self, seq: Sequence) -> None:
        """Give back what `reserve_hand_over` took for `seq`, if anything."""
        self.kv.free(seq.seq_id)
        if self.lora_slots is not None:
            self.lora_slots.release(seq)

    def free_blocks(self, seq_id: str) -> None:
        """Give back the blocks held under `seq_id` (a hold or reservation that ended)."""
        self.kv.free(seq_id)

    def _requeue_front(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self._waiting.push_front(seq)

    def finish(self, seq: Sequence) -> None:
        """Finished or aborted: free the blocks and the slot now (the same step)."""
        if seq.status is SeqStatus.RUNNING:
            self._stop_running(seq)
        elif seq.status is SeqStatus.WAITING:
            self._waiting.discard(seq)
        seq.status = SeqStatus.FINISHED
        self.kv.free(seq.seq_id)

    def update_from_output(self, seqs: Iterable[Sequence]) -> None:
        """A processed step's sequences, in step order (`OutputProcessor.process`): each that
        finished (a finish reason set) frees its blocks now; each other one puts its newly
        computed full blocks into the prefix cache."""
        kv = self.kv
        for seq in seqs:
            if seq.finish_reason is not None:
                self.finish(seq)
            elif kv.has_request(seq.seq_id):
                if seq.speculated:  # slots of rejected proposals go back (never cached)
                    seq.speculated = False
                    kv.truncate(seq.seq_id, seq.num_computed)
                    # A fixed state past a rejected proposal is rolled back to the step's start:
                    # its accepted tokens are recomputed (state_rollback.py); a draft model's KV
                    # stays valid up to the last accepted input, not up to its next start.
                    kept = kv.settle_verify(seq.seq_id, seq.num_computed)
                    if kept < seq.num_computed:
                        seq.draft_computed = min(seq.draft_computed, seq.num_computed)
                        seq.num_computed = kept
                kv.cache_blocks(seq.seq_id, seq.token_ids,
                                min(seq.num_computed, len(seq.token_ids)))

    def _stop_running(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._slots_reserved -= self._slot_cost(seq)
        self._release_slot(seq)
        if self.lora_slots is not None:
            self.lora_slots.release(seq)

    def _acquire_lora(self, seq: Sequence) -> bool:
        """Whether `seq`'s adapter (if any) has a slot now; a failed load fails the request."""
        if self.lora_slots is None:
            return True
        try:
            return self.lora_slots.acquire(seq)
        except Exception as e:  # one adapter's failure is its requests'
            self._failed.append((seq.request.request_id, e))
            return False

    def take_failed(self) -> list[tuple[str, Exception]]:
        failed, self._failed = self._failed, []
        return failed

    def _cache_namespace(self, seq: Sequence):
        lora_id = getattr(seq.request, "lora_id", 0)
        return self.lora_slots.namespace(lora_id) if self.lora_slots is not None else None

    def _release_slot(self, seq: Sequence) -> None:
        if seq.slot >= 0:
            self._free_slots.append(seq.slot)
            seq.slot = -1

    def _preempt(self, seq: Sequence) -> None:
        """Recompute preemption: drop the KV, keep the tokens, wait at the front of the queue."""
        self._stop_running(seq)
        self.kv.free(seq.seq_id)
        seq.num_computed = 0
        seq.draft_computed = 0
        self.num_preemptions += 1
        self._requeue_front(seq)

    def grow(self, seq: Sequence, target_tokens: int, first_query_pos: int | None = None) -> bool:
        """Make sure `seq` has KV slots for its first `target_tokens` tokens (also the
        speculator's, for an on-device speculative loop). `first_query_pos`: a device loop's
        first query, when it comes before the slots held now (allocate_slots)."""
        need = target_tokens - (self.kv.num_tokens(seq.seq_id) if self.kv.has_request(seq.seq_id)
                                else 0)
        return need <= 0 or self.kv.allocate_slots(seq.seq_id, need, first_query_pos)

    # ---- n > 1: fork the choices once the shared prompt part is scheduled -------------------
    def _fork_ready_prompts(self) -> None:
        for p in [s for s in self.running if s.is_prompt_seq and s.num_to_compute == 0]:
            request = p.request
            self._stop_running(p)
            p.status = SeqStatus.FINISHED
            for i in range(request.params.n):
                child = self.make_choice(request, i, p.num_computed)
                child.max_output = p.max_output  # (a disaggregated prefill engine's: one token)
                self.kv.fork(p.seq_id, child.seq_id)
                self._acquire_lora(child)  # (the adapter's slot is still its: no load)
                self._start_running(child)
            self.kv.free(p.seq_id)

    def _start_running(self, seq: Sequence) -> None:
        seq.set_token_limit(self.max_model_len)
        seq.status = SeqStatus.RUNNING
        seq.admit_order = next(self._admit_counter)
        if not seq.is_prompt_seq:
            seq.slot = self._free_slots.pop()
        self.running.append(seq)
        self._slots_reserved += self._slot_cost(seq)

    # ---- the step ---------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        self._fork_ready_prompts()
        budget = self.max_num_batched_tokens
        decodes: list[ScheduledSeq] = []
        prefills: list[ScheduledSeq] = []
        preempted: list[Sequence] = []
        kv = self.kv
        order = (sorted(self.running, key=lambda s: (s.request.priority, s.admit_order))
                 if self._priorities_used else list(self.running))

        # 1. decodes (one token to compute), never starved by prefills. (The hot loop: 256
        # sequences every step, so it is written out instead of calling helpers.)
        self._step_counter += 1
        step = self._step_counter
        prefill_candidates = []
        spec = self.speculator
        if spec is not None and spec.active(len(self.running), self.num_waiting):
            spec.begin_step()
        else:
            spec = None
        num_proposed = 0
        rolls_back = spec is not None and kv.rolls_back_states
        for seq in order:
            if seq.status is not SeqStatus.RUNNING:  # preempted earlier in this loop
                continue
            num_tokens = len(seq.token_ids) + seq.num_pending
            start = seq.num_computed
            if num_tokens - start != 1:
                if num_tokens - start > 1 and not seq.num_pending:
                    prefill_candidates.append(seq)
                continue
            if budget == 0 or num_tokens >= seq.token_limit:
                continue
            proposal = spec.propose(seq, budget) if spec is not None else ()
            if proposal and not kv.allocate_slots(  # proposals never preempt anyone
                    seq.seq_id, max(start + 1 + len(proposal) - kv.num_tokens(seq.seq_id), 0)):
                proposal = ()
            if proposal and rolls_back and not kv.snapshot_for_verify(
                    seq.seq_id, start, start + 1 + len(proposal)):
                proposal = ()
            need = start + 1 - kv.num_tokens(seq.seq_id)
            while need > 0 and not kv.allocate_slots(seq.seq_id, need):
                victim = max((s for s in self.running if s.scheduled_in != step),
                             key=lambda s: (s.request.priority, s.admit_order))
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is SeqStatus.RUNNING:
                seq.num_computed = start + 1
                emits = seq.index >= 0
                if emits:
                    seq.num_pending += 1
                decodes.append(ScheduledSeq(seq, start, 1 + len(proposal), emits,
                                            proposal=proposal))
                seq.scheduled_in = step
                budget -= 1 + len(proposal)
                if proposal:  # the output processor advances num_computed per accepted token
                    seq.speculated = True
                    num_proposed += len(proposal)

        # A step that decodes holds at most this many tokens, decodes included (a step's time is
        # every running stream's inter-token latency, and it is padded to a token bucket: a bound
        # on the total fills the bucket instead of spilling into the next). Prompts keep a quarter
        # of it even when the decodes alone reach it, so admissions never wait for decodes to end.
        # The engine's ITL target may set it every step (engine/itl_target.py); its 0 makes this
        # step decode only (the target's duty cycle, where the smallest prompt step is too slow).
        cap = self.max_step_tokens_while_decoding
        if decodes and cap is not None:
            budget = min(budget, max(cap - len(decodes), cap // 4, 1)) if cap else 0

        # 2. running prefills (chunked); they wait for blocks instead of preempting (but see below).
        prefill_stalled = False
        for seq in prefill_candidates:
            if budget == 0:
                break
            if seq.status is not SeqStatus.RUNNING:
                continue
            n = self._chunk_size(seq, budget)
            if self.grow(seq, seq.num_computed + n):
                prefills.append(self._chunk(seq, n))
                seq.scheduled_in = step
                budget -= n
            else:
                prefill_stalled = True
        # Prefills alone can fill the pool part-way through their prompts and then wait for each
        # other forever: when nothing at all could run and no token in flight may still finish a
        # sequence, preempt the most recently admitted one so the older ones advance (the pool
        # holds one max_model_len sequence: see LLMEngine).
        if (prefill_stalled and not decodes and not prefills
                and not any(s.num_pending for s in self.running)):
            victim = max(self.running, key=lambda s: (s.request.priority, s.admit_order))
            self._preempt(victim)
            preempted.append(victim)

        # 3. admissions (priority, round-robin across requests, FCFS), only when nothing had to be
        # preempted.
        while not preempted and budget > 0:
            seq = self._waiting.peek()
            if seq is None or seq.num_pending:  # a preempted seq whose last token is in flight
                break
            if self._slots_reserved + self._slot_cost(seq) > self.max_num_seqs:
                break
            if not self._acquire_lora(seq):  # every adapter slot busy: wait for one
                break
            if not self.kv.has_request(seq.seq_id):
                # Prompt logprobs and pooling need every prompt position computed: no prefix hit.
                seq.num_computed = self.kv.get_computed_blocks(
                    seq.seq_id, seq.token_ids, match=not seq.request.reads_prompt_hidden,
                    namespace=self._cache_namespace(seq))
                if self.loads is not None:  # host hits come back with this step
                    self.loads.start(seq, min(budget, self.long_prefill_chunk))
            n = self._chunk_size(seq, budget)
            if not self.grow(seq, seq.num_computed + n):
                self.kv.free(seq.seq_id, admitted=False)  # the prefix back; again next step
                seq.num_computed = 0
                if self.lora_slots is not None:
                    self.lora_slots.release(seq)
                break
            self._waiting.pop()
            self._start_running(seq)
            if seq.request.first_scheduled_time is None:
                seq.request.first_scheduled_time = time.monotonic()
                seq.request.num_cached_tokens = seq.num_computed
            entry = self._chunk(seq, n)
            (decodes if n == 1 else prefills).append(entry)
            seq.scheduled_in = step
            budget -= n

        out = SchedulerOutput(decodes, prefills, preempted, num_proposed=num_proposed)
        if (self.decode_steps_per_call > 1 and not prefills and decodes and not self.num_waiting
                and not num_proposed and len(decodes) <= self.decode_loop_max_seqs):
            out.decode_steps = self._reserve_decode_loop(decodes)
        elif spec is not None and num_proposed and not prefills:
            out.spec_iterations = spec.loop_iterations(self, decodes)
        if out:  # (copies only arise for sequences scheduled here; otherwise they stay queued)
            get_block_ids, get_tables, version = (kv.get_block_ids, kv.get_block_tables,
                                                  kv.table_version)
            grouped = kv.groups.num_groups > 1
            snapshot = kv.snapshot_state if kv.snapshots_states else None
            for entry in out.scheduled:
                if snapshot is not None and (entry.num_tokens > 1  # prompt rows, not decodes
                                             or entry.start < entry.seq.prompt_len):
                    snapshot(entry.seq.seq_id, entry.start)  # (copies among this step's)
                entry.block_ids = get_block_ids(entry.seq.seq_id)
                entry.table_version = version(entry.seq.seq_id)
                if grouped:
                    entry.group_block_ids = get_tables(entry.seq.seq_id)
                req = entry.seq.request
                if req.reads_prompt_hidden and entry.start < req.num_prompt_tokens - (
                        req.params.pooling is None):
                    out.reads_hidden = True
            out.block_copies, out.state_copies = kv.take_pending_copies_by_kind()
        if self.loads is not None:
            out.kv_transfers = self.loads.take()
        return out

    @staticmethod
    def loop_dispatched(decodes: list[ScheduledSeq], row_steps) -> None:
        """A decode loop was dispatched running `row_steps[r]` steps for `decodes[r]`: its later
        tokens count as pending and their KV as computed now, so the next step is scheduled (and
        dispatched) before this one's tokens reach the host. Processing the loop takes them all
        back from `num_pending`, also those a row did not get to (it finished earlier)."""
        for entry, n in zip(decodes, row_steps):
            entry.seq.num_pending += int(n) - 1
            entry.seq.num_computed += int(n) - 1

    @staticmethod
    def tokens_arrived(counts: Iterable[tuple[Sequence, int, int]]) -> None:
        """Per processed row (`OutputProcessor.take_counts`): `arrived` of its pending tokens are
        known now, and each of `accepted` proposals makes the token before it computed."""
        for seq, arrived, accepted in counts:
            seq.num_pending -= arrived
            seq.num_computed += accepted

    @staticmethod
    def unschedule(scheduled: Iterable[ScheduledSeq]) -> None:
        """A step that could not be dispatched: its rows as if it had never been scheduled."""
        for entry in scheduled:
            entry.seq.num_computed = entry.start
            entry.seq.num_pending -= entry.emits

    def _chunk_size(self, seq: Sequence, budget: int) -> int:
        """The tokens of `seq`'s next prefill chunk, cut where the KV manager snapshots states."""
        n = min(seq.num_to_compute, budget, self.long_prefill_chunk)
        return self.kv.aligned_chunk(seq.num_computed, n, seq.num_tokens)

    def _chunk(self, seq: Sequence, n: int) -> ScheduledSeq:
        start = seq.num_computed
        seq.num_computed += n
        emits = not seq.is_prompt_seq and seq.num_computed == seq.num_tokens
        if emits:
            seq.num_pending += 1  # sampled on the device; the host sees it when the step is processed
        return ScheduledSeq(seq, start, n, emits)

    def _reserve_decode_loop(self, decodes: list[ScheduledSeq]) -> int:
        """Reserve KV slots for up to decode_steps_per_call tokens per sequence (each capped at what
        its limits still allow). Returns the number of steps, 1 if the pool cannot reserve them, if
        a sequence needs the host every token (penalties read the token history, which the loop
        does not rebuild; a grammar needs a fresh bitmask from its host-side matcher), or if every
        sequence reaches its length limit sooner (the loop always runs all its steps: single steps
        finish them without idle iterations)."""
        k = self.decode_steps_per_call
        if any(d.seq.request.params.uses_penalties or not d.emits or d.seq.grammar is not None
               for d in decodes):
            return 1
        steps = [min(k, d.seq.loop_steps_allowed()) for d in decodes]
        if max(steps) < k:
            return 1
        for d, n in zip(decodes, steps):
            if not self.grow(d.seq, d.start + n, first_query_pos=d.start):
                return 1
        return k  # the later tokens are counted once the loop is dispatched (loop_dispatched)
