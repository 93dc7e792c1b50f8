"""The EAGLE-3 proposer (`--speculative-config '{"method": "eagle3", "model": DIR, ...}'`): a
one-layer head (`eagle_head.py`) drafts k tokens per speculating decode from the target's own
residual streams at three layers, on the device, right before the target step that verifies them.

State, both over the target's block ids (so block tables, copy-on-write and preemption need
nothing new): the head's paged KV cache (one layer), and the **stream cache**: per KV slot, the
target's three streams of the token at that position (f32-free: the target's dtype, 3 Ht wide),
written by every target step the runner runs while this proposer is attached (prefill chunks,
single decode steps, verification steps: `forward_aux` returns them from the same pass) at the
step's slot mapping. The on-device multi-step decode loop (runs only while speculation is off)
does not write them: positions it computed hold stale streams, which lowers acceptance, never
changes outputs (verification is exact for any q).

The head at position t reads token t + 1 and the target's streams of position t, and predicts
token t + 2. A decode whose input token is x_s at position s (streams known up to s - 1):
`Sequence.draft_computed` counts the positions whose head KV comes from the target's streams;
the head catches up on positions draft_computed .. s - 2 (one ragged call, tokens shifted by one),
then one jitted chain of k steps: step 0 at position s - 1 (x_s, the streams of s - 1) proposes
d_1; step i at position s - 1 + i reads d_i and step i - 1's output stream (EAGLE's
training-time test trains exactly this). After it positions < s are real: draft_computed = s.
Proposals are sampled as the draft model's are (`rejection_sampler.propose_tokens`: the request's
transforms, q returned for the exact rejection sampler); tokens outside the head's draft
vocabulary have probability 0.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.core.scheduler import ScheduledSeq, SchedulerOutput
from jaxinfer.errors import ConfigError
from jaxinfer.model.kernel_table import KernelTable
from jaxinfer.model.transformer import forward_aux
from jaxinfer.parallel.kernels import unsharded
from jaxinfer.spec_decode import eagle_head as head
from jaxinfer.worker.programs import forward_key
from jaxinfer.worker.kv import allocate_kv_cache, copy_blocks
from jaxinfer.worker.rejection_sampler import expand_positions, propose_tokens
from jaxinfer.worker.sampler import SamplerVariant, SamplingTensors
from jaxinfer.worker.step_inputs import StepBatch, all_greedy, input_ids
from pallas_kernels.attention.kv_quant import is_fp8
from pallas_kernels.attention.metadata import AttentionMetadata


def write_streams(streams: jax.Array, aux: jax.Array, slot_mapping: jax.Array) -> jax.Array:
    """The target's streams of a step's tokens into their slots (padding, slot -1, dropped)."""
    dst = jnp.where(slot_mapping < 0, streams.shape[0], slot_mapping)
    return streams.at[dst].set(aux.astype(streams.dtype), mode="drop")


def _catch_up(params, embed, kv, streams, ids, positions, md, *, cfg, kernels):
    """The head's KV at positions whose streams the target wrote (ids: the next tokens)."""
    md = md.group(0)  # the head's KV and streams live in the full-attention group's blocks
    hidden = cfg.fuse(params, streams[jnp.maximum(md.slot_mapping, 0)], kernels.gemm_rows)
    with jax.named_scope("eagle_catch_up"):
        _, _, kv = cfg.step(params, embed, ids, hidden, positions, kv, md, kernels)
    return kv


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class CatchUp:
    """Head KV still owed before a chain's step 0: per row `num` (<= k) positions from `pos` (up
    to the step's own position), each reading the token after it, `ids[:, j]`."""
    ids: jax.Array  # i32[S, K]
    pos: jax.Array  # i32[S]
    num: jax.Array  # i32[S]


def ragged(q_lens: jax.Array, total: int):
    """Rows of q_lens tokens packed from token 0 and padded to `total` (the host's mixed-step
    layout): -> (query_start_loc i32[S + 1], each token's row (S: padding), its index in it)."""
    s = q_lens.shape[0]
    qsl = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(q_lens, dtype=jnp.int32)])
    t = jnp.arange(total, dtype=jnp.int32)
    row = jnp.searchsorted(qsl[1:], t, side="right").astype(jnp.int32)
    return qsl, row, t - qsl[jnp.minimum(row, s - 1)]


def slots(tables: jax.Array, row: jax.Array, pos: jax.Array, valid: jax.Array,
          block_size: int) -> jax.Array:
    """Cache slots of tokens (row, pos) from block tables [S, M] (or [G, S, M]: [G, T]); -1 where
    not valid (not written)."""
    r = jnp.minimum(row, tables.shape[-2] - 1)
    blk = tables[..., r, jnp.clip(pos // block_size, 0, tables.shape[-1] - 1)]
    return jnp.where(valid, blk * block_size + pos % block_size, -1)


def _chain(params, embed, kv, streams, first_ids, first_pos, num, block_tables,
           t: SamplingTensors, behind: CatchUp | None = None, *, cfg, kernels, block_size: int,
           k: int, variant: SamplerVariant, greedy_only: bool = False):
    """k head steps over S rows (step 0 at first_pos: the input token and the target's streams of
    first_pos; step i: proposal i and step i - 1's stream). Rows with num <= i are padding in step
    i. `behind`: head KV owed at the positions just before first_pos, computed by step 0 in the
    same call (one ragged query per row: those positions, then step 0's) rather than by a catch-up
    call of its own (a proposing row's; one that proposes nothing is at its limit and ends).
    `greedy_only` (static): every row is greedy; q is None.
    -> (kv cache, drafts i32[S, k], q f32[S, k, V])"""
    s = first_ids.shape[0]
    vocab = embed.shape[0]
    rows = jnp.arange(s)
    qsl = jnp.arange(s + 1, dtype=jnp.int32)

    def propose(i, logits, drafts, probs):
        ti = jax.tree_util.tree_map(lambda a: a[rows * (k + 1) + i], expand_positions(t, drafts))
        d, q = propose_tokens(logits, ti, variant=variant, greedy_only=greedy_only)
        drafts = drafts.at[:, i].set(jnp.where(i < num, d, 0))
        return drafts, None if greedy_only else probs.at[:, i].set(q)

    def body(i, carry):
        kv, hidden, drafts, probs = carry
        ids = jnp.where(i == 0, first_ids, drafts[:, jnp.maximum(i - 1, 0)])
        pos = first_pos + i
        valid = i < num
        md = AttentionMetadata(slots(block_tables, rows, pos, valid, block_size), qsl,
                               jnp.where(valid, pos + 1, 0), block_tables, num_decodes=s)
        with jax.named_scope("eagle_draft"):
            logits, stream, kv = cfg.step(params, embed, ids, hidden, pos, kv, md, kernels)
        drafts, probs = propose(i, logits, drafts, probs)
        return kv, stream.astype(hidden.dtype), drafts, probs

    drafts = jnp.zeros((s, k), jnp.int32)
    probs = None if greedy_only else jnp.zeros((s, k, vocab), jnp.float32)
    if behind is None:
        first_slots = slots(block_tables, rows, first_pos, num > 0, block_size)
        hidden0 = cfg.fuse(params, streams[jnp.maximum(first_slots, 0)], kernels.gemm_rows)
        kv, _, drafts, probs = jax.lax.fori_loop(0, k, body, (kv, hidden0, drafts, probs))
        return kv, drafts, probs
    owed = jnp.where(num > 0, behind.num, 0)
    step_qsl, r, j = ragged(jnp.where(num > 0, owed + 1, 0), s * (k + 1))
    owned = r < s
    rr = jnp.minimum(r, s - 1)
    pos = jnp.where(owned, first_pos[rr] - owed[rr] + j, 0)
    ids = jnp.where(j == owed[rr], first_ids[rr], behind.ids[rr, jnp.clip(j, 0, k - 1)])
    step_slots = slots(block_tables, r, pos, owned, block_size)
    hidden = cfg.fuse(params, streams[jnp.maximum(step_slots, 0)], kernels.gemm_rows)
    md = AttentionMetadata(step_slots, step_qsl, jnp.where(num > 0, first_pos + 1, 0),
                           block_tables)
    with jax.named_scope("eagle_draft"):
        logits, stream, kv = cfg.step(params, embed, jnp.where(owned, ids, 0), hidden, pos, kv,
                                      md, kernels)
    last = jnp.maximum(step_qsl[1:] - 1, 0)  # each row's step-0 token
    drafts, probs = propose(0, logits[last], drafts, probs)
    carry = (kv, stream[last].astype(hidden.dtype), drafts, probs)
    kv, _, drafts, probs = jax.lax.fori_loop(1, k, body, carry)
    return kv, drafts, probs


def _target_forward(params, kv_cache, last_tokens, batch: StepBatch, streams, *, cfg, kernels,
                    layers):
    """The runner's forward that also writes the step's streams (`step_programs.forward_step`'s result)."""
    logits, kv_cache, aux = forward_aux(params, cfg, input_ids(batch, last_tokens),
                                        batch.positions, kv_cache, batch.md, kernels,
                                        batch.logits_indices, batch.lora_slot, layers=layers)
    return logits, kv_cache, write_streams(streams, aux, batch.md.group(0).slot_mapping)


def _copy_rows(streams, src, dst, block_size: int):
    """Copy-on-write of whole blocks in the stream cache (dst -1: none)."""
    offs = jnp.arange(block_size)
    n = streams.shape[0]
    s = (jnp.clip(src, 0)[:, None] * block_size + offs).reshape(-1)
    d = jnp.where(dst[:, None] < 0, n, dst[:, None] * block_size + offs).reshape(-1)
    return streams.at[d].set(streams[s], mode="drop")


class EagleProposer:
    """A loaded EAGLE-3 head (`cfg` an `eagle_head.Eagle3Config`) or DeepSeek MTP module
    (`mtp.MTPConfig`: the same interface, `layer`, `aux_layers`, `stream_width`, `fuse`,
    `step`); `attach` gives it its KV and stream caches once the pool is sized."""
    on_device = True
    # The runner's ordinary steps run this program (its forward that writes the streams).
    forward_program = "forward writing streams"

    def __init__(self, cfg, params: dict):
        self.cfg = cfg
        self.params = params
        self.aux_layers = cfg.aux_layers
        self.k = 0
        self.kv_cache = None
        self.streams = None
        self.head_kernels: KernelTable | None = None  # the runner's, or unscaled over fp8 KV

    def attach(self, runner, num_blocks: int, kv_dtype, k: int) -> None:
        if not runner.kv_groups.specs[0].keeps_every_block:  # its blocks would be freed
            raise ConfigError("--speculative-config methods eagle3 and mtp need a target with a "
                              "full-attention layer, or --no-hybrid-kv-cache: they keep their KV "
                              "in the first group's blocks")
        self.runner, self.k = runner, k
        # Under tensor parallelism the head runs whole on every device of the replica's mesh:
        # its weights, KV and stream caches replicated (one layer beside the target's), the
        # target's streams arriving replicated (the residual stream is, between layers), so
        # its step is the one-device step and needs no kernel of the target's sharded table.
        replicated = runner.plan.replicated if runner.plan is not None else None
        if replicated is not None:
            self.params = jax.device_put(self.params, replicated)
        target_embed = runner.params["embed"]["embedding"]  # vocabulary-sharded under TP
        self.embed = self.params.get("embed", target_embed)
        head_kernels = unsharded(runner.kernels)
        if is_fp8(kv_dtype):  # the head's cache in the model's dtype, read without scales
            head_kernels = dataclasses.replace(head_kernels, attention=head_kernels.attention.inner)
        self.head_kernels = head_kernels
        self.kv_cache = allocate_kv_cache(self.cfg.layer, num_blocks, runner.block_size,
                                          self.cache_dtype(kv_dtype), sharding=replicated)
        self.streams = jnp.zeros((num_blocks * runner.block_size, self.cfg.stream_width),
                                 target_embed.dtype, device=replicated)
        # Its programs, in the runner's table: the stream-writing forward (compiled at warm-up
        # per step bucket in place of the runner's own), the chain, catch-up and stream copy.
        programs, kernels = runner.programs, runner.kernels
        programs.add(self.forward_program, _target_forward, donate_argnums=(1, 4), cfg=runner.cfg,
                     kernels=kernels, layers=self.cfg.aux_layers)
        programs.add("eagle chain", _chain, static_argnames=("variant", "greedy_only"),
                     donate_argnums=(2,), cfg=self.cfg, kernels=head_kernels,
                     block_size=runner.block_size, k=k)
        programs.add("eagle catch-up", _catch_up, donate_argnums=(2,), cfg=self.cfg,
                     kernels=head_kernels)
        programs.add("eagle stream copy", _copy_rows, donate_argnums=(0,),
                     block_size=runner.block_size)

    def cache_dtype(self, kv_dtype):
        """The head's KV-cache dtype: the target's, except that over an fp8 cache the head keeps
        its one layer in its weights' dtype (fp8 would need calibrated scales of its own,
        kv_quant.py, for a cache a fraction of the target's size)."""
        return self.params_dtype if is_fp8(kv_dtype) else kv_dtype

    @property
    def params_dtype(self):
        """Its weights' dtype (the first float leaf: `d2t` is a token map)."""
        return next(x.dtype for x in jax.tree.leaves(self.params)
                    if jnp.issubdtype(x.dtype, jnp.floating))

    def block_bytes(self, block_size: int, kv_dtype) -> int:
        """Bytes one block of its KV and stream caches takes."""
        c = self.cfg.layer
        kv = c.num_kv_heads * sum(c.kv_widths) * jnp.dtype(self.cache_dtype(kv_dtype)).itemsize
        return block_size * (kv + self.cfg.stream_width * jnp.dtype(self.params_dtype).itemsize)

    def target_forward(self, runner, batch: StepBatch):
        """The runner's forward of an ordinary step, writing its streams. -> (logits, kv cache)"""
        logits, kv, self.streams = runner.programs.run(
            self.forward_program, runner.params, runner.kv_cache, runner.last_tokens, batch,
            self.streams, key=forward_key(batch))
        return logits, kv

    # ---- Proposer ---------------------------------------------------------------------------
    def begin_step(self) -> None:
        pass

    def plan(self, seq, max_tokens: int) -> list[int]:
        return [0] * max_tokens  # placeholders: `propose` fills them on the device

    def propose(self, sched: SchedulerOutput, batch: StepBatch, v, variant: SamplerVariant):
        """Catch up, then the k-step chain for the step's speculating rows. -> (VerifyInputs with
        the proposals, q f32[S, K, V])"""
        self.copy_blocks(sched.block_copies)
        s = batch.md.num_seqs
        first_ids = np.zeros(s, np.int32)
        first_pos = np.zeros(s, np.int32)
        behind = []
        for r, entry in enumerate(sched.decodes):
            if not entry.proposal:
                continue
            seq, start = entry.seq, entry.start
            first_ids[r], first_pos[r] = seq.token_ids[start], start - 1
            seen = min(seq.draft_computed, start - 1)
            if seen < start - 1:
                behind.append((entry, seen))
            seq.draft_computed = start
        self.run_catch_up(behind)
        self.kv_cache, drafts, q = self.runner.programs.run(
            "eagle chain", self.params, self.embed, self.kv_cache, self.streams, first_ids, first_pos,
            v.num_drafts, batch.md.group(0).block_tables, batch.sampling, variant=variant,
            greedy_only=all_greedy(sched.scheduled))
        return dataclasses.replace(v, drafts=drafts), q

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """A step's attention-page copies in the head's KV and stream caches, in the runner's copy
        buckets (the step's state-page copies are the target's alone)."""
        for src, dst in self.runner.copy_batches(copies):
            self.kv_cache = copy_blocks(self.kv_cache, src, dst)
            self.streams = self.runner.programs.run("eagle stream copy", self.streams, src, dst)

    def run_catch_up(self, behind: list[tuple[ScheduledSeq, int]]) -> None:
        """Head KV at each row's positions seen .. start - 2; each position reads the token after
        it."""
        for chunk, batch in self.runner.catch_up_batches([(e, seen, e.start - 1)
                                                          for e, seen in behind]):
            ids = np.zeros(batch.token_ids.shape[0], np.int32)
            for piece, lo in zip(chunk, batch.md.query_start_loc):
                ids[lo:lo + piece.num_tokens] = piece.seq.token_ids[
                    piece.start + 1:piece.start + 1 + piece.num_tokens]
            self.kv_cache = self.runner.programs.run(
                "eagle catch-up", self.params, self.embed, self.kv_cache, self.streams, ids,
                batch.positions, batch.md)


def load_eagle(model_dir: str, target_cfg, dtype) -> EagleProposer:
    cfg, params = head.load_head(model_dir, target_cfg, dtype)
    return EagleProposer(cfg, head.fuse_projections(params))
