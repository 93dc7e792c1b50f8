"""Where the sampler's logits live under tensor parallelism, chosen so that no collective sits inside
any of the sampler's conditionals.

The forward's logits come out split over the vocabulary (lm_head is column-parallel). Left so, the
sampler's vocabulary reductions (argmax of the noisy logits, the top-k / top-p sort, the top
logprobs) are partitioned into per-device parts plus all-gathers / all-reduces, and those that run
under a `lax.cond` (jaxinfer/worker/sampler.py skips the costly parts when no row needs them) put
their collectives inside the conditional. With XLA's command buffers taking collectives that made
the sampler's CUDA graph fail to instantiate (CUDA_ERROR_INVALID_VALUE, H200, jax 0.11.2), and the
decode loop's too (it samples inside its while loop).

So every row is made whole on a device before the sampler's first conditional, by one collective:
- small buckets (rows x vocab x 4 bytes <= REPLICATE_MAX_BYTES: 16 rows of a 128K vocabulary):
  one all-gather, every device then samples every row (a few small kernels, duplicated);
- larger ones: one all-to-all to rows split over tp, each device sampling its rows under
  `shard_map`, the results (tokens, logprobs: a few values per row) gathered back at the end.
  That moves half the bytes of an all-gather and keeps the sampling work divided.
Either way a row's vocabulary reductions run on one device over the whole row, as at TP = 1:
greedy tokens are TP = 1's given the same logits. (The vocab-split sampler's traffic was a few
small gathers, less than the first bullet's; which is faster at batch 1 with command buffers is
for the H200 to say: jaxinfer/bench/suites/multi_gpu.py's llama8b_tp2_cmdbuf.)

The speculative path goes through it too: the verifying step (a row: its k + 1 positions' logits)
and a draft model's proposals (spec_decode/target_step.py, draft.py).
"""

from __future__ import annotations

import math

import jax
from jax.sharding import PartitionSpec as P

from jaxinfer.parallel.sharding import TP, ShardingPlan

# Largest [rows, vocab] float32 logits array gathered whole onto every device.
REPLICATE_MAX_BYTES = 8 << 20


def logits_spec(plan: ShardingPlan | None, rows: int, vocab: int) -> P | None:
    """The sampler's layout of logits [rows, vocab]: P() (replicated), P(tp, None) (rows split), or
    None on one device (nothing to place)."""
    if plan is None or plan.tp == 1:
        return None
    if rows * vocab * 4 <= REPLICATE_MAX_BYTES or rows % plan.tp:
        return P()
    return P(TP, None)


def sample_in_layout(sample_fn, logits: jax.Array, sampling, plan: ShardingPlan | None):
    """sample_fn(logits [rows, ..., vocab], sampling tensors (every leaf [rows, ...])) -> outputs
    (every leaf [rows, ...]), run in the layout of `logits_spec` (a row's logits: everything after
    the first axis, e.g. the k + 1 positions of a speculative row), its outputs replicated (as the
    step's other outputs are: the last-token array it updates keeps its sharding from step to
    step, so the compiled executables apply again). Call it inside a jit, on traced arrays."""
    spec = logits_spec(plan, logits.shape[0], math.prod(logits.shape[1:]))
    if spec is None:
        return sample_fn(logits, sampling)
    replicated = plan.replicated
    # The host-built inputs stay replicated (bucket_compiler lowers them without a sharding; left
    # to propagation they would be split to match the rows), the logits take the layout's.
    sampling = jax.lax.with_sharding_constraint(sampling, replicated)
    if spec == P():
        out = sample_fn(jax.lax.with_sharding_constraint(logits, replicated), sampling)
    else:
        # Rows split: the partitioner would replicate some ops it cannot split by rows (XLA's
        # TopK), inside their conditional; under shard_map each device samples its rows whole,
        # its conditionals deciding on its rows alone (skipping work only where no row needs it).
        out = jax.shard_map(sample_fn, mesh=plan.mesh, in_specs=(spec, P(TP)), out_specs=P(TP),
                            check_vma=False)(
            logits, sampling)
    return jax.tree_util.tree_map(lambda a: jax.lax.with_sharding_constraint(a, replicated), out)
