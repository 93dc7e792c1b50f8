"""Device memory that compiling the step buckets takes beside the KV cache: XLA's GPU autotuner.

While XLA compiles a step on a GPU it times each GEMM's candidate algorithms on the device, on
buffers it allocates from the same allocator as the KV cache: the GEMM's operands and its output
(plus a reference output to check the candidates against), each wrapped in redzones
(``--xla_gpu_redzone_padding_bytes``, 8 MiB by default, on both sides). The largest such GEMM is
usually the LM head: issue 60's FP8 Llama-8B died allocating 1018 MiB = its 128256 × 4096 bf16
weight (1002 MiB) + 2 × 8 MiB of redzone. The bucket compiler runs up to ``workers`` compiles at
once, and the buckets compile after the KV cache is allocated (their executables take its shape;
the rest compile in the background while the engine serves), so the planner keeps room for as
many such GEMMs at once as compiles run. That room is at most SCRATCH_SHARE of the device's memory:
where one autotune is large (a big vocabulary's LM head: Gemma-3's is 2.6 GiB) fewer compiles
run at once (at least one), which costs cold-start time instead of KV blocks. Figures are per
device (shard shapes under tensor parallelism).
"""

from __future__ import annotations

import dataclasses
import math

import jax

# XLA's default --xla_gpu_redzone_padding_bytes: the autotuner pads every buffer on both sides.
REDZONE_BYTES = 8 << 20
# Buffers the autotuner allocates per GEMM: lhs, rhs, output and a reference output.
AUTOTUNE_BUFFERS = 4
# The most of the device's memory kept for concurrent autotunes (one compile's always fits).
SCRATCH_SHARE = 0.1
# Bytes of an activation element the autotuner allocates (bf16 operands; f32 for the logits,
# counted apart).
ACTIVATION_BYTES = 2


def _shard_shape(leaf) -> tuple[int, ...]:
    sharding = getattr(leaf, "sharding", None)
    return tuple(sharding.shard_shape(leaf.shape)) if sharding is not None else tuple(leaf.shape)


def gemm_autotune_bytes(params, *, vocab_size: int, max_rows: int, max_logit_rows: int) -> int:
    """The most device memory the autotuner takes for one GEMM of the model: over the weight
    matrices (leaves of rank >= 2; stacked experts count whole, an upper bound), the weight's
    shard, the activations in (rows × its input width) and out (rows × its output width, twice:
    output and reference), with their redzones. `max_rows`: the largest step's tokens;
    `max_logit_rows`: the rows the LM head sees (the largest bucket's sequences), f32 out."""
    worst = 0
    for leaf in jax.tree_util.tree_leaves(params):
        shape = _shard_shape(leaf)
        if len(shape) < 2:
            continue
        weight = math.prod(shape) * leaf.dtype.itemsize
        fan_in, fan_out = shape[-2], shape[-1]
        if vocab_size in shape[-2:]:  # the LM head (or the embedding, were it a GEMM)
            width = fan_out if fan_out == vocab_size else fan_in
            acts = max_logit_rows * ((fan_in + fan_out - width) * ACTIVATION_BYTES + 2 * width * 4)
        else:
            acts = max_rows * (fan_in + 2 * fan_out) * ACTIVATION_BYTES
        worst = max(worst, weight + acts)
    return worst + AUTOTUNE_BUFFERS * 2 * REDZONE_BYTES if worst else 0


@dataclasses.dataclass(frozen=True)
class CompilePlan:
    workers: int  # XLA compiles at once (BucketCompiler's pool)
    scratch_bytes: int  # device memory kept for their autotunes


def plan_compiles(params, *, vocab_size: int, max_rows: int, max_logit_rows: int,
                  device_bytes: int, max_workers: int, platform: str) -> CompilePlan:
    """How many compiles run at once and the room their autotunes take: `max_workers` unless
    that would take more than SCRATCH_SHARE of `device_bytes`. Only XLA's GPU backend autotunes
    on the device: elsewhere, `max_workers` and no room."""
    if platform != "gpu":
        return CompilePlan(max_workers, 0)
    one = gemm_autotune_bytes(params, vocab_size=vocab_size, max_rows=max_rows,
                              max_logit_rows=max_logit_rows)
    workers = max(1, min(max_workers, int(SCRATCH_SHARE * device_bytes) // max(one, 1)))
    return CompilePlan(workers, workers * one)
