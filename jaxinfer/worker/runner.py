"""ModelRunner: owns the device state (weights, paged KV cache, last sampled token per sequence row)
and runs one jitted step per scheduler step.

The jitted step is forward + sampling with the KV cache and the last-token array *donated*, so XLA
updates them in place (a copy would cost the whole cache every step). Shapes come from a few buckets
(buckets.py), compiled at start-up (`warmup`, bucket_compiler.py: the first ones before ready, the
rest in the background, a step running in the smallest ready bucket that fits) and kept in the
executable cache.

`execute` only dispatches: JAX returns before the device finishes, so the engine can schedule and
build step N+1 while step N runs, and calls `StepHandle.result()` (which blocks) only when it needs
the sampled tokens. When only decodes are running, the decode loop runs `decode_steps_per_call`
steps in one call (step_programs.py). Every compiled program, a proposer's too, sits in the
runner's one table (`programs`, programs.py), and every step batch is built here
(`step_batch`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from concurrent.futures import Future
from typing import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.worker.bucket_compiler import BucketCompiler
from jaxinfer.worker.buckets import Buckets, step_shape
from jaxinfer.worker.executable_cache import ExecutableCache, step_key
from jaxinfer.model.config import ModelConfig
from jaxinfer.worker.kv import allocate_kv_cache
from jaxinfer.core.kv_cache import KVCacheGroups
from jaxinfer.model.fused_projections import is_fused
from jaxinfer.model.lora.stacks import LORA, write_slot
from jaxinfer.model.transformer import KVCache
from jaxinfer.worker.sampler import SamplerOutput, SamplerVariant
from jaxinfer.core.scheduler import ScheduledSeq, SchedulerOutput
from jaxinfer.parallel.kernels import shard_kernels
from jaxinfer.parallel.sharding import ShardingPlan
from jaxinfer.parallel.transfer import (pack_split_step_inputs, pack_step_inputs,
                                        place_step_inputs, sampling_inputs_size)
from jaxinfer.worker.launcher import LaunchedState, StepLauncher
from jaxinfer.worker.step_programs import step_programs
from jaxinfer.worker.programs import LOOP_VARIANTS, SAMPLE_VARIANTS, forward_key, model_inputs
from jaxinfer.worker.hidden_reads import HiddenReads, gather_hidden_reads, read_hidden
from jaxinfer.worker.block_table import BlockTable
from jaxinfer.worker.step_inputs import SamplingTable, StepBatch, build_step_batch, sampler_variant
from jaxinfer.model.kernel_table import KernelTable

log = logging.getLogger(__name__)


@dataclasses.dataclass
class StepResult:
    tokens: np.ndarray               # i32[K, rows]: K = decode steps run (1 for a normal step)
    logprob: np.ndarray | None       # f32[K, rows]
    top_ids: np.ndarray | None       # i32[K, rows, MAX_LOGPROBS]
    top_logprobs: np.ndarray | None  # f32[K, rows, MAX_LOGPROBS]
    hidden: dict | None = None  # hidden_reads.read_hidden's arrays (prompt logprobs, pooled)


class StepHandle:
    """A dispatched step; `result()` waits for its sampled tokens (device -> host)."""
    def __init__(self, sched: SchedulerOutput, out: SamplerOutput | None, num_steps,
                 dispatch_time: float, is_loop: bool, hidden_reads: HiddenReads | None = None,
                 hidden_out=None, launched: Future | None = None,
                 loop_row_steps: np.ndarray | None = None):
        """`launched`: the launcher's future of (out, hidden_out, num_steps), given instead.
        `loop_row_steps`: a decode loop's steps per row of `sched.decodes` (None: not one)."""
        self.sched = sched
        self.loop_row_steps = loop_row_steps
        self._launched = launched
        self._out = out
        self.hidden_reads = hidden_reads  # what the step reads from its hidden states
        self._hidden_out = hidden_out
        self._num_steps = num_steps
        self.dispatch_time = dispatch_time
        self.is_loop = is_loop
        self.ready_time: float | None = None  # when result() got the tokens
        self.wait_s = 0.0  # how long result() blocked for them
        self._result: StepResult | None = None

    def _take_launched(self) -> None:
        """The launcher's outputs of this step (raises what its dispatch raised)."""
        if self._launched is not None:
            self._out, self._hidden_out, self._num_steps = self._launched.result()
            self._launched = None

    def is_ready(self) -> bool:
        if self._launched is not None:
            if not self._launched.done():
                return False
            self._take_launched()
        return self._out.tokens.is_ready()

    def result(self) -> StepResult:
        if self._result is None:
            n = len(self.sched.scheduled)
            t0 = time.perf_counter()
            self._take_launched()
            k = int(self._num_steps) if self.is_loop else 1
            out, hidden = jax.device_get((self._out, self._hidden_out))
            self.ready_time = time.perf_counter()
            self.wait_s = self.ready_time - t0

            def cut(a):
                if a is None:
                    return None
                a = np.asarray(a)
                return a[:k, :n] if self.is_loop else a[None, :n]
            self._result = StepResult(cut(out.tokens), cut(out.logprob), cut(out.top_ids),
                                      cut(out.top_logprobs), hidden)
        return self._result


class ModelRunner:
    # The device state the steps donate and replace: other threads than the launcher's read it
    # only after the queued dispatches (launcher.py).
    kv_cache = LaunchedState()
    last_tokens = LaunchedState()
    # compile_role: the engine's part in a disaggregated pair ("prefill" | "decode"; None:
    # colocated): which step buckets warm-up compiles first, and whether decode buckets are
    # compiled at all.

    def __init__(self, cfg: ModelConfig, params, kernels: KernelTable, *, num_blocks: int,
                 block_size: int, max_model_len: int, max_num_seqs: int,
                 max_num_batched_tokens: int, kv_dtype=jnp.bfloat16, decode_steps_per_call: int = 1,
                 decode_loop_max_seqs: int | None = None, plan: ShardingPlan | None = None,
                 executable_cache: ExecutableCache | None = None, compile_role: str | None = None,
                 kv_groups: KVCacheGroups | None = None):
        """`plan`: the replica's mesh and shardings (params must already be placed by it); None
        runs on the default device. `executable_cache`: where warm-up loads and stores the compiled
        forwards and decode loops (None: compile them every start). `decode_loop_max_seqs`: the
        most sequences the scheduler runs a decode loop for (None: any number)."""
        self.cfg = cfg
        self.params = params
        self.plan = plan
        self.compile_role = compile_role
        self.kernels = kernels = shard_kernels(kernels, plan)
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.decode_steps_per_call = decode_steps_per_call
        self.buckets = Buckets.make(max_num_seqs, max_num_batched_tokens,
                                    lone_sequence=is_fused(params))
        # The decode buckets that run on-device loops (the scheduler's decode_loop_max_seqs rounded
        # up): the speculative loop's, and the decode loop's when it takes several steps.
        top = self.buckets.decode_shape(min(decode_loop_max_seqs or max_num_seqs, max_num_seqs))
        self.spec_loop_buckets = tuple(s for s in self.buckets.decode_buckets if s <= top)
        self.loop_buckets = self.spec_loop_buckets if decode_steps_per_call > 1 else ()
        self.launcher: StepLauncher | None = None  # set_async_launch
        # The KV manager's layer groups (None: one table, one cache array per layer).
        self.kv_groups = kv_groups or KVCacheGroups.for_model(cfg, hybrid=False)
        self.max_blocks = self.kv_groups.table_width(max_model_len, block_size, kv_dtype,
                                                     kernels.table_columns)
        self.kv_cache = allocate_kv_cache(cfg, num_blocks, block_size, kv_dtype,
                                          num_slots=self.kv_groups.num_slots,
                                          num_heads=plan and plan.stored_kv_heads,
                                          sharding=plan and plan.kv_cache)
        self._kv_spec = None  # the released cache's layout while asleep
        self.last_tokens = jnp.zeros(max_num_seqs, jnp.int32, device=plan and plan.replicated)
        self._sampling_tails: dict[int, int] = {}  # rows -> sampling_tail
        self.sampling_table = SamplingTable(max_num_seqs, cfg.vocab_size, plan and plan.replicated)
        self.block_table = BlockTable(max_num_seqs, self.kv_groups.num_groups, self.max_blocks, [
            g for g, pages in enumerate(self.kv_groups.state_pages(block_size, kv_dtype))
            if pages is None])
        # Every compiled program of the runner, a proposer's too (programs.py).
        self.programs = step_programs(cfg, kernels, block_size, plan)
        self.executable_cache = executable_cache
        self.num_dispatches = 0
        self.built_at: float | None = None  # when execute() finished building its step's arrays
        self.warmup_seconds: dict[str, float] = {}  # filled by warmup()
        self.compiler: BucketCompiler | None = None  # warmup()'s; None: every shape compiles lazily
        # Runs the steps whose decodes carry proposals (spec_decode.target_step.SpeculativeStep).
        self.speculation = None

    def enable_speculation(self, step) -> None:
        """Run the steps whose decodes carry proposals with `step` (target_step.SpeculativeStep)."""
        self.speculation = step

    def install_params(self, params) -> None:
        """New weights placed like the running ones (LLMEngine.update_weights); LoRA stays."""
        lora = self.params.get(LORA)
        self.params = params if lora is None else {**params, LORA: lora}

    def replace_kv_cache(self, update: Callable[[KVCache], KVCache]) -> None:
        """`update` takes the KV cache (donate it) and returns the one to run on: a disaggregated
        decode engine scatters the blocks that arrived from the prefill engine this way."""
        self.kv_cache = update(self.kv_cache)

    def update_kv_cache_in_step_order(self, update: Callable[[KVCache], KVCache]) -> None:
        """`replace_kv_cache`, queued behind the steps already dispatched (on the launcher thread,
        if any): a step's host-tier copies go ahead of the step."""
        self._in_step_order(lambda: self.replace_kv_cache(update), wait=False)

    def _in_step_order(self, change: Callable[[], None], wait: bool) -> None:
        """Run `change` to the device state on the thread that dispatches steps, after those
        queued there (here, without a launcher); `wait`: until it has run."""
        if self.launcher is None:
            change()
            return
        done = self.launcher.submit(change)
        if wait:
            done.result()

    # ---- device memory between uses (LLMEngine.sleep / wake) --------------------------------
    def release_kv_cache(self) -> None:
        """Delete the KV cache's device buffers now (not when the garbage collector gets to them),
        remembering their shapes, dtypes and shardings for `restore_kv_cache`."""
        jax.block_until_ready(self.kv_cache)  # the step that wrote it may still be running
        leaves, treedef = jax.tree_util.tree_flatten(self.kv_cache)
        # An uncommitted cache (default device) must come back uncommitted: jit keys on it.
        self._kv_spec = treedef, [(a.shape, a.dtype, a.sharding if a.committed else None)
                                  for a in leaves]
        for a in leaves:
            a.delete()
        self.kv_cache = None

    def restore_kv_cache(self) -> None:
        """Allocate a zeroed KV cache exactly like the released one, so the compiled steps apply."""
        treedef, specs = self._kv_spec
        self.kv_cache = jax.tree_util.tree_unflatten(
            treedef, [jnp.zeros(shape, dtype, device=where) for shape, dtype, where in specs])
        self._kv_spec = None

    # ---- LoRA adapter slots (model/lora/stacks.py) ---------------------------------------------
    @property
    def has_lora(self) -> bool:
        return LORA in self.params

    def attach_lora_stacks(self, stacks: dict) -> None:
        """Serve LoRA adapters from `stacks` (model/lora/stacks.py, every slot zeroed) beside the
        weights; before warm-up, whose steps then carry each token's slot."""
        self.params = {**self.params, LORA: stacks}

    def write_lora_slot(self, slot: int, arrays: dict) -> None:
        """Replace one slot of the LoRA stacks (slot_arrays' host tree) by a donated in-place
        update, queued behind the steps already dispatched (on the launcher thread, if any)."""
        def write():
            self.params = {**self.params, LORA: write_slot(self.params[LORA], slot, arrays)}
        self._in_step_order(write, wait=True)

    # ---- compilation ------------------------------------------------------------------------
    def cached_step_key(self, name: str, args: tuple, static: dict) -> str | None:
        """The executable cache's key of a step (None without a cache): the static parts that
        shape it beyond its inputs' shapes and shardings."""
        if self.executable_cache is None:
            return None
        return step_key(name, (self.cfg, self.kernels, self.block_size, sorted(static.items(),
                                                                                key=str)), args)

    def warmup_shapes(self) -> list[tuple[str, int, SamplerVariant | None]]:
        """Every compilation warm-up makes (and the most a workload can cause): the forward of each
        step bucket, the sampler of each sequence bucket x variant (with an EAGLE-3 head, the
        unpacking of the inputs, transfer.place_step_inputs, of each step bucket x variant too),
        the decode loop of each decode bucket that runs loops x variant (and the speculative
        loop's, with the unpacking of its inputs), and the block copy of each copy bucket."""
        b = self.buckets
        shapes: list[tuple[str, int, SamplerVariant | None]] = []
        shapes += [("mixed", t, None) for t in b.token_buckets]
        shapes += [("decode", s, None) for s in b.decode_buckets]
        seq_buckets = sorted({b.mixed_shape(t)[1] for t in b.token_buckets} | set(b.decode_buckets))
        shapes += [("sample", s, v) for v in SAMPLE_VARIANTS for s in seq_buckets]
        if self.speculation and self.speculation.stream_writer:
            shapes += [("mixed inputs", t, v) for v in SAMPLE_VARIANTS for t in b.token_buckets]
            shapes += [("decode inputs", s, v) for v in SAMPLE_VARIANTS for s in b.decode_buckets]
        shapes += [("loop", s, v) for v in LOOP_VARIANTS for s in self.loop_buckets]
        if self.speculation and self.speculation.loop:  # greedy-only and sampled
            shapes += [("spec loop", s, v)
                       for v in LOOP_VARIANTS for s in self.spec_loop_buckets] * 2
            shapes += [("spec loop inputs", s, v)
                       for v in LOOP_VARIANTS for s in self.spec_loop_buckets]
        shapes += [("copy", c, None) for c in b.copy_buckets]
        return shapes

    def warmup(self, progress: bool = True, max_workers: int | None = None,
               background: bool = False) -> float:
        """Compile the step buckets (bucket_compiler.py): all of them, or with `background` only
        the first set, the rest then compiling on a background thread while steps run. Returns the
        seconds until this returns; `warmup_seconds` keeps each part's compile time."""
        from tqdm import tqdm
        t0 = time.perf_counter()
        if self.compiler is not None:
            self.compiler.stop()
        self.compiler = compiler = BucketCompiler(self, max_workers)
        self.warmup_seconds = compiler.seconds
        bar = tqdm(total=compiler.num_units, desc="compiling step buckets", unit="bucket",
                   disable=not progress or background)
        compiler.compile_first(bar)
        compiler.compile_rest(background, bar)
        bar.close()
        return time.perf_counter() - t0

    # ---- steps ------------------------------------------------------------------------------
    def _apply_copies(self, copies: list[tuple[int, int]]) -> None:
        """The step's block copies (copy-on-write, a fixed state's snapshots), before it writes
        any KV; more than the largest bucket in several calls, in the order queued (a block
        freed and taken again within one schedule is read by the earlier copies before the
        later ones write it)."""
        for src, dst in self.copy_batches(copies):
            self.kv_cache = self.programs.run("copy", self.kv_cache, src, dst, key=len(src))

    def copy_batches(self, copies: list[tuple[int, int]]):
        """`copies` as padded (src, dst) arrays (-1: none) of copy buckets, in the order queued."""
        top = self.buckets.copy_buckets[-1]
        for i in range(0, len(copies), top):
            part = copies[i:i + top]
            size = self.buckets.copy_shape(len(part))
            src = np.full(size, -1, np.int32)
            dst = np.full(size, -1, np.int32)
            src[:len(part)], dst[:len(part)] = zip(*part)
            yield src, dst

    # ---- step batches: built here only (the proposers' and the compiler's too) --------------
    def step_batch(self, rows: list[ScheduledSeq], num_decode_rows: int, num_tokens: int,
                   num_seqs: int, variant: SamplerVariant, *, lora: bool | None = None,
                   grouped: bool = True) -> StepBatch:
        """The padded host arrays of `rows` in a (tokens, rows, decode rows) bucket
        (step_inputs.build_step_batch). `lora`: carry each token's LoRA slot (None: as the
        runner's own steps do). `grouped`: one block table per KV group; False: the first group's
        alone (a proposer's cache lives in those blocks)."""
        return build_step_batch(rows, num_decode_rows, num_tokens, num_seqs, self.sampling_table,
                                self.block_size, self.max_blocks, self.max_model_len, variant,
                                self.has_lora if lora is None else lora,
                                self.kv_groups.kv_layout if grouped else None, self.block_table)

    def catch_up_batches(self, spans: list[tuple[ScheduledSeq, int, int]]
                         ) -> Iterator[tuple[list[ScheduledSeq], StepBatch]]:
        """A proposer's catch-up over positions the target computed: each (row, first, end)
        span's positions first .. end - 1 as prompt-like pieces, packed into mixed-bucket batches
        of at most the largest token bucket and max_num_seqs rows (first group's blocks, no LoRA).
        -> (the batch's pieces, the batch)"""
        cap = self.buckets.token_buckets[-1]
        pieces = [ScheduledSeq(e.seq, lo, min(cap, end - lo), False, e.block_ids)
                  for e, first, end in spans for lo in range(first, end, cap)]
        chunk: list[ScheduledSeq] = []
        used = 0
        for piece in pieces + [None]:
            if piece is None or used + piece.num_tokens > cap or (
                    len(chunk) == self.buckets.max_num_seqs):
                if chunk:
                    t, s = self.buckets.mixed_shape(used)
                    yield chunk, self.step_batch(chunk, 0, t, s, SamplerVariant(), lora=False,
                                                 grouped=False)
                chunk, used = [], 0
            if piece is not None:
                chunk.append(piece)
                used += piece.num_tokens

    def build(self, sched: SchedulerOutput) -> tuple[StepBatch, SamplerVariant, bool]:
        """The padded host arrays of a step (also used by the host-overhead benchmark)."""
        rows = sched.scheduled
        variant = sampler_variant(rows)
        compiler = self.compiler
        if compiler is not None:
            compiler.pacer.step_seen()
        t, s, nd = step_shape(self.buckets, sched.num_tokens, len(rows), not sched.prefills,
                              compiler and compiler.ready_forwards)
        batch = self.step_batch(rows, nd, t, s, variant)
        # A loop runs only once compiled (else: one step; the scheduler's reserve is harmless).
        is_loop = sched.decode_steps > 1 and not sched.prefills and (
            compiler is None or (nd == s and s in compiler.ready_loops))
        return batch, variant, is_loop

    def execute(self, sched: SchedulerOutput) -> StepHandle:
        """Dispatch one step (or one on-device decode loop) and return without waiting for it;
        with a launcher (`set_async_launch`), hand the dispatch to its thread once the step's
        arrays are built."""
        self.built_at = None
        if sched.num_proposed:
            self._apply_copies(sched.device_copies)
            self.num_dispatches += 1
            self.kv_cache, self.last_tokens, handle = self.speculation.execute(self, sched)
            return handle
        batch, variant, is_loop = self.build(sched)
        allowed = None
        if is_loop:  # each row's steps: what the scheduler reserved KV slots for
            allowed = np.zeros(batch.md.num_seqs, np.int32)
            for r, entry in enumerate(sched.decodes):
                allowed[r] = min(entry.seq.loop_steps_allowed(), sched.decode_steps)
        hidden_reads = (gather_hidden_reads(sched.scheduled)
                       if sched.reads_hidden and not is_loop else None)
        launch = functools.partial(self._launch, batch, variant, sched.device_copies, allowed,
                                   sched.decode_steps, hidden_reads)
        self.built_at = time.perf_counter()  # (the engine's host-time split)
        self.num_dispatches += 1
        row_steps = None if allowed is None else allowed[:len(sched.decodes)]
        if self.launcher is not None:
            return StepHandle(sched, None, None, time.perf_counter(), is_loop, hidden_reads,
                              launched=self.launcher.submit(launch), loop_row_steps=row_steps)
        out, hidden_out, n = launch()
        return StepHandle(sched, out, n, time.perf_counter(), is_loop, hidden_reads, hidden_out,
                          loop_row_steps=row_steps)

    def _launch(self, batch: StepBatch, variant: SamplerVariant, copies: list[tuple[int, int]],
                allowed: np.ndarray | None, loop_steps: int, hidden_reads: HiddenReads | None):
        """The device side of `execute`: block copies, then the step or (`allowed` given) the
        decode loop, each with its inputs packed into one transfer. -> (SamplerOutput,
        hidden-read arrays or None, steps run)"""
        self._apply_copies(copies)
        if allowed is None:
            return (*self._run_step(batch, variant, hidden_reads), 1)
        # The scheduler's `decode_steps`; compiled: decode_steps_per_call (a benchmark may lower it)
        key = (batch.md.num_seqs, variant) if loop_steps == self.decode_steps_per_call else None
        packed, apart, packing = pack_step_inputs(batch, self.plan)
        self.kv_cache, self.last_tokens, out = self.programs.run(
            "decode loop", self.params, self.kv_cache, self.last_tokens, packed, apart, allowed,
            key=key, packing=packing, variant=variant, num_steps=loop_steps)
        return out, None, loop_steps

    def set_async_launch(self, on: bool) -> None:
        """Dispatch steps from a launcher thread (jaxinfer/worker/launcher.py) or not."""
        if on and self.launcher is None:
            self.launcher = StepLauncher()
        elif not on and self.launcher is not None:
            launcher, self.launcher = self.launcher, None
            launcher.close()

    def _run_step(self, batch: StepBatch, variant: SamplerVariant,
                  hidden_reads: HiddenReads | None = None):
        """The step's inputs onto the device, its forward (the warm-up's compiled executable of
        this bucket, else the jit), then sampling, and the `hidden_reads` (prompt logprobs,
        pooling); all only dispatch. Updates the KV cache and the last-token array in place
        (donated). -> (SamplerOutput, hidden-read arrays or None)"""
        writer = self.speculation and self.speculation.stream_writer  # an EAGLE-3 head's
        if writer is None:
            return self._run_packed_step(batch, variant, hidden_reads)
        batch = place_step_inputs(batch, self.plan)
        hidden_out = None
        if hidden_reads is None:
            logits, self.kv_cache = writer.target_forward(self, model_inputs(batch))
        else:
            logits, self.kv_cache, hidden = self.programs.run(
                "forward", self.params, self.kv_cache, self.last_tokens, model_inputs(batch),
                with_hidden=True)
            hidden_out = read_hidden(self.params, self.cfg, hidden, hidden_reads)
        self.last_tokens, out = self.programs.run(
            "sample", logits, self.last_tokens, batch.sampling, batch.emit_slot,
            key=(batch.md.num_seqs, variant), variant=variant)
        return out, hidden_out

    def _run_packed_step(self, batch: StepBatch, variant: SamplerVariant,
                         hidden_reads: HiddenReads | None):
        """A step without an EAGLE-3 head: one transfer of its packed inputs, the packed forward
        (compiled per bucket), which hands the sampler's inputs on, then the packed sampler
        (compiled per row count and variant). -> (SamplerOutput, hidden-read arrays or None)"""
        s = batch.md.num_seqs
        packed, apart, packing = pack_split_step_inputs(batch, self.plan, self.sampling_tail(s))
        hidden_out = None
        if hidden_reads is None:
            logits, self.kv_cache, tail = self.programs.run(
                "packed forward", self.params, self.kv_cache, self.last_tokens, packed,
                key=forward_key(batch), packing=packing.model)
        else:
            logits, self.kv_cache, tail, hidden = self.programs.run(
                "packed forward", self.params, self.kv_cache, self.last_tokens, packed,
                packing=packing.model, with_hidden=True)
            hidden_out = read_hidden(self.params, self.cfg, hidden, hidden_reads)
        self.last_tokens, out = self.programs.run(
            "packed sample", logits, self.last_tokens, tail, apart, key=(s, variant),
            packing=packing.sample, variant=variant)
        return out, hidden_out

    def sampling_tail(self, num_seqs: int) -> int:
        """The int32s a packed step's sampler inputs are padded to at `num_seqs` rows: the
        largest sampler variant's (transfer.SplitPacking)."""
        tail = self._sampling_tails.get(num_seqs)
        if tail is None:
            tail = self._sampling_tails[num_seqs] = max(
                sampling_inputs_size(self.step_batch([], num_seqs, num_seqs, num_seqs, v))
                for v in SAMPLE_VARIANTS)
        return tail
