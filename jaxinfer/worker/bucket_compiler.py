"""Making the runner's step executables: the buckets the first requests need before the engine
reports ready, the rest on a background thread while it serves.

A *unit* is what must be compiled before a bucket can take a step: a mixed bucket's forward (T
tokens, S = min(T, max_num_seqs) rows) or a decode bucket's, with the sampler of its S rows in
every SAMPLE_VARIANTS variant (compiled once per S, shared between units; both take the step's one
packed buffer, step_programs.packed_forward and packed_sample); or a decode bucket's on-device
loop in both LOOP_VARIANTS. A unit
is *ready* once all its parts are; only then does `buckets.step_shape` route steps to it. The first set is
the largest mixed bucket (every step fits it, so no step ever waits for a compile), the one of a
short prompt (SHORT_PROMPT_TOKENS: a first request's prefill runs at its size), the smallest
decode bucket (a lone request decodes at its own size from the start), and the block copies of
every copy bucket, also before ready, and then every unit the executable cache already holds (a
load, no tracing: after one complete start, a warm start is ready with all of them and compiles
nothing beside its steps). The other units follow in the background, smallest decode
buckets first (concurrency grows from one), then loops (of the decode buckets the runner loops
in, `ModelRunner.loop_buckets`; until one is ready its decodes take single steps, so the loop, on
by default, adds nothing to the time to ready), then mixed buckets; until a bucket is ready, its
steps run padded up to the smallest ready bucket that fits, which gives the same tokens. A
disaggregated pair's engines (`ModelRunner.compile_role`) differ: the decode engine takes every
decode bucket first (a 64-row decode padded into the 2048-token mixed bucket costs a prefill
chunk per token), the prefill engine, which never runs a pure-decode step, compiles none. With an
EAGLE-3 head attached, a forward unit is the head's stream-writing forward, which its steps run,
and each loop bucket also gets a *spec* unit: the on-device speculative loop
(`spec_decode/spec_loop.py`) of each LOOP_VARIANTS variant, greedy-only and sampled; a loop not yet
compiled compiles through jit on its first call, as before warm-up had them.

Lowering (Python: tracing, MLIR) runs on one thread and XLA's compiles on a pool, since XLA
releases the GIL. Steps are lowered against shape-and-sharding specs of the weights, KV cache and
last-token array taken when the compiler is built, never the live arrays, which the running steps
donate. Each part is first looked up in the executable cache (no tracing on a hit) and stored
there once compiled. At most one compile per pool thread is queued at a time, so `stop()` (called
at interpreter exit too) leaves only the compiles already running in XLA to finish.

In the background, the compiles give way to the steps they run beside (compile_priority.py).
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.worker.responsive_gil import responsive_gil
from jaxinfer.parallel.transfer import packed_step_specs, place_step_inputs, split_step_specs
from jaxinfer.worker.buckets import Buckets
from jaxinfer.worker.compile_priority import CompileStopped, StepPacer, background_pool
from jaxinfer.worker.programs import (LOOP_VARIANTS, SAMPLE_VARIANTS, forward_key, model_inputs,
                                      shape_specs, variant_label)
from jaxinfer.worker.sampler import BASE_SAMPLER, SamplerVariant
from jaxinfer.worker.step_inputs import StepBatch

log = logging.getLogger(__name__)

SHORT_PROMPT_TOKENS = 32

MAX_COMPILE_WORKERS = 8


def compile_workers() -> int:
    """How many XLA compiles the bucket compiler runs at once (the planner keeps room for as
    many GPU autotunes, kv/compile_scratch.py)."""
    return min(MAX_COMPILE_WORKERS, os.cpu_count() or 1)


@dataclasses.dataclass(frozen=True)
class Unit:
    kind: str  # "mixed" | "decode" | "loop" | "spec"
    size: int  # tokens (mixed) or sequences (decode, loop)

    @property
    def name(self) -> str:
        return f"{self.kind} {self.size}"


class BucketCompiler:
    def __init__(self, runner, max_workers: int | None = None):
        """`runner`: the ModelRunner whose program table (programs.py) this fills."""
        self.runner = runner
        b: Buckets = runner.buckets
        role = runner.compile_role
        decodes = [] if role == "prefill" else list(b.decode_buckets)
        units = ([Unit("mixed", t) for t in b.token_buckets]
                 + [Unit("decode", s) for s in decodes])
        units += [Unit("loop", s) for s in decodes if s in runner.loop_buckets]
        # An EAGLE-3 head's or MTP module's on-device speculative loop, in its buckets.
        self._spec_loop = runner.speculation and runner.speculation.loop
        if self._spec_loop is not None:
            units += [Unit("spec", s) for s in decodes if s in runner.spec_loop_buckets]
        self.units = units
        # The first decode bucket: the smallest that holds more than one sequence (a lone
        # sequence's own bucket, Buckets.lone_sequence, comes first in the background). A
        # disaggregated decode engine takes all of them first: it is handed up to max-num-seqs
        # running sequences at once, and a decode step whose bucket is not ready runs padded
        # into the largest mixed one, a whole prefill chunk's compute (issue 27).
        if role == "decode" or not decodes:
            first_decodes = decodes
        else:
            first_decodes = [next((s for s in decodes if s > 1), decodes[0])]
        # The largest mixed bucket (every step fits it) and a short prompt's: a request sent at
        # ready (the README's, 27 tokens) would otherwise run its prefill padded to the largest,
        # seconds on a CPU (issue 62).
        short = b.mixed_shape(min(SHORT_PROMPT_TOKENS, b.token_buckets[-1]))[0]
        first = {Unit("mixed", b.token_buckets[-1]), Unit("mixed", short)}
        for s in first_decodes:
            first.add(Unit("decode", s))
        self.first = [u for u in units if u in first]
        order = {"decode": 0, "loop": 1, "spec": 2, "mixed": 3}
        self.rest = sorted((u for u in units if u not in first),
                           key=lambda u: (order[u.kind], u.size))
        self.ready_forwards: set[tuple[int, int, int]] = set()
        self.ready_loops: set[int] = set()
        self.seconds: dict[str, float] = {}  # part name -> compile (or cache load) seconds
        self._specs = shape_specs((runner.params, runner.kv_cache, runner.last_tokens))
        # An EAGLE-3 head's: the ordinary steps run its stream-writing forward instead.
        self._writer = runner.speculation and runner.speculation.stream_writer
        self._forward_program = ("packed forward" if self._writer is None
                                 else self._writer.forward_program)
        self._sample_program = "packed sample" if self._writer is None else "sample"
        self._logits_sharding = self._tail_sharding = None
        self._samplers: dict[tuple[int, SamplerVariant], Future] = {}
        self._done = threading.Condition()
        self._num_ready = 0
        self._num_failed = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # The runner tells it of each step; background lowering waits for a quiet moment.
        self.pacer = StepPacer(self._stop)
        workers = self._workers = max_workers or compile_workers()
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="jaxinfer-compile")
        self._slots = threading.Semaphore(workers)  # compiles submitted and not finished
        ref = weakref.ref(self)
        # Before the pool's own exit hook joins its threads (hooks run last-registered first):
        # a stopped compiler submits nothing more. (threading's hook, as concurrent.futures uses.)
        register = getattr(threading, "_register_atexit", atexit.register)
        register(lambda: (c := ref()) is not None and c.stop(at_exit=True))

    # ---- progress -------------------------------------------------------------------------
    @property
    def num_ready(self) -> int:
        return self._num_ready

    @property
    def num_units(self) -> int:
        return len(self.units)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every unit is ready (or stopped, or `timeout`): whether all are ready."""
        with self._done:
            self._done.wait_for(lambda: (self._num_ready + self._num_failed == len(self.units)
                                         or self._stop.is_set()), timeout)
            return self._num_ready == len(self.units)

    def stop(self, at_exit: bool = False) -> None:
        """Cancel the compiles not started and wait for the background thread (an XLA compile
        already running finishes first). At interpreter exit, say what the next start will have to
        compile again."""
        left = len(self.units) - self._num_ready - self._num_failed
        if at_exit and left and not self._stop.is_set():
            log.warning("exiting with %d of %d step buckets not compiled: the next start compiles "
                        "them again (`jaxinfer warmup` with the same flags compiles every bucket "
                        "into the cache and exits)", left, len(self.units))
        self._stop.set()
        with self._done:
            self._done.notify_all()
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        self._pool.shutdown(wait=True)

    # ---- compiling ----------------------------------------------------------------------------
    def compile_first(self, progress_bar=None) -> None:
        """The first set and the block copies, blocking, then every unit the executable cache
        already holds: on return the engine can serve every step (each fits the largest mixed
        bucket)."""
        futures = [self._submit(u) for u in self.first] + self._compile_copies()
        for f in futures:
            f.result()
        # The samplers take the forwards' logits (and packed inputs' tail): compiled for exactly
        # their sharding.
        first = next(iter(self.runner.programs.compiled[self._forward_program].values()))
        self._logits_sharding = first.output_shardings[0]
        if self._writer is None:
            self._tail_sharding = first.output_shardings[2]
        for u in self.first:
            for f in self._sampler_parts(u):
                f.result()
            self._mark_ready(u)
            if progress_bar is not None:
                progress_bar.update()
        # Every other unit the executable cache holds is loaded now too (no tracing, a file read
        # and a deserialization each): after one complete start, a warm start is ready with
        # every bucket, and nothing runs beside its first steps (issue 38: loading the rest in
        # the background still traced each unit's input placement while steps ran).
        cached = [u for u in self.rest if self._all_cached(u)]
        for u in cached:
            for f in [self._submit(u), *self._sampler_parts(u)]:
                f.result()
            self._mark_ready(u)
            if progress_bar is not None:
                progress_bar.update()
        self.rest = [u for u in self.rest if u not in cached]

    def compile_rest(self, background: bool, progress_bar=None) -> None:
        """The other units: on a background thread, or here, blocking until all are ready."""
        def run() -> list[Future]:
            parts: list[Future] = []
            for u in self.rest:
                if background:
                    self.pacer.wait_for_quiet()
                unit_parts = [self._submit(u), *self._sampler_parts(u)]
                self._when_all(unit_parts, u, progress_bar)
                parts += unit_parts
            return parts

        def background_run():
            try:
                with responsive_gil():
                    run()
            except CompileStopped:
                pass
            except Exception:  # a bucket that fails to compile is not the engine's
                log.exception("background compilation failed; larger buckets serve its steps")
                with self._done:
                    self._num_failed = len(self.units) - self._num_ready
                    self._done.notify_all()

        if background and self.rest:
            first_pool, self._pool = self._pool, background_pool(self._workers)
            first_pool.shutdown(wait=False)  # its compiles are all done
            self._thread = threading.Thread(target=background_run, name="jaxinfer-bucket-compiler",
                                            daemon=True)
            self._thread.start()
        else:
            for f in run():
                f.result()  # a failed compile raises here
            self.wait()

    def _when_all(self, parts: list[Future], unit: Unit, progress_bar) -> None:
        left = [len(parts)]
        lock = threading.Lock()

        def one_done(f: Future) -> None:
            if f.cancelled() or f.exception() is not None:
                if not f.cancelled():
                    log.error("compiling %s failed: %r", unit.name, f.exception())
                with lock:
                    failed, left[0] = left[0] > 0, 0
                if failed:
                    with self._done:
                        self._num_failed += 1
                        self._done.notify_all()
                return
            with lock:
                left[0] -= 1
                if left[0]:
                    return
            self._mark_ready(unit)
            if progress_bar is not None:
                progress_bar.update()

        for f in parts:
            f.add_done_callback(one_done)

    def _mark_ready(self, unit: Unit) -> None:
        b = self.runner.buckets
        if unit.kind == "loop":
            self.ready_loops.add(unit.size)
        elif unit.kind == "spec":
            pass  # until ready, a speculative loop compiles through jit on its first call
        elif unit.kind == "decode":
            self.ready_forwards.add((unit.size,) * 3)
        else:
            self.ready_forwards.add((unit.size, b.mixed_shape(unit.size)[1], 0))
        with self._done:
            self._num_ready += 1
            finished = self._num_ready == len(self.units)
            self._done.notify_all()
        if finished:  # its threads are not needed any more
            self._pool.shutdown(wait=False)

    def _rows(self, unit: Unit) -> int:
        return self.runner.buckets.mixed_shape(unit.size)[1] if unit.kind == "mixed" else unit.size

    def _sampler_specs(self, unit: Unit) -> list[tuple[str, tuple, dict, tuple]]:
        """(name, args, static arguments, table key) of each sampler a forward unit needs; none
        for a loop, which samples inside."""
        if unit.kind in ("loop", "spec"):
            return []
        s = self._rows(unit)
        logits = jax.ShapeDtypeStruct((s, self.runner.cfg.vocab_size), jnp.float32,
                                      sharding=self._logits_sharding)
        last = self._specs[2]
        specs = []
        for variant in SAMPLE_VARIANTS:
            name = f"sample {s} {variant_label(variant)}"
            if self._writer is not None:
                batch = self.padding_batch("decode", s, variant)
                specs.append((name, (logits, last, batch.sampling, batch.emit_slot),
                              dict(variant=variant), (s, variant)))
                continue
            _, apart, packing, tail = split_step_specs(
                self._host_padding_batch("decode", s, variant), self.runner.plan,
                self.runner.sampling_tail(s))
            tail = jax.ShapeDtypeStruct(tail.shape, tail.dtype, sharding=self._tail_sharding)
            specs.append((name, (logits, last, tail, apart),
                          dict(packing=packing.sample, variant=variant), (s, variant)))
        return specs

    def _step_specs(self, unit: Unit) -> list[tuple[str, tuple, dict, tuple]]:
        """(name, args, static arguments, table key) of the unit's forward, or of its loops."""
        r = self.runner
        params, kv, last = self._specs
        if unit.kind == "spec":
            return [spec for variant in LOOP_VARIANTS for spec in self._spec_loop.compile_specs(
                self._specs, self.padding_batch("decode", unit.size, variant), variant)]
        if unit.kind != "loop":
            w = self._writer
            if w is not None:
                batch = self.padding_batch(unit.kind, unit.size, BASE_SAMPLER)
                return [(f"{unit.name} streams {w.aux_layers}",
                         (params, kv, last, model_inputs(batch), shape_specs(w.streams)), {},
                         forward_key(batch))]
            batch = self._host_padding_batch(unit.kind, unit.size, BASE_SAMPLER)
            packed, _, packing, _ = split_step_specs(batch, r.plan,
                                                     r.sampling_tail(batch.md.num_seqs))
            return [(unit.name, (params, kv, last, packed), dict(packing=packing.model),
                     forward_key(batch))]
        specs = []
        for variant in LOOP_VARIANTS:
            batch = self._host_padding_batch("decode", unit.size, variant)
            packed, apart, packing = packed_step_specs(batch, r.plan)
            specs.append((f"{unit.name} {variant_label(variant)}",
                          (params, kv, last, packed, apart, np.zeros(unit.size, np.int32)),
                          dict(packing=packing, variant=variant,
                               num_steps=r.decode_steps_per_call), (unit.size, variant)))
        return specs

    def _sampler_parts(self, unit: Unit) -> list[Future]:
        """The samplers a forward unit needs (each compiled once, shared between units of the same
        row count)."""
        parts = []
        for name, args, static, key in self._sampler_specs(unit):
            f = self._samplers.get(key)
            if f is None:
                f = self._samplers[key] = self._compile_or_load(name, self._sample_program, args,
                                                                static, key)
            parts.append(f)
        return parts

    def _program(self, unit: Unit) -> str:
        """The program table entry the unit's `_step_specs` compile into."""
        if unit.kind == "loop":
            return "decode loop"
        if unit.kind == "spec":
            return self._spec_loop.program
        return self._forward_program

    def _submit(self, unit: Unit) -> Future:
        """The unit's forward or loops, as one future."""
        if unit.kind == "spec" or (unit.kind != "loop" and self._writer is not None):
            self._place_inputs(unit)  # these programs take placed batches (put_tree's unpacking)
        program = self._program(unit)
        parts = [self._compile_or_load(name, program, args, static, key)
                 for name, args, static, key in self._step_specs(unit)]
        every: Future = Future()

        def one_done(_):
            if all(f.done() for f in parts) and not every.done():
                errors = [f.exception() for f in parts if not f.cancelled() and f.exception()]
                if any(f.cancelled() for f in parts):
                    every.cancel()
                elif errors:
                    every.set_exception(errors[0])
                else:
                    every.set_result(None)

        for f in parts:
            f.add_done_callback(one_done)
        return every

    def _all_cached(self, unit: Unit) -> bool:
        """Whether the executable cache holds every part of the unit (a file check per part)."""
        r = self.runner
        cache = r.executable_cache
        return cache is not None and all(
            cache.has(r.cached_step_key(name, args, static))
            for name, args, static, _ in self._step_specs(unit) + self._sampler_specs(unit))

    def _compile_or_load(self, name: str, program: str, args: tuple, static: dict,
                         key) -> Future:
        """Load from the executable cache, else lower here and compile on the pool; the executable
        goes into the runner's table as `program`'s for `key`. A future of None."""
        programs = self.runner.programs
        table = programs.compiled[program]
        start = time.perf_counter()
        cache = self.runner.executable_cache
        cache_key = self.runner.cached_step_key(name, args, static)
        exe = cache_key and cache.load(cache_key)
        if exe is not None:  # neither traced, lowered nor compiled
            table[key] = exe
            self.seconds[name] = time.perf_counter() - start
            done: Future = Future()
            done.set_result(None)
            return done
        if self._stop.is_set():
            raise CompileStopped
        lowered = programs.jitted[program].lower(*args, **static)

        def compile_part():
            try:
                t0 = time.perf_counter()
                compiled = lowered.compile()
                self.seconds[name] = time.perf_counter() - t0
                if cache_key:
                    cache.store(cache_key, compiled)
                table[key] = compiled
            finally:
                self._slots.release()

        while not self._slots.acquire(timeout=0.1):
            if self._stop.is_set():
                raise CompileStopped
        try:
            return self._pool.submit(compile_part)
        except RuntimeError:  # the pool is shut down: stop() ran meanwhile
            self._slots.release()
            raise CompileStopped from None

    def _compile_copies(self) -> list[Future]:
        """Every copy bucket's block copy (one executable each, like the steps)."""
        r = self.runner
        return [self._compile_or_load(
                    f"copy {size}", "copy",
                    (self._specs[1], *[jax.ShapeDtypeStruct((size,), jnp.int32)] * 2), {}, size)
                for size in r.buckets.copy_buckets]

    def _host_padding_batch(self, kind: str, size: int, variant: SamplerVariant) -> StepBatch:
        """An all-padding batch of a bucket as host arrays, with LoRA inputs where the runner's
        steps carry them (the speculative loop's too)."""
        r = self.runner
        if kind == "mixed":
            t, s, nd = size, r.buckets.mixed_shape(size)[1], 0
        else:
            t = s = nd = size
        return r.step_batch([], nd, t, s, variant)

    def _place_inputs(self, unit: Unit) -> None:
        """Place a padding batch of the unit's bucket in each sampler variant, as its steps place
        their inputs: that compiles the unpacking jit of each layout (transfer.place_step_inputs),
        a small one, before a step needs it."""
        spec = unit.kind == "spec"
        for variant in LOOP_VARIANTS if spec else SAMPLE_VARIANTS:
            if self._stop.is_set():
                raise CompileStopped
            batch = self._host_padding_batch("decode" if spec else unit.kind, unit.size, variant)
            place_step_inputs(batch, self.runner.plan)

    def padding_batch(self, kind: str, size: int, variant: SamplerVariant) -> StepBatch:
        """An all-padding batch of a bucket (running it writes no KV)."""
        r = self.runner
        batch = self._host_padding_batch(kind, size, variant)
        plan = r.plan
        if plan is None or plan.tp == 1:
            return batch
        # Under TP the steps get their inputs replicated (transfer.place_step_inputs): lowered
        # so, or XLA picks their layout (the decode loop took logits_indices split over tp).
        return jax.tree_util.tree_map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=plan.replicated)
            if isinstance(a, np.ndarray) else a, batch)
