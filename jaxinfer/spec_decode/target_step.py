"""The verifying target step: a step in which some decodes carry proposals.

A decode row with k proposals becomes a ragged query of k + 1 tokens (its input token, then the
proposals) at positions start .. start + k, so the step is a mixed-bucket step: the attention
backends' ragged (prefill) path computes it, as it computes prefill chunks. The model's LM head
runs at every row's last k + 1 positions (`verify_indices`; a row without proposals uses only
its last token), then `rejection_sampler.verify` decides what each row emits: its accepted
proposals and one more token, 1 to k + 1 tokens. The KV of every proposal is written; the engine
gives the rejected ones' slots back when it processes the step (`KVCacheManager.truncate`).

The step's result has the decode loop's layout (`[K + 1, rows]` tokens, -1 past a row's last),
so `StepHandle` and the output processor treat it like an on-device loop of K + 1 steps: the engine
processes it before scheduling the next step, and each emitted token past the first advances the
row's `num_computed` by one (the accepted proposal it stands for was computed).

Proposals come from the host (n-gram: already in the token ids) or from a draft model run on the
device just before, in the same dispatch sequence (`spec_decode/draft.py`); their device array is
scattered into the step's token ids, so both cases run the same compiled step.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.core.scheduler import SchedulerOutput
from jaxinfer.model.config import ModelConfig
from jaxinfer.model.transformer import forward, forward_aux
from jaxinfer.parallel.sampling_logits import sample_in_layout
from jaxinfer.parallel.sharding import ShardingPlan
from jaxinfer.spec_decode.eagle import write_streams
from jaxinfer.worker.rejection_sampler import VerifyOutput, verify
from jaxinfer.worker.runner import StepHandle
from jaxinfer.worker.sampler import SamplerVariant
from jaxinfer.worker.step_inputs import (StepBatch, all_greedy, input_ids, sampler_variant,
                                         store_emitted)
from jaxinfer.model.kernel_table import KernelTable


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class VerifyInputs:
    verify_indices: jax.Array  # i32[S, K+1]: token index of each row's k + 1 scored positions
    drafts: jax.Array          # i32[S, K]: proposals (zeros where a device proposer fills them)
    draft_index: jax.Array     # i32[S, K]: token index of each proposal; T (dropped) past k
    num_drafts: jax.Array      # i32[S]


def _swap01(tree):
    return jax.tree_util.tree_map(lambda a: jnp.swapaxes(a, 0, 1), tree)


def _verify_rows(logits, inputs, *, variant: SamplerVariant, greedy_only: bool) -> VerifyOutput:
    """`verify` with every output leaf row-first ([S, K + 1, ...]), as `sample_in_layout` takes
    them; inputs: (sampling tensors, drafts, num_drafts, draft_probs), every leaf [S, ...]."""
    t, drafts, num_drafts, draft_probs = inputs
    out = verify(logits, drafts, num_drafts, t, variant, draft_probs, greedy_only)
    return dataclasses.replace(out, sampled=_swap01(out.sampled))


def verify_forward(params, kv_cache, streams, ids, positions, md, verify_indices, sampling,
                   drafts, num_drafts, draft_probs, lora_slot=None, *, cfg: ModelConfig,
                   kernels: KernelTable, variant: SamplerVariant,
                   plan: ShardingPlan | None = None, layers: tuple[int, ...] = (),
                   greedy_only: bool = False):
    """The target's forward over ragged rows of k + 1 tokens (input token, then the proposals;
    `ids` already holds them) and the rejection sampler at `verify_indices` i32[S, K + 1]
    (`greedy_only`: every row is greedy, `rejection_sampler.verify`'s fast path). `lora_slot`
    i32[T] (None: no LoRA): each token's adapter slot, so a row is verified by the model it
    would decode with.
    `layers` (an EAGLE-3 head's): the residual streams entering them are written into `streams`
    at the step's slots, from the same pass. -> (kv cache, VerifyOutput [K + 1, S], streams)"""
    s, k1 = verify_indices.shape
    with jax.named_scope("verify"):
        if layers:
            logits, kv_cache, aux = forward_aux(params, cfg, ids, positions, kv_cache, md,
                                                kernels, verify_indices.reshape(-1),
                                                lora_slot, layers=layers)
            streams = write_streams(streams, aux, md.group(0).slot_mapping)
        else:
            logits, kv_cache = forward(params, cfg, ids, positions, kv_cache, md, kernels,
                                       verify_indices.reshape(-1), lora_slot=lora_slot)
    with jax.named_scope("sample"):
        # Under TP each row's k + 1 logits are made whole on one device first, as the sampler's
        # are (parallel/sampling_logits.py): verification's conditionals (penalties, truncation,
        # top logprobs) then hold no collective, and its vocabulary reductions are TP = 1's.
        out = sample_in_layout(functools.partial(_verify_rows, variant=variant,
                                                 greedy_only=greedy_only),
                               logits.reshape(s, k1, -1),
                               (sampling, drafts, num_drafts, draft_probs), plan)
    return kv_cache, dataclasses.replace(out, sampled=_swap01(out.sampled)), streams


def _verify_step(params, kv_cache, last_tokens, batch: StepBatch, v: VerifyInputs, draft_probs,
                 streams=None, *, cfg: ModelConfig, kernels: KernelTable,
                 variant: SamplerVariant, plan: ShardingPlan | None = None,
                 layers: tuple[int, ...] = (), greedy_only: bool = False):
    ids = input_ids(batch, last_tokens)
    ids = ids.at[v.draft_index.reshape(-1)].set(v.drafts.reshape(-1), mode="drop")
    kv_cache, out, streams = verify_forward(
        params, kv_cache, streams, ids, batch.positions, batch.md, v.verify_indices,
        batch.sampling, v.drafts, v.num_drafts, draft_probs, batch.lora_slot, cfg=cfg,
        kernels=kernels, variant=variant, plan=plan, layers=layers, greedy_only=greedy_only)
    emitted = jnp.take_along_axis(out.sampled.tokens, out.num_accepted[None, :], axis=0)[0]
    return kv_cache, store_emitted(last_tokens, batch.emit_slot, emitted), out, streams


def build_verify_batch(runner, sched: SchedulerOutput, k_max: int
                       ) -> tuple[StepBatch, VerifyInputs, SamplerVariant]:
    """The step's padded arrays (a mixed bucket), with each row's sampling position moved back to
    its input token (the proposals are sampled positions 1.. of the row)."""
    rows = sched.scheduled
    variant = sampler_variant(rows)
    t, s = runner.buckets.mixed_shape(sched.num_tokens)
    batch = runner.step_batch(rows, 0, t, s, variant)  # LoRA slots as the runner's steps
    num = np.zeros(s, np.int32)
    drafts = np.zeros((s, k_max), np.int32)
    for r, entry in enumerate(sched.decodes):
        k = len(entry.proposal)
        num[r] = k
        drafts[r, :k] = entry.proposal
    batch.sampling.out_pos = np.maximum(batch.sampling.out_pos - num, 0).astype(np.int32)
    last = batch.md.query_start_loc[1:] - 1                       # each row's last token
    j = np.arange(k_max + 1)[None, :]
    verify_indices = np.clip(np.minimum(last[:, None] - num[:, None] + j, last[:, None]), 0, t - 1)
    draft_index = np.where(j[:, :k_max] < num[:, None],
                           batch.md.query_start_loc[:-1, None] + 1 + j[:, :k_max], t)
    return batch, VerifyInputs(verify_indices.astype(np.int32), drafts,
                               draft_index.astype(np.int32), num), variant


class SpeculativeStep:
    """The runner's part of speculative decoding: runs the steps that carry proposals."""

    def __init__(self, runner, num_speculative_tokens: int, draft=None):
        """Adds the verifying step to `runner`'s programs (compiled per token bucket and sampler
        variant through jit; cache, last tokens and streams donated)."""
        self.k = num_speculative_tokens
        # spec_decode.draft.DraftModel or eagle.EagleProposer, or None (host-side proposals)
        self.draft = draft
        # An EAGLE-3 head reads the target's streams: every target step writes them.
        self.stream_writer = draft if getattr(draft, "aux_layers", None) else None
        runner.programs.add("verify", _verify_step, static_argnames=("variant", "greedy_only"),
                            donate_argnums=(1, 2, 6), cfg=runner.cfg, kernels=runner.kernels,
                            plan=runner.plan, layers=tuple(getattr(draft, "aux_layers", ())))
        self.loop = None  # spec_loop.SpecLoop: runs the steps scheduled as loops
        self.single_steps = 0  # verifying steps run one per dispatch (benchmarks, tests)

    def execute(self, runner, sched: SchedulerOutput):
        """Dispatch the verifying step on the runner's state (its block copies already applied);
        the new KV cache and last tokens, for the runner to keep, and the step's handle."""
        if sched.spec_iterations > 1:
            return self.loop.execute(runner, sched)
        self.single_steps += 1
        batch, v, variant = build_verify_batch(runner, sched, self.k)
        draft_probs = None
        if self.draft is not None:
            v, draft_probs = self.draft.propose(sched, batch, v, variant)
        writer = self.stream_writer
        kv_cache, last_tokens, out, streams = runner.programs.run(
            "verify", runner.params, runner.kv_cache, runner.last_tokens, batch, v, draft_probs,
            writer and writer.streams, variant=variant, greedy_only=all_greedy(sched.scheduled))
        if writer is not None:
            writer.streams = streams
        return kv_cache, last_tokens, StepHandle(sched, out.sampled, self.k + 1,
                                                 time.perf_counter(), True)
