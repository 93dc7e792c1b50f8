"""LLMEngine: add_request / abort / step (the offline front end `LLM` is in llm.py).

One `step()`:

    1. schedule step N+1 (scheduler.py): decodes, prefill chunks, admissions, preemption;
    2. build its padded arrays and dispatch it (runner.py) -- JAX returns at once;
    3. only now wait for step N's sampled tokens and process them (output_processor.py):
       detokenize, stop checks; then hand the step back to the scheduler, which frees finished
       sequences' blocks and inserts full blocks into the prefix cache.

So the host's scheduling and input building for step N+1 overlap the device running step N; a decode
whose input token is step N's sample reads it from a device array (no host round trip). A sequence
that finished at step N was still scheduled in step N+1: that one token is discarded. The engine
falls back to processing step N first when N ran an on-device decode loop (the host must know how
many tokens it produced) or a penalty request needs its full token history on the host.
"""

from __future__ import annotations

import functools
import logging
import random
import time
import weakref
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxinfer.model.config import ModelConfig
from jaxinfer.model.kernel_table import current_platform
from jaxinfer.engine.args import EngineArgs
from jaxinfer.engine.fixed_state import automatic_decode_loop, refuse_what_fixed_state_lacks
from jaxinfer.engine.itl_target import ItlTarget
from jaxinfer.errors import ConfigError, InvalidRequestError, RequestFailedError
from jaxinfer.core.kv_cache import FixedStateSpec, KVCacheGroups, KVCacheManager
from jaxinfer.core.kv_cache.cache_config import resolve_kv_cache_dtype
from jaxinfer.worker.kv.kv_scales import kv_cache_kernels
from jaxinfer.engine.kv_blocks import params_dtype_name, with_compiled_peak
from jaxinfer.engine.metrics import EngineMetrics, EngineStats
from jaxinfer.engine.protocol import EngineClient
from jaxinfer.engine.startup import StartupTimes
from jaxinfer.worker.executable_cache import ExecutableCache
from jaxinfer.engine.output_processor import OutputProcessor, make_request_output
from jaxinfer.core.outputs import RequestOutput
from jaxinfer.core.request import Request, Sequence, SeqStatus, make_choice
from jaxinfer.worker.runner import ModelRunner, StepHandle
from jaxinfer.sampling_params import SamplingParams
from jaxinfer.core.scheduler import Scheduler
from jaxinfer.spec_decode.speculation import Speculation
from jaxinfer.engine.training_loop import TrainingLoopMixin
from jaxinfer.engine.kv_tier import KVTierMixin, host_tier_for
from jaxinfer.engine.lora import LoRAMixin
from jaxinfer.engine.kernels import engine_kernels
from jaxinfer.structured.grammar import GrammarCompiler
from jaxinfer.model.tokenizer import Tokenizer
from jaxinfer.parallel.sharding import ShardingPlan, per_device_bytes

log = logging.getLogger(__name__)


class LLMEngine(TrainingLoopMixin, LoRAMixin, KVTierMixin, EngineClient):
    """One engine: a scheduler, a runner and an output processor on one replica's devices."""

    weight_version = 0  # +1 per update_weights; on every RequestOutput
    # The memory plan's figures (from_engine_args: pre-load check, KV plan, compiled peak).
    memory_plan: dict = {}

    def __init__(self, cfg: ModelConfig, params, tokenizer: Tokenizer | None, args: EngineArgs,
                 *, num_blocks: int, metrics: EngineMetrics | None = None,
                 plan: ShardingPlan | None = None, draft=None, role: str | None = None,
                 grammars: GrammarCompiler | None = None,
                 outputs_cls: type[OutputProcessor] = OutputProcessor):
        """`plan`: the replica's mesh and shardings, params already placed by it (None: the
        default device). `draft`: the loaded draft model of --speculative-model. A front end
        over several engines passes `role` (a disaggregated pair's "prefill" | "decode": what
        warm-up compiles first), `grammars` (one compiled-grammar cache for all its engines) and
        `outputs_cls` (the prefill engine's hand-off output processor)."""
        self.cfg, self.tokenizer = cfg, tokenizer
        self.config = config = args.create_engine_config()
        cache, sched = config.cache, config.scheduler
        self.max_model_len = config.model.max_model_len or cfg.max_position_embeddings
        if self.max_model_len > cfg.max_position_embeddings:
            raise ConfigError(f"--max-model-len {self.max_model_len} exceeds the model's "
                              f"max_position_embeddings {cfg.max_position_embeddings}")
        # A sequence may grow to max_model_len tokens; in a smaller pool it would wait forever for
        # blocks that no other sequence can free.
        groups = KVCacheGroups.for_model(cfg, cache.hybrid_kv_cache)
        # The hand-over copies the attention group's prompt blocks and each state-space layer's
        # state pages (frontends/disagg_handoff.py `Handoff.moved`), not a windowed group's.
        if role is not None and sum(not isinstance(spec, FixedStateSpec)
                                    for spec in groups.specs) > 1:
            raise ConfigError("a disaggregated engine takes one KV group: build it with "
                              "from_engine_args, which turns --hybrid-kv-cache off")
        kv_dtype = resolve_kv_cache_dtype(cache.kv_cache_dtype, params_dtype_name(params))
        refuse_what_fixed_state_lacks(groups, config)
        need = groups.blocks_for_sequence(self.max_model_len, sched.max_num_batched_tokens,
                                          cache.block_size, kv_dtype)
        if num_blocks < need:
            raise ConfigError(
                f"the KV cache ({num_blocks} blocks x {cache.block_size} tokens) cannot hold one "
                f"sequence of max_model_len={self.max_model_len} tokens ({need} blocks over "
                f"{groups.num_groups} KV group(s)): raise --num-blocks (or "
                f"--gpu-memory-utilization) or lower --max-model-len")
        self.model_name = config.model.model_name
        self.metrics = metrics or EngineMetrics(self.model_name)
        self.metrics.weight_bytes.set(per_device_bytes(params))
        self.eos_token_ids = tuple(tokenizer.eos_token_ids) if tokenizer else cfg.eos_token_ids
        self.num_total_blocks = num_blocks
        loop_steps, loop_max_seqs = config.decode_loop(
            automatic_decode_loop(groups, config, current_platform().gpu))
        self.scheduler = Scheduler(
            KVCacheManager(num_blocks, cache.block_size, cache.enable_prefix_caching, groups,
                           host_tier_for(cfg, cache, kv_dtype, groups), kv_dtype),
            max_num_seqs=sched.max_num_seqs,
            max_num_batched_tokens=sched.max_num_batched_tokens,
            long_prefill_chunk=sched.long_prefill_chunk, max_model_len=self.max_model_len,
            decode_steps_per_call=loop_steps, decode_loop_max_seqs=loop_max_seqs,
            max_step_tokens_while_decoding=sched.max_step_tokens_while_decoding,
            make_choice=functools.partial(make_choice, tokenizer))
        kernels = kv_cache_kernels(engine_kernels(config), kv_dtype, cfg, params,
                                   scales=cache.kv_cache_scales, tokenizer=tokenizer,
                                   model_dir=None if config.model.load_format == "dummy"
                                   else config.model.model_path)
        self.runner = ModelRunner(
            cfg, params, kernels, num_blocks=num_blocks,
            block_size=cache.block_size, max_model_len=self.max_model_len,
            max_num_seqs=sched.max_num_seqs, max_num_batched_tokens=sched.max_num_batched_tokens,
            kv_dtype=kv_dtype, decode_steps_per_call=loop_steps,
            decode_loop_max_seqs=loop_max_seqs, plan=plan,
            executable_cache=ExecutableCache.under(config.compilation.compilation_cache_dir),
            compile_role=role,
            kv_groups=groups)
        self.runner.set_async_launch(sched.async_launch)
        # Sets the scheduler's cap on a decoding step's tokens after every step (itl_target.py).
        self.itl = ItlTarget.for_engine(sched, self.runner.buckets)
        self._init_kv_tier()
        self.metrics.set_cache_config(cache.block_size, jnp.dtype(kv_dtype).name, num_blocks,
                                      groups.page_bytes(cache.block_size, kv_dtype))
        self.outputs = outputs_cls(self.metrics, self.max_model_len, self.eos_token_ids)
        self.grammars = grammars or GrammarCompiler(tokenizer, cfg.vocab_size, self.eos_token_ids)
        self.requests: dict[str, Request] = {}
        # What step() reports per advanced request, and the tokenizer of the choices' output text:
        # see emit_token_deltas.
        self.make_output: Callable[..., object] = make_request_output
        self._text_tokenizer = tokenizer
        self._rng = random.Random(config.model.seed)
        self._inflight: StepHandle | None = None
        observe = config.observability
        self._profiling_left = observe.profile_steps if observe.profile_dir else 0
        self.stats = EngineStats()
        engine = weakref.ref(self)  # (the metrics may outlive the engine)
        self.metrics.track_stats(lambda: getattr(engine(), "stats", None))
        self._preempt_seen = 0
        # Requests failed by the engine itself (see `_fail`), for the caller to report: (id, error).
        self._failed: list[tuple[str, RequestFailedError]] = []
        self.asleep = False
        self.startup = StartupTimes()  # from_engine_args fills the phases before warm-up
        spec = config.speculative
        self.spec = spec and Speculation(spec, self.scheduler, self.runner,
                                         self.metrics.spec_decode(spec.num_speculative_tokens), draft,
                                         sched.spec_loop_iterations)
        # Called with each processed step's live sequences before the scheduler frees the finished
        # ones' blocks (jaxinfer/disagg hands prompts over to a decode engine there).
        self.on_processed: Callable[[list[Sequence]], None] | None = None
        self._init_lora(plan)

    def adopt_running(self, req: Request, seq: Sequence) -> None:
        """Take over a request whose sequence's KV blocks this engine's scheduler already holds
        (reserved with `Scheduler.reserve_hand_over`, filled by a disaggregated transfer): it runs
        from the next step."""
        self.requests[req.request_id] = req
        self.scheduler.add_running(seq)

    def emit_token_deltas(self, make_output: Callable[..., object]) -> None:
        """Report each step's new token ids only, built by `make_output(req, full=False)`, and
        keep no output text: the engine-core process (frontends/engine_core.py), whose server
        process detokenizes and matches stop strings (and finishes choices with finish_choice)."""
        self.make_output = make_output
        self._text_tokenizer = None
        self.scheduler.make_choice = functools.partial(make_choice, None)

    def finish_choice(self, request_id: str, index: int, stop_reason: str) -> None:
        """Finish choice `index` with "stop" at a stop string its server process matched; the
        request leaves the engine once every choice has finished."""
        req = self.requests.get(request_id)
        seq = None if req is None or index >= len(req.choices) else req.choices[index]
        if seq is None or seq.status is SeqStatus.FINISHED:
            return
        self.outputs.finish(seq, "stop", stop_reason)
        self.scheduler.finish(seq)
        seq.new_token_ids = []
        if req.finished:
            self.requests.pop(request_id, None)
            req.detach()
        self._update_gauges()

    def hand_processed_steps_to(self, callback: Callable[[list[Sequence]], None]) -> None:
        """Call `callback` with each processed step's live sequences, before the scheduler frees
        the finished ones' blocks (a disaggregated prefill engine hands prompts over there)."""
        self.on_processed = callback

    # ---- construction from flags (engine_from_args.py) -------------------------------------
    @classmethod
    def from_engine_args(cls, args: EngineArgs, metrics: EngineMetrics | None = None,
                         mesh: Mesh | None = None, **parts) -> "LLMEngine":
        """`mesh`: this replica's sub-mesh (DataParallelEngine passes one per replica); default:
        the first --tensor-parallel-size devices. `parts`: `role`, `grammars`, `outputs_cls`
        (see __init__). Loads and plans as engine_from_args.py says, then warms up (--warmup)."""
        from jaxinfer.engine.engine_from_args import build_engine
        engine = build_engine(cls, args, metrics, mesh, **parts)
        if engine.config.compilation.warmup:
            engine.warmup()
        return engine

    def warmup(self, progress: bool = True) -> float:
        with self.startup.compiling(), self.startup.phase("warmup"):
            # (as many compiles at once as the memory plan kept autotune room for)
            workers = (self.memory_plan.get("kv") or {}).get("compile_workers")
            seconds = self.runner.warmup(
                progress, workers, background=self.config.compilation.background_compile)
        self.metrics.track_compiler(self.runner.compiler)
        cache = self.runner.executable_cache
        if cache is not None:
            self.startup.counts.update(executables_loaded=cache.hits,
                                       executable_cache_read_s=round(cache.load_seconds, 3),
                                       executable_cache_write_s=round(cache.store_seconds, 3))
        self.memory_plan = with_compiled_peak(self.memory_plan, self.runner)
        slowest = sorted(self.runner.warmup_seconds.items(), key=lambda kv: -kv[1])[:3]
        log.info("compiled %d step shapes in %.1f s (slowest: %s)", len(self.runner.warmup_seconds),
                 seconds, ", ".join(f"{name} {s:.1f} s" for name, s in slowest))
        return seconds

    # ---- requests -----------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    priority: int = 0, arrival_time: float | None = None, *,
                    final_output_only: bool = False, lora_request=None) -> Request:
        """Validate and queue a request (on `lora_request`'s adapter). Raises InvalidRequestError."""
        if request_id in self.requests:
            raise InvalidRequestError(f"request_id {request_id!r} is already in use",
                                      param="request_id")
        params.validate(self.cfg.vocab_size)
        if params.n > (most := self.config.scheduler.max_num_seqs):  # side by side, a slot each
            raise InvalidRequestError(f"n={params.n} exceeds --max-num-seqs {most}",
                                      param="n")
        if params.stop and self.tokenizer is None:
            raise InvalidRequestError("stop strings need a tokenizer; this model has none",
                                      param="stop")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("text prompts need a tokenizer; pass token ids",
                                          param="prompt")
            prompt_ids = self.tokenizer.encode(prompt)
        else:
            prompt_ids = list(prompt)
        if not prompt_ids:
            raise InvalidRequestError("prompt is empty (0 tokens)", param="prompt")
        bad = [t for t in prompt_ids if not isinstance(t, int) or not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise InvalidRequestError(f"prompt token id {bad[0]!r} is outside the vocabulary "
                                      f"[0, {self.cfg.vocab_size})", param="prompt")
        n = len(prompt_ids)
        self._check_context(n, params)
        seed = params.seed % (1 << 32) if params.seed is not None else self._rng.getrandbits(32)
        so = params.structured_outputs
        grammar = so and self.grammars.compile(so).after_reasoning(so.reasoning_end_token_ids)
        req = Request(request_id, prompt_ids, params, seed, self.eos_token_ids, priority, arrival_time,
                      grammar, weight_version=self.weight_version,
                      final_output_only=final_output_only)
        req.lora_id = self._lora_id(lora_request)
        self.requests[request_id] = req
        if params.n == 1 or n == 1:  # (a 1-token prompt has nothing to share before its last token)
            for i in range(params.n):
                self.scheduler.add(make_choice(self._text_tokenizer, req, i, 0))
        else:
            req.prompt_seq = Sequence(f"{request_id}#prompt", req, -1, prompt_ids[:-1])
            self.scheduler.add(req.prompt_seq)
        return req

    def _check_context(self, n: int, params: SamplingParams) -> None:
        """A prompt of `n` tokens and the outputs it asks for must fit max_model_len (OpenAI's
        wording: the server answers it as is)."""
        limit = self.max_model_len
        if n >= limit:  # the prompt alone fills the context, whatever max_tokens asks
            raise InvalidRequestError(
                f"This model's maximum context length is {limit} tokens. However, your prompt has "
                f"{n} tokens, leaving no room for a completion.", param="prompt")
        if params.max_tokens is not None and n + params.max_tokens > limit:
            raise InvalidRequestError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{n + params.max_tokens} tokens ({n} in the prompt, {params.max_tokens} in the "
                f"completion). Please reduce the length of the prompt or completion.",
                param="max_tokens")
        if n + params.min_tokens > limit:  # (max_tokens None: nothing else bounds it)
            raise InvalidRequestError(
                f"min_tokens={params.min_tokens}: a prompt of {n} tokens leaves room for at most "
                f"{limit - n} tokens in this model's maximum context length of {limit} tokens",
                param="min_tokens")

    def abort(self, request_id: str, reason: str = "abort") -> RequestOutput | None:
        """Stop a request now and free its KV blocks. Returns its final output (finish reason
        `reason`), or None if the request is unknown or already finished."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        if req.prompt_seq is not None and req.prompt_seq.status is not SeqStatus.FINISHED:
            self.scheduler.finish(req.prompt_seq)
        for i, seq in enumerate(req.choices):
            if seq is None:  # an n > 1 choice not forked yet: report it aborted too
                seq = make_choice(self._text_tokenizer, req, i, 0)
                seq.status = SeqStatus.FINISHED
                self.outputs.finish(seq, reason, None)
            elif seq.status is not SeqStatus.FINISHED:
                self.outputs.finish(seq, reason, None)
                self.scheduler.finish(seq)
        out = make_request_output(req)
        req.detach()
        self._update_gauges()  # an abort at idle is followed by no step: the gauges show it now
        return out

    # ---- one request's failure is not the engine's ------------------------------------------
    def _fail(self, request_id: str, error: BaseException) -> None:
        """Abort a request the engine could not build, run or process (blocks freed, finish reason
        "error") and queue it for `take_failed`."""
        if self.abort(request_id, reason="error") is None:
            return
        log.error("request %s failed and was aborted: %r", request_id, error)
        failure = error if isinstance(error, RequestFailedError) else RequestFailedError(
            f"the engine failed this request: {error!r}", (request_id,))
        if failure is not error:
            failure.__cause__ = error
        self._failed.append((request_id, failure))

    def take_failed(self) -> list[tuple[str, RequestFailedError]]:
        """The requests failed since the previous call (each already aborted)."""
        failed, self._failed = self._failed, []
        return failed

    def _dispatch_failed(self, sched, error: Exception) -> None:
        """A step could not be built or dispatched. Undo what scheduling it did to its sequences (so
        the others are scheduled again next step, as if it never happened) and fail the requests at
        fault: those the error names, else every request in the step. When the failure took the
        device state with it (donated buffers gone), the engine cannot go on: re-raise."""
        state = jax.tree_util.tree_leaves((self.runner.kv_cache, self.runner.last_tokens))
        if any(a.is_deleted() for a in state if hasattr(a, "is_deleted")):
            raise error
        self.scheduler.unschedule(sched.scheduled)
        culprits = getattr(error, "request_ids", ()) or tuple(dict.fromkeys(
            e.seq.request.request_id for e in sched.scheduled))
        for rid in culprits:
            self._fail(rid, error)

    def _abort_all(self) -> list[RequestOutput]:
        """Finish the in-flight step, then abort every unfinished request: their outputs."""
        outs = []
        if self._inflight is not None:
            outs = self._collect(self._process(self._inflight))
            self._inflight = None
        for rid in list(self.requests):
            out = self.abort(rid)
            if out is not None:
                outs.append(out)
        self._update_gauges()
        return outs

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or self._inflight is not None

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    @property
    def step_in_flight(self) -> bool:
        """A dispatched step's results are not ready yet (step() would wait for them)."""
        return self._inflight is not None and not self._inflight.is_ready()

    # ---- the step loop ------------------------------------------------------------------------
    def _must_process_first(self) -> bool:
        h = self._inflight
        if h is None:
            return False
        # A hand-over hook (disaggregation) queues its KV copy ahead of the next step, not behind.
        # A decode loop overlaps the next step like a single step does (its tokens are counted as
        # pending); a speculative step (also several tokens a row) does not.
        if (not self.config.scheduler.async_scheduling or (h.is_loop and h.loop_row_steps is None)
                or self.on_processed is not None):
            return True
        if self.spec is not None and self.spec.active(len(self.scheduler.running),
                                                      self.scheduler.num_waiting):
            return True
        # Penalties read the token history, a grammar's bitmask needs its matcher up to date.
        return any((s.request.params.uses_penalties or s.grammar is not None) and s.num_pending
                   for s in self.scheduler.running)

    def step(self) -> list[RequestOutput]:
        """Schedule and dispatch one step; return the outputs of the previous one (or of this one,
        when the step cannot be overlapped)."""
        if self.asleep:
            raise RuntimeError("the engine is asleep (its KV cache is released): call wake() first")
        touched: list[Request] = []
        processed_first = self._must_process_first()
        if processed_first:
            touched += self._process(self._inflight)
            ready_time = self._inflight.ready_time
            self._inflight = None
        self._maybe_profile()
        t0 = time.perf_counter()
        sched = self.scheduler.schedule()
        self._fail_lora_admissions()
        self._move_kv(sched)
        t_sched = time.perf_counter()
        handle = None
        if sched:
            if self._inflight is not None and self._inflight.is_ready():
                self.stats.idle_dispatches += 1  # overlapped, but the device got there first
            try:
                handle = self.runner.execute(sched)
            except Exception as e:  # one request's failure is not the engine's
                self._dispatch_failed(sched, e)
            else:
                if handle.loop_row_steps is not None:
                    self.scheduler.loop_dispatched(sched.decodes, handle.loop_row_steps)
                self.stats.record_dispatch(t0, t_sched, self.runner.built_at, handle.dispatch_time)
                if processed_first:  # the device sat idle from the previous result to this dispatch
                    self.stats.sync_gaps += 1
                    self.stats.sync_gap_s += handle.dispatch_time - ready_time
        if self._inflight is not None:
            touched += self._process(self._inflight)
        self._inflight = handle
        self._update_gauges()
        return self._collect(touched)

    def _process(self, handle: StepHandle) -> list[Request]:
        """A finished step's tokens -> sequence state (output processor), then the step's live
        sequences back to the scheduler (blocks of the finished ones, prefix cache), then the
        requests whose rows failed are failed. Raises only when the step's results are lost."""
        t0 = time.perf_counter()
        touched, seqs = self.outputs.process(handle)
        self.scheduler.tokens_arrived(self.outputs.take_counts())
        if self.spec is not None:
            self.spec.record(handle)
        if self.on_processed is not None:
            self.on_processed(seqs)
        self.scheduler.update_from_output(seqs)
        self.scheduler.max_step_tokens_while_decoding = self.itl.step_done(
            handle, len(self.scheduler.running), self.scheduler.num_waiting_to_decode())
        for rid, error in self.outputs.take_failed():
            self._fail(rid, error)
        self.stats.record_process(time.perf_counter() - t0, handle.wait_s)
        return touched

    def _collect(self, touched: list[Request]) -> list[RequestOutput]:
        outs, seen = [], {rid for rid, _ in self._failed}  # failed: reported by take_failed instead
        for req in touched:
            if req.request_id in seen:
                continue
            seen.add(req.request_id)
            if req.final_output_only and not req.finished:
                continue
            out = self.make_output(req, full=req.final_output_only)
            if out.outputs:
                outs.append(out)
            if req.finished:
                self.requests.pop(req.request_id, None)
                req.detach()
        return outs

    def _update_gauges(self) -> None:
        m = self.metrics
        m.num_requests_running.set(len({s.request.request_id for s in self.scheduler.running}))
        m.num_requests_waiting.set(self.scheduler.num_waiting)
        usage, used, total, st = self.scheduler.kv_cache_stats()
        m.kv_cache_usage_perc.set(usage)
        m.kv_cache_used_blocks.set(used)
        m.kv_cache_total_blocks.set(total)
        m.update_prefix_cache(st.queries, st.hits)
        new_preempt = self.scheduler.num_preemptions - self._preempt_seen
        if new_preempt:
            m.num_preemptions.inc(new_preempt)
        self._preempt_seen = self.scheduler.num_preemptions

    def _maybe_profile(self) -> None:
        if not self._profiling_left:
            return
        observe = self.config.observability
        if self._profiling_left == observe.profile_steps:
            jax.profiler.start_trace(observe.profile_dir)
        self._profiling_left -= 1
        if self._profiling_left == 0:
            jax.block_until_ready(self.runner.kv_cache)
            jax.profiler.stop_trace()
            log.info("wrote a profiler trace of %d steps to %s", observe.profile_steps,
                     observe.profile_dir)
