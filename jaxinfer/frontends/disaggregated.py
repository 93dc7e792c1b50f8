"""DisaggregatedEngine: a prefill engine on one device group and a decode engine on another, driven
by one process behind LLMEngine's interface (so `LLM`, `AsyncEngine` and the server use it as is).

A request's path:
1. the prefill engine (an LLMEngine on its own mesh, prefix cache on) computes the prompt and
   samples the first token, which is reported to the client at once;
2. when that step is processed (the `on_processed` hook, before the prefill scheduler frees the
   sequence), the prompt's full blocks enter the prefill prefix cache and a fork (`holder`) keeps
   the blocks; the hand-over waits for decode room: a free sequence slot, its LoRA adapter's slot
   (adapters are registered on both sides under one id: lora_fan_out.py) and blocks in the decode
   pool (admission against both pools). The decode side first matches the prompt against its own
   prefix cache: blocks it already holds are not moved;
3. the remaining blocks are gathered on the prefill devices and copied to the decode devices
   (transfer.py), queued before the prefill engine's next step, whose compute the copy overlaps;
4. at a later `step()`, a landed copy is scattered into the decode cache, the prefill holder is
   freed (the blocks stay in the prefill prefix cache, evictable) and, once every copy of its
   request has landed, the sequence joins the decode scheduler as running (preemptible from then
   on) with the first token as its next input. A request with n > 1 is computed once and forked
   on the prefill side as on one engine; each choice is handed over (`Transit`: one `Handoff` a
   choice), one whose first token finished it is carried over finished.
   Preemption on either side is the engines' own (recompute: a decode-side victim recomputes on
   the decode devices).

`step()` never waits for a prefill step while decodes run: the prefill engine is stepped only when
its in-flight step has finished, so a long prompt does not stall the running streams. Both engines
are stepped from the caller's thread; all host state is single-threaded.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from concurrent.futures import ThreadPoolExecutor

import jax

from jaxinfer.frontends.disagg_handoff import (HANDOFF, Handoff, HandoffOutputProcessor, Transit,
                                               limit_to_first_token)
from jaxinfer.disagg.transfer import KVTransfer
from jaxinfer.engine.args import EngineArgs
from jaxinfer.engine.llm_engine import LLMEngine
from jaxinfer.engine.protocol import EngineClient
from jaxinfer.engine.metrics import KVTransferMetrics
from jaxinfer.engine.output_processor import make_request_output
from jaxinfer.core.outputs import RequestOutput
from jaxinfer.core.request import Sequence
from jaxinfer.errors import ConfigError, InvalidRequestError, RequestFailedError
from jaxinfer.frontends.lora_fan_out import LoRAFanOut
from jaxinfer.frontends.merged_metrics import MergedMetrics
from jaxinfer.sampling_params import SamplingParams

# Copies in flight at once: each holds a request's KV outside both KV pools (on the decode devices
# until it is scattered), so this bounds that memory to a few prompts' worth.
MAX_IN_FLIGHT = 4


class DriverStats:
    """Where `DisaggregatedEngine.step` spends the host's time, by phase (seconds, summed), and
    how often each phase ran: the one thread drives both engines, so a phase that blocks (a
    dispatch waiting on a device, a copy) delays the other engine's next step."""

    def __init__(self):
        self.seconds: collections.Counter[str] = collections.Counter()
        self.counts: collections.Counter[str] = collections.Counter()

    def clock(self):
        """A function that charges the time since its previous call (or this one) to a phase."""
        last = time.perf_counter()
        self.counts["steps"] += 1

        def charge(phase: str) -> None:
            nonlocal last
            now = time.perf_counter()
            self.seconds[phase] += now - last
            self.counts[phase] += 1
            last = now
        return charge

    def per_step_ms(self) -> dict:
        """ms per driver step of each phase, and how many steps ran it."""
        steps = max(self.counts["steps"], 1)
        return {"steps": self.counts["steps"],
                **{f"{p}_ms": round(1e3 * s / steps, 3) for p, s in sorted(self.seconds.items())},
                **{f"{p}_count": n for p, n in sorted(self.counts.items()) if p != "steps"}}


class DisaggregatedEngine(LoRAFanOut, EngineClient):
    def __init__(self, prefill: LLMEngine, decode: LLMEngine):
        self.prefill, self.decode = prefill, decode
        self.config, self.cfg, self.tokenizer = decode.config, decode.cfg, decode.tokenizer
        if prefill.grammars is not decode.grammars or not isinstance(prefill.outputs,
                                                                    HandoffOutputProcessor):
            raise ConfigError("the disaggregated engines share one grammar cache and the prefill "
                              "engine hands prompts off: build them with from_engine_args")
        self.grammars = prefill.grammars
        self.max_model_len, self.model_name = decode.max_model_len, decode.model_name
        self.num_total_blocks = prefill.num_total_blocks + decode.num_total_blocks
        self.startup = prefill.startup
        self.block_size = decode.config.cache.block_size
        prefill.hand_processed_steps_to(self._hand_over)
        self._specs = decode.scheduler.kv.groups.specs
        # A copy moves a table's worth of each group's blocks at most.
        self.transfer = KVTransfer(prefill.runner.plan, decode.runner.plan,
                                   decode.runner.max_blocks * len(self._specs))
        self.metrics = MergedMetrics([prefill.metrics, decode.metrics])
        self.transfer_metrics = KVTransferMetrics(self.model_name, self.metrics.registry)
        self._transit: dict[str, Transit] = {}            # request id -> its hand-overs
        self._waiting: collections.deque[Handoff] = collections.deque()  # for decode room
        self._in_flight: list[Handoff] = []               # copies dispatched, in order
        self._failed: list[tuple[str, RequestFailedError]] = []  # failed between the engines
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="jaxinfer-disagg")
        self.driver = DriverStats()

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> DisaggregatedEngine:
        from jaxinfer.disagg.args import role_args, role_meshes
        from jaxinfer.model.config import load_config
        from jaxinfer.parallel.sharding import validate_parallel_sizes
        cfg = load_config(args.model_path)
        for role in ("prefill", "decode"):
            tp = getattr(args, f"{role}_tensor_parallel_size")
            try:
                validate_parallel_sizes(cfg, tp, 1, jax.device_count())
            except ConfigError as e:  # name the role's flag, not --tensor-parallel-size
                raise ConfigError(str(e).replace("--tensor-parallel-size",
                                                 f"--{role}-tensor-parallel-size")) from None
        meshes = role_meshes(args, jax.devices())
        def build(role: str, **parts) -> LLMEngine:
            # Warm-up per role (bucket_compiler.py): decode buckets first on the decode side,
            # none on the prefill side (its steps are all prompt chunks).
            return LLMEngine.from_engine_args(dataclasses.replace(role_args(args, role), warmup=False),
                                              mesh=meshes[role], role=role, **parts)

        prefill = build("prefill", outputs_cls=HandoffOutputProcessor)
        # One structured-output grammar cache: a sequence keeps its matcher across the hand-over.
        decode = build("decode", grammars=prefill.grammars)
        engine = cls(prefill, decode)
        if args.warmup:
            engine.warmup()
        return engine

    def warmup(self, progress: bool = True) -> float:
        """Both engines' step buckets, compiled side by side, then every transfer bucket."""
        t0 = time.perf_counter()
        list(self._pool.map(lambda e: e.warmup(progress), (self.prefill, self.decode)))
        self.decode.runner.replace_kv_cache(
            lambda cache: self.transfer.warmup(self.prefill.runner.kv_cache, cache))
        return time.perf_counter() - t0

    # ---- requests -----------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt, params: SamplingParams, priority: int = 0,
                    arrival_time: float | None = None, *, final_output_only: bool = False,
                    lora_request=None):
        if request_id in self._transit or request_id in self.decode.requests:
            raise InvalidRequestError(f"request_id {request_id!r} is already in use",
                                      param="request_id")
        if lora_request is not None:  # the decode side continues it on the same adapter
            self.add_lora(lora_request)
        req = self.prefill.add_request(request_id, prompt, params, priority, arrival_time,
                                       final_output_only=final_output_only,
                                       lora_request=lora_request)
        limit_to_first_token(req)
        return req

    def abort(self, request_id: str, reason: str = "abort") -> RequestOutput | None:
        t = self._transit.get(request_id)
        if request_id in self.prefill.requests:
            if t is not None:  # n > 1: choices handed off while others are still computed
                self._drop(t)
                for h in t.handoffs:  # reported running so far: aborted with the others
                    h.src_seq.finish_reason, h.src_seq.finish_reported = reason, False
                    h.src_seq.output.finish()
            return self.prefill.abort(request_id, reason)
        if t is None:
            return self.decode.abort(request_id, reason)
        if t.request is None:  # the prefill side failed or aborted its other choices
            self._drop(t)
            return None
        return self._abort_in_transit(t, reason)

    def _abort_in_transit(self, t: Transit, reason: str) -> RequestOutput:
        self._drop(t)
        t.sync_reported()
        for seq in t.request.choices:
            if seq.finish_reason is None:
                self.decode.outputs.finish(seq, reason, None)
        out = make_request_output(t.request)
        t.request.detach()
        return out

    def _drop(self, t: Transit) -> None:
        """Drop a request's hand-overs that will not complete: both sides' blocks back to their
        pools."""
        del self._transit[t.request_id]
        for h in t.handoffs:
            if h in self._waiting:
                self._waiting.remove(h)
            if h in self._in_flight:
                self._in_flight.remove(h)
            self.prefill.scheduler.free_blocks(h.holder)
            if h.seq is not None:
                self.decode.scheduler.drop_hand_over(h.seq)

    def _drop_orphans(self) -> None:
        """Hand-overs of requests the prefill side dropped (a failed row, update_weights) before
        their other choices left it: never continued."""
        for t in [t for t in self._transit.values() if t.request is None
                  and t.request_id not in self.prefill.requests]:
            self._drop(t)

    def take_failed(self) -> list[tuple[str, RequestFailedError]]:
        failed, self._failed = self._failed, []
        return failed + self.prefill.take_failed() + self.decode.take_failed()

    # ---- the research loop: both engines alike ------------------------------------------------
    @property
    def weight_version(self) -> int:
        return self.decode.weight_version

    def _abort_transit(self) -> list[RequestOutput]:
        return [o for o in map(self.abort, list(self._transit)) if o is not None]

    def update_weights(self, params) -> list[RequestOutput]:
        """Both engines take the new weights; every request in flight is aborted (see
        LLMEngine.update_weights), those between the engines too: first (an n > 1 request's
        choices handed off are reported with its others), then again (finishing the prefill
        engine's in-flight step may hand some over)."""
        outs = self._abort_transit() + self._reported(self.prefill.update_weights(params))
        return outs + self._abort_transit() + self.decode.update_weights(params)

    def sleep(self) -> list[RequestOutput]:
        outs = self._abort_transit() + self._reported(self.prefill.sleep())
        return outs + self._abort_transit() + self.decode.sleep()

    def wake(self) -> None:
        self.prefill.wake()
        self.decode.wake()

    def has_unfinished_requests(self) -> bool:
        return (bool(self._transit) or self.prefill.has_unfinished_requests()
                or self.decode.has_unfinished_requests())

    @property
    def num_waiting(self) -> int:
        return self.prefill.num_waiting + len(self._waiting) + self.decode.num_waiting

    @property
    def lora_engines(self) -> list[LLMEngine]:
        return [self.prefill, self.decode]

    @property
    def requests(self) -> dict:
        return {**self.prefill.requests, **{rid: t.request for rid, t in self._transit.items()
                                            if t.request is not None}, **self.decode.requests}

    # ---- the hand-over ------------------------------------------------------------------------
    def _hand_over(self, seqs: list[Sequence]) -> None:
        """The prefill engine's processed step: hold the blocks of each sequence handed off (after
        caching its prompt's full blocks); once every choice of its request has left the prefill
        side, queue the request's copies, and start those the decode side has room for, before
        the prefill engine dispatches its next step."""
        for seq in seqs:
            if seq.finish_reason == HANDOFF:
                req = seq.request
                holder, tables = self.prefill.scheduler.hold_for_hand_over(seq)
                t = self._transit.get(req.request_id)
                if t is None:
                    t = self._transit[req.request_id] = Transit(req)
                t.handoffs.append(Handoff(t, seq, holder, tables))
        for seq in seqs:  # (after the step's hand-overs: a request's choices finish together)
            t = self._transit.get(seq.request.request_id)
            if t is not None and t.request is None and seq.request.finished:
                t.continue_on(self.tokenizer)
                self._waiting.extend(t.handoffs)
        self._start_transfers()

    def _reserve_decode(self, h: Handoff) -> bool:
        """Admission on the decode side: a sequence slot, its adapter's slot and blocks for the
        prompt + the first token, after matching the prompt against the decode prefix cache (not
        counted in its hit-rate metrics: the prefill side's lookup is the request's). Its own
        waiting (preempted) sequences go first: reserved blocks cannot be preempted until their
        sequence runs, so taking them ahead of a preempted one could leave it waiting forever."""
        sched = self.decode.scheduler
        reserved = sum(x.dst_tables is not None for t in self._transit.values()
                       for x in t.handoffs)  # in flight, or landed before the request's others
        if sched.num_waiting or (sched.num_running + reserved
                                 >= self.decode.config.scheduler.max_num_seqs):
            return False
        reserved = sched.reserve_hand_over(h.seq)  # (a failed adapter load: _start_transfers)
        if reserved is None:
            return False
        cached, h.dst_tables = reserved
        h.first_block = cached // self.block_size
        return True

    def _start_transfers(self) -> None:
        """Dispatch the waiting hand-overs' copies, in order, while the decode side has room."""
        while self._waiting and len(self._in_flight) < MAX_IN_FLIGHT:
            h = self._waiting[0]
            try:
                reserved = self._reserve_decode(h)
            except InvalidRequestError as e:  # its adapter can no longer be read: it fails
                self._fail_in_transit(h, e)
                continue
            if not reserved:
                return
            self._waiting.popleft()
            h.buffer = self.transfer.send(self.prefill.runner.kv_cache,
                                          h.moved(h.src_tables, self._specs, self.block_size))
            h.started = time.perf_counter()
            self._in_flight.append(h)
            self.transfer_metrics.blocks_skipped.inc(h.first_block)

    def _fail_in_transit(self, h: Handoff, error: Exception) -> None:
        """Abort a request between the engines (finish reason "error"), for `take_failed` (its
        prefill output, if not reported yet, is not: `_reported`)."""
        rid = h.transit.request_id
        self._abort_in_transit(h.transit, "error")
        failure = RequestFailedError(f"the engine failed this request: {error!r}", (rid,))
        failure.__cause__ = error
        self._failed.append((rid, failure))

    def _land(self, wait: bool = False) -> None:
        """Scatter every landed copy into the decode cache; pass a request whose copies have all
        landed to the decode scheduler; `wait`: block for the oldest copy first (nothing else to
        do)."""
        if wait and self._in_flight:
            self._in_flight[0].buffer.block_until_ready()
        m = self.transfer_metrics
        for h in [h for h in self._in_flight if h.buffer.is_ready()]:
            m.transfer_seconds.observe(time.perf_counter() - h.started)
            m.transfer_bytes.inc(h.buffer.nbytes)
            m.transfers.inc()
            blocks = h.moved(h.dst_tables, self._specs, self.block_size)
            self.decode.runner.replace_kv_cache(
                lambda cache: self.transfer.receive(cache, h.buffer, blocks))
            self._in_flight.remove(h)
            self.prefill.scheduler.free_blocks(h.holder)
            h.landed = True
            t = h.transit
            if all(x.landed for x in t.handoffs):
                del self._transit[t.request_id]
                t.sync_reported()
                for x in t.handoffs:
                    self.decode.adopt_running(t.request, x.seq)

    # ---- steps --------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Land finished copies and start the ones that now fit; step the prefill engine if its
        last step is done or nothing else can go on (then it waits for that step); step the
        decode engine, or, with nothing to decode, wait for the oldest copy in flight."""
        clock = self.driver.clock()
        self._drop_orphans()
        self._land()
        self._start_transfers()
        clock("hand_over")
        outs: list[RequestOutput] = []
        decoding = self.decode.has_unfinished_requests()
        if self.prefill.has_unfinished_requests():
            if (decoding or self._in_flight) and self.prefill.step_in_flight:
                self.driver.counts["prefill_in_flight"] += 1
            else:
                outs += self._reported(self.prefill.step())
                clock("prefill_step")
                self._land()  # a copy the prefill step started may have landed while it dispatched
                clock("hand_over")
                decoding = self.decode.has_unfinished_requests()
        if decoding:
            outs += self.decode.step()
            clock("decode_step")
        elif self._in_flight and not outs:
            self._land(wait=True)
            clock("copy_wait")
        self._update_gauges()
        return outs

    def _reported(self, outs: list[RequestOutput]) -> list[RequestOutput]:
        """Prefill outputs as the client sees them: a handed-off request is still running (and one
        that reports only its final output reports nothing yet); one that failed in transit
        reports its failure (`take_failed`), not a finish."""
        failed = {rid for rid, _ in self._failed}
        reported = []
        for out in outs:
            if out.request_id in failed:
                continue
            t = self._transit.get(out.request_id)
            if t is not None:
                if t.src.final_output_only:
                    continue
                out.finished = False
                for choice in out.outputs:
                    if choice.finish_reason == HANDOFF:
                        choice.finish_reason = None
            reported.append(out)
        return reported

    def _update_gauges(self) -> None:
        depth = self.transfer_metrics.queue_depth
        depth["prefill"].set(self.prefill.num_waiting)
        depth["transfer"].set(len(self._transit))
        depth["decode"].set(self.decode.num_waiting)
