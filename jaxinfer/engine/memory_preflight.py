"""Whether a model can fit the device, from its config alone, before any weights file is read.

The weights' bytes come from the param tree's shapes and dtypes (quantization included) and their
shards on one device; one sequence of max_model_len takes KVCacheGroups.blocks_for_sequence blocks
of the layers' pages (kv_specs.py); the largest step's activations are estimated from below (its
f32 logits and two hidden-state copies: the measured figure, taken after loading, is larger); the
compile scratch is the planner's own (kv/compile_scratch.py). A model that cannot hold one sequence
is refused here with those numbers, instead of after minutes of loading. The engine's planner
(kv_blocks.py) sizes the pool after loading, with the measured activations.
"""

from __future__ import annotations

import dataclasses
import logging
import math

import jax
import jax.numpy as jnp

from jaxinfer.core.kv_cache import KVCacheGroups
from jaxinfer.core.kv_cache.cache_config import resolve_kv_cache_dtype
from jaxinfer.engine.args import EngineArgs
from jaxinfer.engine.fixed_state import refuse_what_fixed_state_lacks
from jaxinfer.model.config import ModelConfig
from jaxinfer.parallel.sharding import ShardingPlan
from jaxinfer.worker.bucket_compiler import compile_workers
from jaxinfer.worker.kv.compile_scratch import plan_compiles
from jaxinfer.worker.kv.planner import (MemoryPlanError, device_memory_bytes,
                                        device_memory_override, format_bytes)

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Preflight:
    """Per-device figures (bytes) of a model before its weights load."""
    device_bytes: int
    gpu_memory_utilization: float
    weight_bytes: int
    activation_floor_bytes: int
    compile_scratch_bytes: int
    sequence_kv_bytes: int  # one sequence of max_model_len
    max_model_len: int
    fitting_model_len: int  # the longest max_model_len whose one sequence fits (0: none)

    @property
    def room_bytes(self) -> int:
        """What is left for the KV cache."""
        return (int(self.gpu_memory_utilization * self.device_bytes) - self.weight_bytes
                - self.activation_floor_bytes - self.compile_scratch_bytes)

    @property
    def fits(self) -> bool:
        return self.sequence_kv_bytes <= self.room_bytes

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "room_bytes": self.room_bytes, "fits": self.fits}

    def refusal(self) -> str:
        """Why the model does not fit, with the numbers and the flags to change."""
        f = format_bytes
        usable = self.gpu_memory_utilization * self.device_bytes
        head = (f"the model does not fit: it needs {f(self.weight_bytes)} for weights + "
                f"{f(self.sequence_kv_bytes)} of KV cache for one sequence of "
                f"max_model_len={self.max_model_len} (+ at least "
                f"{f(self.activation_floor_bytes)} activations and "
                f"{f(self.compile_scratch_bytes)} compile scratch), per device; the device has "
                f"{f(self.device_bytes)}, {f(usable)} at --gpu-memory-utilization "
                f"{self.gpu_memory_utilization:g}")
        if self.fitting_model_len:
            return (head + f": lower --max-model-len to {self.fitting_model_len}, raise "
                    f"--gpu-memory-utilization, use a smaller --kv-cache-dtype (fp8) or shard "
                    f"over more devices (--tensor-parallel-size)")
        return (head + ": the weights alone leave no room; quantize them (--quantization fp8), "
                "raise --gpu-memory-utilization or shard over more devices "
                "(--tensor-parallel-size)")


def sharded_nbytes(shapes, shardings) -> int:
    """Bytes one device holds of a param tree of ShapeDtypeStructs placed by `shardings`."""
    total = 0
    for leaf, sharding in zip(jax.tree_util.tree_leaves(shapes),
                              jax.tree_util.tree_leaves(shardings)):
        shape = sharding.shard_shape(leaf.shape) if sharding is not None else leaf.shape
        total += math.prod(shape) * jnp.dtype(leaf.dtype).itemsize
    return total


def activation_floor_bytes(cfg: ModelConfig, args: EngineArgs, dtype) -> int:
    """A lower bound on the largest step's activations: its logits (f32, one row per sequence)
    and two copies of its hidden states (the residual stream and a layer's output)."""
    tokens = args.max_num_batched_tokens
    rows = min(args.max_num_seqs, tokens)
    return rows * cfg.vocab_size * 4 + 2 * tokens * cfg.hidden_size * jnp.dtype(dtype).itemsize


def preflight(cfg: ModelConfig, args: EngineArgs, param_shapes, plan: ShardingPlan | None,
              dtype, device_bytes: int | None = None, platform: str | None = None,
              workers: int | None = None) -> Preflight | None:
    """The figures for `cfg` under `args` on one device, or None where the device reports no
    memory size (a CPU without $JAXINFER_DEVICE_MEMORY). `device_bytes`, `platform` ("gpu") and
    `workers` (concurrent compiles) describe another machine than this one (`jaxinfer memory`)."""
    platform = platform or jax.devices()[0].platform
    if device_bytes is None:
        if platform == "cpu" and device_memory_override() is None:
            return None
        device_bytes = device_memory_bytes(args.gpu_memory_utilization)
    shardings = plan.params(param_shapes) if plan else None
    weights = (sharded_nbytes(param_shapes, shardings) if shardings is not None
               else sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize
                        for x in jax.tree_util.tree_leaves(param_shapes)))
    placed = (jax.tree_util.tree_map(
        lambda leaf, s: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=s),
        param_shapes, shardings) if shardings is not None else param_shapes)
    scratch = plan_compiles(
        placed, vocab_size=cfg.vocab_size, max_rows=args.max_num_batched_tokens,
        max_logit_rows=min(args.max_num_seqs, args.max_num_batched_tokens),
        device_bytes=device_bytes, max_workers=workers or compile_workers(),
        platform=platform).scratch_bytes
    first = jax.tree_util.tree_leaves(param_shapes)[0].dtype
    kv_dtype = resolve_kv_cache_dtype(args.kv_cache_dtype, jnp.dtype(first).name)
    device_cfg = dataclasses.replace(cfg, num_kv_heads=plan.kv_heads_per_device) if plan else cfg
    groups = KVCacheGroups.for_model(device_cfg, args.hybrid_kv_cache)
    block_bytes = groups.page_bytes(args.block_size, kv_dtype)
    chunk = args.max_num_batched_tokens

    def sequence_bytes(n: int) -> int:
        return groups.blocks_for_sequence(n, chunk, args.block_size, kv_dtype) * block_bytes

    max_len = args.max_model_len or cfg.max_position_embeddings
    out = Preflight(device_bytes, args.gpu_memory_utilization, weights,
                    activation_floor_bytes(cfg, args, dtype), scratch, sequence_bytes(max_len),
                    max_len, 0)
    lo, hi = 0, max_len  # the longest length in [0, max_len] whose sequence fits the room
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if sequence_bytes(mid) <= out.room_bytes:
            lo = mid
        else:
            hi = mid - 1
    fitting = lo // args.block_size * args.block_size
    return dataclasses.replace(out, fitting_model_len=fitting)


def refuse_if_it_cannot_fit(cfg: ModelConfig, args: EngineArgs, param_shapes,
                            plan: ShardingPlan | None, dtype) -> Preflight | None:
    """`preflight`, raising MemoryPlanError with its numbers when one sequence cannot fit
    (--num-blocks skips the memory figures: the engine checks that count against a sequence).
    First what a model of state-space layers cannot run (engine/fixed_state.py), before any
    weight loads."""
    refuse_what_fixed_state_lacks(KVCacheGroups.for_model(cfg, args.hybrid_kv_cache),
                                  args.create_engine_config())
    if args.num_blocks is not None:
        return None
    figures = preflight(cfg, args, param_shapes, plan, dtype)
    if figures is None:
        return None
    if not figures.fits:
        raise MemoryPlanError(figures.refusal())
    f = format_bytes
    log.info("memory before loading (per device): %g × %s − %s weights − ≥ %s activations − %s "
             "compile scratch = %s for the KV cache; one sequence of %d tokens takes %s",
             figures.gpu_memory_utilization, f(figures.device_bytes), f(figures.weight_bytes),
             f(figures.activation_floor_bytes), f(figures.compile_scratch_bytes),
             f(figures.room_bytes), figures.max_model_len, f(figures.sequence_kv_bytes))
    return figures
