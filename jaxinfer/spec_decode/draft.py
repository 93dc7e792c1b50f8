"""The draft-model proposer (`--speculative-model DIR`): a smaller model with the target's
tokenizer proposes k tokens per speculating decode, on the device, right before the target step
that verifies them.

Its KV cache is a paged cache of its own (its layers and heads) over the *same block ids* as the
target's: a sequence's draft KV lives in the blocks of its target block table, so the draft needs
no bookkeeping of its own beyond `Sequence.draft_computed`, the tokens whose draft KV is written.
Those are valid up to the sequence's `num_computed` (rejected proposals and anything after a
preemption are recomputed), so before proposing, the draft catches up on the tokens it has not
seen: usually none or one (the last accepted proposal), a whole prompt when the sequence starts
speculating (in prefill chunks of at most --max-num-batched-tokens). Then one jitted call runs its
k autoregressive steps (a `fori_loop` of pure-decode steps, cache donated) and returns the
proposals and their distributions q (the request's temperature, top-k / top-p / min-p, min_tokens
ban and penalties applied as to the target, `sampler.process_logits`; greedy rows propose the
argmax, a point mass).

The draft's sampling noise is the sampler's stream of a different seed (`seed ^ DRAFT_STREAM`), so
proposals are independent of the target's accept tests and resamples. Blocks shared through the
prefix cache may hold draft KV another sequence wrote, or none (a block computed while speculation
was off): that lowers acceptance, never changes outputs, since verification is exact for any q.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.worker.kv import allocate_kv_cache, copy_blocks
from jaxinfer.core.scheduler import ScheduledSeq, SchedulerOutput
from jaxinfer.errors import ConfigError
from jaxinfer.model.config import ModelConfig, load_config
from jaxinfer.model.transformer import forward, param_shapes
from jaxinfer.parallel.kernels import shard_kernels, unsharded
from jaxinfer.parallel.sampling_logits import sample_in_layout
from jaxinfer.parallel.sharding import ShardingPlan, per_device_bytes, validate_parallel_sizes
from jaxinfer.worker.rejection_sampler import expand_positions, propose_tokens
from jaxinfer.worker.sampler import SamplerVariant, SamplingTensors
from jaxinfer.worker.step_inputs import StepBatch
from jaxinfer.model.kernel_table import KernelTable
from pallas_kernels.attention.metadata import AttentionMetadata

def _propose_loop(params, kv_cache, first_ids, first_pos, num, block_tables, t: SamplingTensors,
                  *, cfg: ModelConfig, kernels: KernelTable, block_size: int, k: int,
                  variant: SamplerVariant, plan: ShardingPlan | None = None):
    """k draft decode steps over S rows: step i reads the token at position first_pos + i (the
    row's last known token, then its own proposals), writes its KV and proposes the next token.
    Rows with num <= i are padding in step i. -> (kv cache, drafts i32[S, k], q f32[S, k, V])"""
    s = first_ids.shape[0]
    v = cfg.vocab_size
    rows = jnp.arange(s)
    qsl = jnp.arange(s + 1, dtype=jnp.int32)
    max_blocks = block_tables.shape[1]

    def body(i, carry):
        kv, drafts, probs = carry
        ids = jnp.where(i == 0, first_ids, drafts[:, jnp.maximum(i - 1, 0)])
        pos = first_pos + i
        valid = i < num
        blk = block_tables[rows, jnp.minimum(pos // block_size, max_blocks - 1)]
        md = AttentionMetadata(jnp.where(valid, blk * block_size + pos % block_size, -1), qsl,
                               jnp.where(valid, pos + 1, 0), block_tables, num_decodes=s)
        with jax.named_scope("draft"):
            logits, kv = forward(params, cfg, ids, pos, kv, md, kernels, rows)
        ti = jax.tree_util.tree_map(lambda a: a[rows * (k + 1) + i],
                                    expand_positions(t, drafts))
        # Under TP the rows are made whole first, as the sampler's (parallel/sampling_logits.py):
        # no collective inside process_logits' conditionals (within this loop's body).
        d, q = sample_in_layout(functools.partial(propose_tokens, variant=variant), logits, ti, plan)
        drafts = drafts.at[:, i].set(jnp.where(valid, d, 0))
        return kv, drafts, probs.at[:, i].set(q)

    init = (kv_cache, jnp.zeros((s, k), jnp.int32), jnp.zeros((s, k, v), jnp.float32))
    return jax.lax.fori_loop(0, k, body, init)


def _catch_up(params, kv_cache, batch: StepBatch, *, cfg: ModelConfig, kernels: KernelTable):
    """The draft's forward over tokens it has not seen (KV only; the logits are not needed)."""
    with jax.named_scope("draft_catch_up"):
        _, kv_cache = forward(params, cfg, batch.token_ids, batch.positions, kv_cache, batch.md,
                              kernels, batch.logits_indices[:1])
    return kv_cache


class DraftModel:
    """A loaded draft model; `attach` gives it its KV cache once the target's pool is sized.
    Under tensor parallelism it is split over the target's devices as the target is (its own
    `ShardingPlan` on the target's mesh: heads, MLP and vocabulary over tp)."""
    on_device = True

    def __init__(self, cfg: ModelConfig, params, plan: ShardingPlan | None = None):
        """`plan`: the draft's plan when `params` are already placed by it (`load_draft`)."""
        self.cfg = cfg
        self.params = params
        self.sharding_plan = plan
        self.k = 0
        self.kv_cache = None

    # ---- set-up -----------------------------------------------------------------------------
    def attach(self, runner, num_blocks: int, kv_dtype, k: int) -> None:
        """Its KV cache beside the target's (same block ids); `k` proposals per row and step."""
        self.runner = runner
        self.k = k
        if self.sharding_plan is None and runner.plan is not None and runner.plan.tp > 1:
            self.sharding_plan = draft_plan(self.cfg, runner.plan, "the draft model")
            self.params = jax.device_put(self.params, self.sharding_plan.params(self.params))
        plan = self.sharding_plan
        if not runner.kv_groups.specs[0].keeps_every_block:  # its blocks would be freed
            raise ConfigError("a draft model needs a target with a full-attention layer, or "
                              "--no-hybrid-kv-cache: it keeps its KV in the first group's blocks")
        self.kv_cache = allocate_kv_cache(self.cfg, num_blocks, runner.block_size, kv_dtype,
                                          num_heads=plan and plan.stored_kv_heads,
                                          sharding=plan and plan.kv_cache)
        kernels = shard_kernels(unsharded(runner.kernels), plan)  # the target's, on its own plan
        runner.programs.add("draft propose", _propose_loop, static_argnames=("variant",),
                            donate_argnums=(1,), cfg=self.cfg, kernels=kernels,
                            block_size=runner.block_size, k=self.k, plan=plan)
        runner.programs.add("draft catch-up", _catch_up, donate_argnums=(1,), cfg=self.cfg,
                            kernels=kernels)

    def block_bytes(self, block_size: int, kv_dtype) -> int:
        """Bytes one block of its KV cache takes on one device."""
        c = self.cfg
        heads = self.sharding_plan.kv_heads_per_device if self.sharding_plan else c.num_kv_heads
        return kv_block_bytes(c, block_size, c.num_layers, heads, jnp.dtype(kv_dtype).itemsize)

    # ---- Proposer ---------------------------------------------------------------------------
    def begin_step(self) -> None:
        pass

    def plan(self, seq, max_tokens: int) -> list[int]:
        return [0] * max_tokens  # placeholders: `propose` fills them on the device

    def propose(self, sched: SchedulerOutput, batch: StepBatch, v, variant: SamplerVariant):
        """Catch up, then propose for the step's speculating rows. -> (VerifyInputs with the
        device's proposals, q f32[S, K, V])"""
        runner = self.runner
        for src, dst in runner.copy_batches(sched.block_copies):
            self.kv_cache = copy_blocks(self.kv_cache, src, dst)
        s = batch.md.num_seqs
        first_ids = np.zeros(s, np.int32)
        first_pos = np.zeros(s, np.int32)
        behind = []
        for r, entry in enumerate(sched.decodes):
            if not entry.proposal:
                continue
            seq, start = entry.seq, entry.start
            first_ids[r], first_pos[r] = seq.token_ids[start], start
            seen = min(seq.draft_computed, start)
            if seen < start:
                behind.append((entry, seen))
            seq.draft_computed = start + len(entry.proposal)
        self._run_catch_up(behind)
        self.kv_cache, drafts, q = runner.programs.run(
            "draft propose", self.params, self.kv_cache, first_ids, first_pos, v.num_drafts,
            batch.md.group(0).block_tables, batch.sampling, variant=variant)
        return dataclasses.replace(v, drafts=drafts), q

    def _run_catch_up(self, behind: list[tuple[ScheduledSeq, int]]) -> None:
        """Draft KV for each (row, first unseen position) up to the row's input token."""
        spans = [(entry, seen, entry.start) for entry, seen in behind]
        for _, batch in self.runner.catch_up_batches(spans):
            self.kv_cache = self.runner.programs.run("draft catch-up", self.params, self.kv_cache,
                                                     dataclasses.replace(batch, sampling=None))


def draft_plan(cfg: ModelConfig, target: ShardingPlan, name: str) -> ShardingPlan:
    """The draft's plan on the target's mesh, refused (ConfigError naming --speculative-model)
    when the draft's heads or MLP do not split over the target's tp."""
    try:
        validate_parallel_sizes(cfg, target.tp, 1, jax.device_count(), target.expert_layout)
    except ConfigError as e:
        raise ConfigError(f"--speculative-model {name}: {e}") from None
    return ShardingPlan(target.mesh, cfg, target.expert_layout)


def load_draft(model_dir: str, target_cfg: ModelConfig, target_tokenizer, dtype, load_format: str,
               seed: int, target_plan: ShardingPlan | None = None) -> DraftModel:
    """The draft model of --speculative-model, refused (ConfigError naming the flag) unless it
    shares the target's vocabulary and tokenizer; under tensor parallelism loaded into its
    shards over the target's devices."""
    from jaxinfer.model.tokenizer import load_tokenizer
    from jaxinfer.model.weights import load_params
    cfg = load_config(model_dir)  # it runs on the target's kernel table (`attach`)
    if cfg.vocab_size != target_cfg.vocab_size:
        raise ConfigError(f"--speculative-model {model_dir!r}: its vocabulary has "
                          f"{cfg.vocab_size} tokens, the target's {target_cfg.vocab_size}; the "
                          f"draft must share the target's tokenizer")
    draft_tok = load_tokenizer(model_dir)
    if target_tokenizer is not None and (
            draft_tok is None or draft_tok._tok.get_vocab(True) != target_tokenizer._tok.get_vocab(True)):
        raise ConfigError(f"--speculative-model {model_dir!r}: its tokenizer differs from the "
                          f"target's; the draft must share the target's tokenizer")
    plan = None
    if target_plan is not None and target_plan.tp > 1:
        plan = draft_plan(cfg, target_plan, repr(model_dir))
    params = jax.block_until_ready(load_params(
        model_dir, cfg, dtype, load_format, seed=seed + 1,
        shardings=plan and plan.params(param_shapes(cfg, dtype))))
    return DraftModel(cfg, params, plan)


def draft_for_engine(args, target_cfg: ModelConfig, tokenizer, dtype,
                     plan: ShardingPlan | None = None):
    """The engine's draft model when --speculative-model is set (an `eagle.EagleProposer` for
    method eagle3, or the checkpoint's MTP module for method mtp), else None; `plan`: the
    target's (the draft is split over the same devices)."""
    spec = args.spec_config()
    if spec is None or spec.method not in ("draft_model", "eagle3", "mtp"):
        return None
    if args.data_parallel_size > 1:
        raise ConfigError("--speculative-model cannot be combined with --data-parallel-size > 1")
    if spec.method == "mtp":
        from jaxinfer.spec_decode.mtp import load_mtp
        return load_mtp(args.model_path, target_cfg, dtype)
    if spec.method == "eagle3":
        from jaxinfer.spec_decode.eagle import load_eagle
        return load_eagle(spec.model, target_cfg, dtype)
    return load_draft(spec.model, target_cfg, tokenizer, dtype, args.load_format, args.seed, plan)


def kv_block_bytes(cfg: ModelConfig, block_size: int, layers: int, heads: int,
                   itemsize: int) -> int:
    """One block's cache bytes on one device: K and V widths per head (an MLA model's V is
    empty: its latent is the K array alone, ModelConfig.kv_widths)."""
    return block_size * layers * heads * sum(cfg.kv_widths) * itemsize


def share_blocks(num_blocks: int, draft: DraftModel, target_cfg: ModelConfig, block_size: int,
                 kv_dtype, plan: ShardingPlan | None = None, num_slots: int | None = None) -> int:
    """The planner sized the pool for the target alone (per device, `plan`: the target's): the
    same memory holds the draft's weights and, per block, the draft's KV as well. (A CPU pool is
    not sized from memory: kept.) `num_slots`: the target's cache arrays (KVCacheGroups)."""
    if jax.devices()[0].platform == "cpu":
        return num_blocks
    itemsize = jnp.dtype(kv_dtype).itemsize
    heads = plan.kv_heads_per_device if plan else target_cfg.num_kv_heads
    target = kv_block_bytes(target_cfg, block_size, num_slots or target_cfg.num_layers, heads,
                            itemsize)
    weights = per_device_bytes(draft.params)
    return max(1, (num_blocks * target - weights) // (target + draft.block_bytes(block_size,
                                                                                 kv_dtype)))
