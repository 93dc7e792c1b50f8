"""ModelRunner: owns the device state (weights, paged KV cache, last sampled token per sequence row)
and runs one jitted step per scheduler step.

The jitted step is forward + sampling with the KV cache and the last-token array *donated*, so XLA
updates them in place (a copy would cost the whole cache every step). Shapes come from a few buckets
(buckets.py), all compiled at start-up (`warmup`) and kept in the persistent compilation cache.

`execute` only dispatches: JAX returns before the device finishes, so the engine can schedule and
build step N+1 while step N runs, and calls `StepHandle.result()` (which blocks) only when it needs
the sampled tokens. When only decodes are running, `decode_loop` runs up to `decode_steps_per_call`
steps inside one `lax.while_loop` on the device (the JAX counterpart of CUDA-graph replay), stopping
at the first sequence that hits EOS / a stop token id / its length limit.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.buckets import Buckets
from jaxinfer.config import ModelConfig
from jaxinfer.kv_cache import KVCacheManager, allocate_kv_cache, copy_blocks
from jaxinfer.model import forward
from jaxinfer.sampler import BASE_SAMPLER, FULL_SAMPLER, SamplerOutput, SamplerVariant, sample
from jaxinfer.scheduler import SchedulerOutput
from jaxinfer.step_inputs import SamplingTable, StepBatch, build_step_batch, sampler_variant
from pallas_kernels.backend import AttentionBackend
from pallas_kernels.metadata import AttentionMetadata

log = logging.getLogger(__name__)

WARMUP_VARIANTS = (BASE_SAMPLER, FULL_SAMPLER)


def _step(params, kv_cache, last_tokens, batch: StepBatch, *, cfg: ModelConfig,
          backend: AttentionBackend, variant: SamplerVariant):
    scope = "decode" if batch.md.num_decodes == batch.md.num_seqs else "prefill"
    with jax.named_scope(scope):
        pending = last_tokens[jnp.maximum(batch.input_slot, 0)]
        ids = jnp.where(batch.input_slot >= 0, pending, batch.token_ids)
        logits, kv_cache = forward(params, cfg, ids, batch.positions, kv_cache, batch.md, backend,
                                   batch.logits_indices)
    with jax.named_scope("sample"):
        out = sample(logits, batch.sampling, variant)
    dst = jnp.where(batch.emit_slot >= 0, batch.emit_slot, last_tokens.shape[0])
    last_tokens = last_tokens.at[dst].set(out.tokens, mode="drop")
    return kv_cache, last_tokens, out


def _decode_loop(params, kv_cache, last_tokens, batch: StepBatch, steps_allowed, *,
                 cfg: ModelConfig, backend: AttentionBackend, variant: SamplerVariant,
                 num_steps: int, block_size: int):
    """Up to num_steps decode steps of a pure-decode batch. steps_allowed i32[S]: tokens each row may
    still sample (length limits). Stops after the step in which any row finishes."""
    md0, t0 = batch.md, batch.sampling
    s = md0.num_seqs
    valid = md0.seq_lens > 0
    slots = jnp.where(valid, batch.emit_slot, last_tokens.shape[0])
    # Host-known inputs go into last_tokens first, so every iteration reads its input from there.
    known = valid & (batch.input_slot < 0)
    last_tokens = last_tokens.at[jnp.where(known, slots, last_tokens.shape[0])].set(
        batch.token_ids, mode="drop")
    rows = jnp.arange(s)
    out_shape = jax.eval_shape(lambda lg: sample(lg, t0, variant),
                               jax.ShapeDtypeStruct((s, cfg.vocab_size), jnp.float32))
    record = jax.tree_util.tree_map(lambda a: jnp.zeros((num_steps, *a.shape), a.dtype), out_shape)

    def cond(carry):
        i, _, _, _, done = carry
        return (i < num_steps) & ~done

    def body(carry):
        i, kv, last, rec, _ = carry
        pos = batch.positions + i
        seq_lens = jnp.where(valid, md0.seq_lens + i, 0)
        blk = md0.block_tables[rows, pos // block_size]
        slot_mapping = jnp.where(valid, blk * block_size + pos % block_size, -1)
        md = AttentionMetadata(slot_mapping, md0.query_start_loc, seq_lens, md0.block_tables,
                               num_decodes=s)
        ids = last[jnp.minimum(slots, last.shape[0] - 1)]
        with jax.named_scope("decode"):
            logits, kv = forward(params, cfg, ids, pos, kv, md, backend, batch.logits_indices)
        t = dataclasses.replace(t0, out_pos=t0.out_pos + i)
        with jax.named_scope("sample"):
            out = sample(logits, t, variant)
        last = last.at[slots].set(out.tokens, mode="drop")
        rec = jax.tree_util.tree_map(lambda r, o: r.at[i].set(o), rec, out)
        hit_stop = jnp.any(out.tokens[:, None] == t.stop_ids, axis=-1) & (t.out_pos >= t.min_tokens)
        finished = valid & (hit_stop | (i + 1 >= steps_allowed))
        return i + 1, kv, last, rec, jnp.any(finished)

    init = (jnp.int32(0), kv_cache, last_tokens, record, jnp.bool_(False))
    n, kv_cache, last_tokens, record, _ = jax.lax.while_loop(cond, body, init)
    return kv_cache, last_tokens, record, n


# Counted from jax's monitoring events: one per backend (XLA) compilation, cache hits excluded.
_compilations = [0]


def _count_compilation(event: str, duration_s: float, **_) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
        _compilations[0] += 1


jax.monitoring.register_event_duration_secs_listener(_count_compilation)


@functools.lru_cache(maxsize=None)
def _jitted_fns(cfg: ModelConfig, backend: AttentionBackend, block_size: int):
    """The jitted step and decode loop of a model, shared by every runner of that model in the
    process (so engines built one after another, e.g. in tests, reuse each other's compilations)."""
    step = jax.jit(functools.partial(_step, cfg=cfg, backend=backend),
                   static_argnames=("variant",), donate_argnums=(1, 2))
    loop = jax.jit(functools.partial(_decode_loop, cfg=cfg, backend=backend, block_size=block_size),
                   static_argnames=("variant", "num_steps"), donate_argnums=(1, 2))
    return step, loop


def step_activation_bytes(cfg: ModelConfig, params, backend: AttentionBackend, *, kv_dtype,
                          block_size: int, max_model_len: int, max_num_seqs: int,
                          max_num_batched_tokens: int) -> int:
    """Device memory the largest step bucket needs beyond its inputs (for the memory planner),
    from compiling that step against a one-block cache of the same layout: a step's activations
    do not depend on the number of blocks. Costs one compilation."""
    from jaxinfer.kv_cache import activation_peak_bytes
    buckets = Buckets.make(max_num_seqs, max_num_batched_tokens)
    t, s = buckets.mixed_shape(buckets.token_buckets[-1])
    max_blocks = -(-max_model_len // block_size)
    batch = build_step_batch([], 0, t, s, None, SamplingTable(max_num_seqs), block_size, max_blocks,
                             max_model_len, FULL_SAMPLER)
    one_block = jax.ShapeDtypeStruct((cfg.num_kv_heads, 1, block_size, cfg.head_dim), kv_dtype)
    kv = tuple((one_block, one_block) for _ in range(cfg.num_layers))
    last = jax.ShapeDtypeStruct((max_num_seqs,), jnp.int32)
    step, _ = _jitted_fns(cfg, backend, block_size)
    return activation_peak_bytes(step.lower(params, kv, last, batch, variant=FULL_SAMPLER).compile())


@dataclasses.dataclass
class StepResult:
    tokens: np.ndarray               # i32[K, rows]: K = decode steps run (1 for a normal step)
    logprob: np.ndarray | None       # f32[K, rows]
    top_ids: np.ndarray | None       # i32[K, rows, MAX_LOGPROBS]
    top_logprobs: np.ndarray | None  # f32[K, rows, MAX_LOGPROBS]


class StepHandle:
    """A dispatched step; `result()` waits for its sampled tokens (device -> host)."""

    def __init__(self, sched: SchedulerOutput, out: SamplerOutput, num_steps, dispatch_time: float,
                 is_loop: bool):
        self.sched = sched
        self._out = out
        self._num_steps = num_steps
        self.dispatch_time = dispatch_time
        self.is_loop = is_loop
        self.ready_time: float | None = None  # when result() got the tokens
        self._result: StepResult | None = None

    def is_ready(self) -> bool:
        return self._out.tokens.is_ready()

    def result(self) -> StepResult:
        if self._result is None:
            n = len(self.sched.scheduled)
            k = int(self._num_steps) if self.is_loop else 1
            out = jax.device_get(self._out)
            self.ready_time = time.perf_counter()

            def cut(a):
                if a is None:
                    return None
                a = np.asarray(a)
                return a[:k, :n] if self.is_loop else a[None, :n]
            self._result = StepResult(cut(out.tokens), cut(out.logprob), cut(out.top_ids),
                                      cut(out.top_logprobs))
        return self._result


class ModelRunner:
    def __init__(self, cfg: ModelConfig, params, backend: AttentionBackend, kv_manager: KVCacheManager,
                 *, num_blocks: int, block_size: int, max_model_len: int, max_num_seqs: int,
                 max_num_batched_tokens: int, kv_dtype=jnp.bfloat16, decode_steps_per_call: int = 1):
        self.cfg = cfg
        self.params = params
        self.backend = backend
        self.kv = kv_manager
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.max_blocks = -(-max_model_len // block_size)
        self.decode_steps_per_call = decode_steps_per_call
        self.buckets = Buckets.make(max_num_seqs, max_num_batched_tokens)
        self.kv_cache = allocate_kv_cache(cfg, num_blocks, block_size, kv_dtype)
        self.last_tokens = jnp.zeros(max_num_seqs, jnp.int32)
        self.sampling_table = SamplingTable(max_num_seqs)
        self._step_fn, self._loop_fn = _jitted_fns(cfg, backend, block_size)
        self.num_dispatches = 0
        self.warmup_seconds: dict[str, float] = {}  # filled by warmup()

    # ---- compilation ------------------------------------------------------------------------
    @staticmethod
    def num_compilations() -> int:
        """XLA compilations in this process so far (any function): the compile-bound test reads it
        before and after a workload."""
        return _compilations[0]

    def warmup_shapes(self) -> list[tuple[str, int, SamplerVariant]]:
        b = self.buckets
        shapes = [("mixed", t, v) for v in WARMUP_VARIANTS for t in b.token_buckets]
        shapes += [("decode", s, v) for v in WARMUP_VARIANTS for s in b.decode_buckets]
        if self.decode_steps_per_call > 1:
            shapes += [("loop", s, v) for v in WARMUP_VARIANTS for s in b.decode_buckets]
        shapes += [("copy", c, SamplerVariant()) for c in b.copy_buckets]
        return shapes

    def warmup(self, progress: bool = True) -> float:
        """Compile every bucket (each call runs on all-padding inputs: no KV is written). Returns the
        total seconds; `self.warmup_seconds` keeps each shape's ("decode 64 base": s)."""
        from tqdm import tqdm
        t0 = time.perf_counter()
        shapes = self.warmup_shapes()
        self.warmup_seconds = {}
        for kind, size, variant in tqdm(shapes, desc="compiling step buckets", disable=not progress,
                                        unit="shape"):
            t_shape = time.perf_counter()
            if kind == "copy":
                idx = np.full(size, -1, np.int32)  # numpy: no compilation of its own
                self.kv_cache = copy_blocks(self.kv_cache, idx, idx)
                self.warmup_seconds[f"copy {size}"] = time.perf_counter() - t_shape
                continue
            ns = size if kind != "mixed" else self.buckets.mixed_shape(size)[1]
            batch = build_step_batch([], size if kind != "mixed" else 0, size, ns, self.kv,
                                     self.sampling_table, self.block_size, self.max_blocks,
                                     self.max_model_len, variant)
            if kind == "loop":
                allowed = np.zeros(ns, np.int32)
                self.kv_cache, self.last_tokens, out, _ = self._loop_fn(
                    self.params, self.kv_cache, self.last_tokens, batch, allowed,
                    variant=variant, num_steps=self.decode_steps_per_call)
            else:
                self.kv_cache, self.last_tokens, out = self._step_fn(
                    self.params, self.kv_cache, self.last_tokens, batch, variant=variant)
            jax.block_until_ready(out)
            label = "full" if variant.advanced else "base"
            self.warmup_seconds[f"{kind} {size} {label}"] = time.perf_counter() - t_shape
        return time.perf_counter() - t0

    # ---- steps ------------------------------------------------------------------------------
    def _apply_copies(self) -> None:
        copies = self.kv.take_pending_copies()
        if not copies:
            return
        size = self.buckets.copy_shape(len(copies))
        src = np.full(size, -1, np.int32)
        dst = np.full(size, -1, np.int32)
        src[:len(copies)], dst[:len(copies)] = zip(*copies)
        self.kv_cache = copy_blocks(self.kv_cache, src, dst)

    def build(self, sched: SchedulerOutput) -> tuple[StepBatch, SamplerVariant, bool]:
        """The padded host arrays of a step (also used by the host-overhead benchmark)."""
        rows = sched.scheduled
        variant = sampler_variant(rows)
        if sched.prefills:
            t, s = self.buckets.mixed_shape(sched.num_tokens)
            nd = 0
        else:
            t = s = nd = self.buckets.decode_shape(len(rows))
        batch = build_step_batch(rows, nd, t, s, self.kv, self.sampling_table, self.block_size,
                                 self.max_blocks, self.max_model_len, variant)
        return batch, variant, sched.decode_steps > 1 and not sched.prefills

    def execute(self, sched: SchedulerOutput) -> StepHandle:
        """Dispatch one step (or one on-device decode loop) and return without waiting for it."""
        batch, variant, is_loop = self.build(sched)
        self._apply_copies()
        self.num_dispatches += 1
        if is_loop:
            allowed = np.zeros(batch.md.num_seqs, np.int32)
            for r, entry in enumerate(sched.decodes):
                allowed[r] = entry.seq.loop_steps_allowed()
            self.kv_cache, self.last_tokens, out, n = self._loop_fn(
                self.params, self.kv_cache, self.last_tokens, batch, allowed, variant=variant,
                num_steps=sched.decode_steps)
            return StepHandle(sched, out, n, time.perf_counter(), True)
        self.kv_cache, self.last_tokens, out = self._step_fn(
            self.params, self.kv_cache, self.last_tokens, batch, variant=variant)
        return StepHandle(sched, out, 1, time.perf_counter(), False)
