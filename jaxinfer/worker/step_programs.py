"""The runner's own programs: an ordinary step's forward and sampler on its one packed buffer
(`packed_forward`, `packed_sample`), the forward and the sampler on placed arrays (an EAGLE-3
head's steps), and the on-device decode loop
(`--decode-steps-per-call`), with the block copy, in the table `step_programs` makes
(programs.py).

The decode loop is the JAX counterpart of CUDA-graph replay: when only decodes are running, it runs
`decode_steps_per_call` steps inside one loop of a fixed trip count on the device, masking each
sequence from the step after it hits EOS / a stop token id / its length limit.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxinfer.model.config import ModelConfig
from jaxinfer.model.kernel_table import KernelTable
from jaxinfer.model.transformer import forward
from jaxinfer.parallel.sampling_logits import sample_in_layout
from jaxinfer.parallel.transfer import (StepPacking, unpack_model_inputs, unpack_sampling_inputs,
                                        unpack_step_inputs)
from jaxinfer.parallel.sharding import ShardingPlan
from jaxinfer.worker.kv import copy_blocks
from jaxinfer.worker.programs import ProgramTable
from jaxinfer.worker.sampler import SamplerVariant, SamplingTensors, sample
from jaxinfer.worker.step_inputs import StepBatch, input_ids, store_emitted
from pallas_kernels.attention.metadata import AttentionMetadata


def forward_step(params, kv_cache, last_tokens, batch: StepBatch, *, cfg: ModelConfig,
                  kernels: KernelTable, with_hidden: bool = False):
    """The model part of a step: -> (logits of the sampled rows [S, V], updated KV cache), plus the
    final hidden states [T, H] `with_hidden` (a step with prompt-logprob or pooling rows)."""
    scope = "decode" if batch.md.num_decodes == batch.md.num_seqs else "prefill"
    with jax.named_scope(scope):
        return forward(params, cfg, input_ids(batch, last_tokens), batch.positions, kv_cache,
                       batch.md, kernels, batch.logits_indices, return_hidden=with_hidden,
                       lora_slot=batch.lora_slot)


def sample_step(logits, last_tokens, sampling: SamplingTensors, emit_slot, *,
                 variant: SamplerVariant, plan: ShardingPlan | None = None):
    """The sampling part of a step, a jit of its own: its shapes depend only on the sequence bucket,
    so the forward (which holds the attention kernels, the costly part to compile) is compiled once
    per step bucket rather than once per sampler variant. Under TP the logits are laid out so that
    no collective runs inside the sampler's conditionals (parallel/sampling_logits.py)."""
    with jax.named_scope("sample"):
        out = sample_in_layout(functools.partial(sample, variant=variant), logits, sampling, plan)
    return store_emitted(last_tokens, emit_slot, out.tokens), out


def packed_forward(params, kv_cache, last_tokens, packed, *, packing: StepPacking,
                   cfg: ModelConfig, kernels: KernelTable, plan: ShardingPlan | None = None,
                   with_hidden: bool = False):
    """An ordinary step's forward on its packed buffer (transfer.pack_split_step_inputs): its
    inputs cut from the front, `forward_step`. -> (logits, KV cache, the buffer's tail: the
    sampler's inputs, uncut[, hidden states]). One signature per bucket in every sampler variant:
    compiled once per bucket."""
    batch, tail = unpack_model_inputs(packed, packing, _replicated(plan))
    logits, kv_cache, *hidden = forward_step(params, kv_cache, last_tokens, batch, cfg=cfg,
                                             kernels=kernels, with_hidden=with_hidden)
    return (logits, kv_cache, tail, *hidden)


def packed_sample(logits, last_tokens, tail, apart, *, packing: StepPacking,
                  variant: SamplerVariant, plan: ShardingPlan | None = None):
    """An ordinary step's sampler on the tail `packed_forward` handed on and the _APART arrays:
    `sample_step`. Compiled per row count and sampler variant."""
    sampling, emit_slot = unpack_sampling_inputs(tail, apart, packing, _replicated(plan))
    return sample_step(logits, last_tokens, sampling, emit_slot, variant=variant, plan=plan)


def _replicated(plan: ShardingPlan | None):
    """The sharding of a step's inputs inside its program (None: left as placed)."""
    return plan.replicated if plan is not None and plan.tp > 1 else None


def decode_loop(params, kv_cache, last_tokens, packed, apart, steps_allowed, *,
                packing: StepPacking, cfg: ModelConfig, kernels: KernelTable,
                variant: SamplerVariant, num_steps: int, block_size: int,
                plan: ShardingPlan | None = None):
    """num_steps decode steps of a pure-decode batch, its inputs in one packed buffer
    (transfer.pack_step_inputs: one dispatch with its inputs). steps_allowed i32[S]: tokens each row may
    still sample (length limits). A row that samples a stop token id (past min_tokens) or reaches
    its limit is masked from the next iteration on: a padding row (no KV write, nothing sampled
    into last_tokens), its later tokens recorded as -1. The trip count is fixed, so XLA knows it
    (the while's backend config `known_trip_count`) and the GPU runs the iterations back to back;
    an exit on a device value (all rows finished) would make it copy the predicate to the host
    and wait for it every iteration, exposing the next one's kernel launches."""
    batch = unpack_step_inputs(packed, apart, packing, _replicated(plan))
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

    def body(i, carry):
        kv, last, rec, done = carry
        live = valid & ~done
        pos = batch.positions + i
        seq_lens = jnp.where(live, md0.seq_lens + i, 0)
        blk = md0.block_tables[..., rows, pos // block_size]  # [S], or [G, S] with KV groups
        slot_mapping = jnp.where(live, blk * block_size + pos % block_size, -1)
        md = AttentionMetadata(slot_mapping, md0.query_start_loc, seq_lens, md0.block_tables,
                               num_decodes=s, kv_layout=md0.kv_layout)
        ids = last[jnp.minimum(slots, last.shape[0] - 1)]
        with jax.named_scope("decode"):
            logits, kv = forward(params, cfg, ids, pos, kv, md, kernels, batch.logits_indices,
                                 lora_slot=batch.lora_slot)  # (T == S: one token a row)
        t = dataclasses.replace(t0, out_pos=t0.out_pos + i)
        with jax.named_scope("sample"):  # laid out as in sample_step
            out = sample_in_layout(functools.partial(sample, variant=variant), logits, t, plan)
        last = last.at[jnp.where(live, slots, last.shape[0])].set(out.tokens, mode="drop")
        hit_stop = jnp.any(out.tokens[:, None] == t.stop_ids, axis=-1) & (t.out_pos >= t.min_tokens)
        out = out._replace(tokens=jnp.where(live, out.tokens, -1))
        rec = jax.tree_util.tree_map(lambda r, o: r.at[i].set(o), rec, out)
        return kv, last, rec, done | (live & (hit_stop | (i + 1 >= steps_allowed)))

    init = (kv_cache, last_tokens, record, ~valid)
    kv_cache, last_tokens, record, _ = jax.lax.fori_loop(0, num_steps, body, init)
    return kv_cache, last_tokens, record


def step_programs(cfg: ModelConfig, kernels: KernelTable, block_size: int,
                  plan: ShardingPlan | None = None) -> ProgramTable:
    """A runner's table with its own programs: "packed forward", "packed sample", "forward",
    "sample", "decode loop" and "copy". Warm-up compiles the packed forward per (tokens,
    sequences, decodes) bucket and the packed sampler per (sequences, sampler variant) (with an
    EAGLE-3 head: its stream-writing forward and "sample" instead), the decode loop per
    (sequences in loop_buckets, sampler variant) at num_steps == decode_steps_per_call, the block
    copy per copy bucket. The KV cache (forwards, loop, copy) and the last-token array (samplers,
    loop) are donated."""
    programs = ProgramTable()
    programs.add("packed forward", packed_forward, static_argnames=("packing", "with_hidden"),
                 donate_argnums=(1,), cfg=cfg, kernels=kernels, plan=plan)
    programs.add("packed sample", packed_sample, static_argnames=("packing", "variant"),
                 donate_argnums=(1,), plan=plan)
    programs.add("forward", forward_step, static_argnames=("with_hidden",), donate_argnums=(1,),
                 cfg=cfg, kernels=kernels)
    programs.add("sample", sample_step, static_argnames=("variant",), donate_argnums=(1,),
                 plan=plan)
    programs.add("decode loop", decode_loop, static_argnames=("packing", "variant", "num_steps"),
                 donate_argnums=(1, 2), cfg=cfg, kernels=kernels, block_size=block_size, plan=plan)
    programs.register("copy", copy_blocks)
    return programs
