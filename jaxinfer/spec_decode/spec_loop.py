"""The on-device speculative loop: N verifying iterations of an on-device head (an EAGLE-3 head
or an MTP module, `eagle.EagleProposer`) in one jitted call.

A host-driven verifying step costs three dispatches (head catch-up, the k-step chain, the
target's verify) plus the host's building of each, and the host must see its tokens before it
schedules the next: at a few sequences that host time is most of a step. So while only decodes
run, every one of them speculates and at most `decode_loop_max_seqs` do, the scheduler reserves
KV slots for N (k + 1) tokens per row (`Speculator.loop_iterations`) and the runner runs N
iterations of

    the k-step head chain (its first step also catching the head up on the previous iteration's
    accepted positions) -> the target's verify of each row's k + 1 tokens -> exact rejection
    sampling -> advance each row

inside one `lax.fori_loop` of a fixed trip count (as step_programs.decode_loop: an exit on a device
value would copy it to the host and wait for it every iteration). Every iteration's metadata
(positions, slot mappings, ragged query starts, verify indices, catch-up positions) is computed
on the device from per-row state; a row that emits a stop token id (past min_tokens) or reaches
its length limit is masked from the next iteration on.

An iteration does for a row what the host-driven path does (`eagle._chain`, whose first step
takes the catch-up positions as one ragged query per row instead of a call of their own, then
`target_step.verify_forward` over the same ragged layout, out_pos and proposal count), so greedy
outputs are the same and sampled ones are distributed the same. The result has the verifying
step's layout with each row's emitted tokens packed ([N (k + 1), rows], -1 past a row's last):
the output processor treats it as one verifying step that emitted them all (each token past the
first advances num_computed; the rejected slots go back when it is processed,
`KVCacheManager.truncate`). `SpecLoopHandle.extras` carries per row the head's `draft_computed`,
and per iteration the proposals made and accepted (metrics, acceptance gate).
"""

from __future__ import annotations

import dataclasses
import hashlib
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.core.scheduler import SchedulerOutput
from jaxinfer.parallel.sharding import ShardingPlan
from jaxinfer.parallel.transfer import place_step_inputs
from jaxinfer.spec_decode.eagle import CatchUp, _chain, ragged, slots
from jaxinfer.spec_decode.target_step import verify_forward
from jaxinfer.worker.programs import shape_specs, variant_label
from jaxinfer.worker.rejection_sampler import verify
from jaxinfer.worker.runner import StepHandle
from jaxinfer.worker.sampler import SamplerVariant
from jaxinfer.worker.step_inputs import StepBatch, all_greedy, sampler_variant
from jaxinfer.model.kernel_table import KernelTable
from pallas_kernels.attention.backend import AttentionBackend
from pallas_kernels.attention.metadata import AttentionMetadata

# Iterations per loop when --spec-loop-iterations is not given: each emits ~1 + accepted tokens
# per row, and a request arriving meanwhile waits for the whole loop (as for the decode loop).
AUTO_SPEC_LOOP_ITERATIONS = 4


def _spec_loop(params, kv_cache, last_tokens, head_params, embed, head_kv, streams,
               batch: StepBatch, rows, *, cfg, head_cfg,
               kernels: KernelTable, head_kernels: KernelTable, block_size: int, k: int,
               iterations: int,
               variant: SamplerVariant, plan: ShardingPlan | None, layers: tuple[int, ...],
               greedy_only: bool = False):
    """`batch`: the rows as one-token decodes (positions: each row's input position, token_ids
    its input token, sampling.out_pos that token's output index, lora_slot its adapter's slot or
    None: the target verifies with it; the head proposes without). rows i32[S, 3 + k] (one host
    array, one transfer): the tokens each row may still add (0: padding), then the head catch-up
    owed before its first chain (`CatchUp`: pos, num, ids). -> (kv cache, last tokens, head KV,
    streams, packed SamplerOutput [N (k + 1), S], (draft_computed i32[S], proposed i32[N, S],
    accepted i32[N, S]))"""
    md0, t0 = batch.md, batch.sampling
    room, catch = rows[:, 0], CatchUp(rows[:, 3:], rows[:, 1], rows[:, 2])
    s, k1, width = md0.num_seqs, k + 1, iterations * (k + 1)
    tables, tables0 = md0.block_tables, md0.group(0).block_tables
    cols = jnp.arange(s)[None, :]
    jk = jnp.arange(k1)[:, None]
    shape = jax.eval_shape(
        lambda lg, d, q: verify(lg, d, room, t0, variant, q).sampled,
        jax.ShapeDtypeStruct((s, k1, cfg.vocab_size), jnp.float32),
        jax.ShapeDtypeStruct((s, k), jnp.int32),
        jax.ShapeDtypeStruct((s, k, cfg.vocab_size), jnp.float32))
    record = jax.tree_util.tree_map(lambda a: jnp.zeros((width, *a.shape[1:]), a.dtype), shape)
    record = record._replace(tokens=jnp.full((width, s), -1, jnp.int32))
    proposed = jnp.zeros((iterations, s), jnp.int32)

    def body(i, carry):
        kv, last, hkv, strm, pos, tok, adv, done, cu, dc, rec, props, accs = carry
        live = ~done
        n = jnp.where(live, jnp.clip(room - adv - 1, 0, k), 0)  # the host's min(K, limit - 1)
        t = dataclasses.replace(t0, out_pos=t0.out_pos + adv)
        # 1. k proposals per row, the head's KV at the previous iteration's accepted positions
        # (the target's streams) computed by the chain's first step
        hkv, drafts, q = _chain(head_params, embed, hkv, strm, tok, pos - 1, n, tables0, t,
                                CatchUp(cu.ids, cu.pos, jnp.where(live, cu.num, 0)),
                                cfg=head_cfg, kernels=head_kernels, block_size=block_size, k=k,
                                variant=variant, greedy_only=greedy_only)
        # 2. the target's verify: rows of n + 1 tokens packed as the host packs them
        qsl, r, j = ragged(jnp.where(live, n + 1, 0), s * k1)
        owned = r < s
        rr = jnp.minimum(r, s - 1)
        vpos = jnp.where(owned, pos[rr] + j, 0)
        ids = jnp.where(j == 0, tok[rr], drafts[rr, jnp.clip(j - 1, 0, k - 1)])
        md = AttentionMetadata(slots(tables, r, vpos, owned, block_size), qsl,
                               jnp.where(live, pos + n + 1, 0), tables, kv_layout=md0.kv_layout)
        vidx = jnp.minimum(qsl[:-1, None] + jnp.minimum(jk.T, n[:, None]), s * k1 - 1)
        lora = None if batch.lora_slot is None else jnp.where(owned, batch.lora_slot[rr], 0)
        kv, out, strm = verify_forward(params, kv, strm, jnp.where(owned, ids, 0), vpos, md, vidx,
                                       t, drafts, n, q, lora, cfg=cfg, kernels=kernels,
                                       variant=variant, plan=plan, layers=layers,
                                       greedy_only=greedy_only)
        # 3. each live row advances by what it emitted: its tokens go to the record packed
        acc = out.num_accepted
        emitted = jnp.where(live, acc + 1, 0)
        keep = jk < emitted[None, :]
        at = jnp.where(keep, adv[None, :] + jk, width)
        rec = jax.tree_util.tree_map(lambda a, o: a.at[at, cols].set(o, mode="drop"), rec,
                                     out.sampled)
        toks = out.sampled.tokens
        new_tok = jnp.take_along_axis(toks, acc[None, :], axis=0)[0]
        hit = (jnp.any(toks[..., None] == t.stop_ids[None], axis=-1)
               & (t.out_pos[None, :] + jk >= t.min_tokens[None, :]) & keep).any(axis=0)
        dst = jnp.where(live & (batch.emit_slot >= 0), batch.emit_slot, last.shape[0])
        last = last.at[dst].set(new_tok, mode="drop")
        adv = adv + emitted
        return (kv, last, hkv, strm, jnp.where(live, pos + emitted, pos),
                jnp.where(live, new_tok, tok), adv, done | (live & (hit | (adv >= room))),
                CatchUp(drafts, pos, acc), jnp.where(live, pos, dc), rec, props.at[i].set(n),
                accs.at[i].set(jnp.where(live, acc, 0)))

    init = (kv_cache, last_tokens, head_kv, streams, batch.positions, batch.token_ids,
            jnp.zeros(s, jnp.int32), room <= 0, catch, batch.positions, record, proposed,
            proposed)
    out = jax.lax.fori_loop(0, iterations, body, init)
    kv_cache, last_tokens, head_kv, streams = out[:4]
    return kv_cache, last_tokens, head_kv, streams, out[10], (out[9], out[11], out[12])


def _prefill_kernels_only(kernels: KernelTable) -> KernelTable:
    """The loop's ragged calls (the verify, the head's first step) send every row to the
    backend's prefill kernel: their rows hold several tokens, so looking for one-token rows on
    the device (`split_mixed_steps`) would launch a decode kernel per layer for next to nothing
    (a row proposing nothing, at its limit, is the only one)."""
    if isinstance(kernels.attention, AttentionBackend) and kernels.attention.split_mixed_steps:
        return dataclasses.replace(kernels, attention=dataclasses.replace(
            kernels.attention, split_mixed_steps=False))
    return kernels


class SpecLoopHandle(StepHandle):
    """A dispatched loop; `result()` also fetches `extras` (numpy): (draft_computed [rows],
    proposals [N, rows], accepted [N, rows]), per iteration 0 where a row did not run."""

    def __init__(self, sched: SchedulerOutput, out, width: int, extras):
        super().__init__(sched, out, width, time.perf_counter(), True)
        self._extras = extras
        self.extras: tuple[np.ndarray, ...] | None = None

    def result(self):
        res = super().result()
        if self.extras is None:
            n = len(self.sched.decodes)
            dc, proposed, accepted = jax.device_get(self._extras)
            self.extras = (np.asarray(dc)[:n], np.asarray(proposed)[:, :n],
                           np.asarray(accepted)[:, :n])
        return res


class SpecLoop:
    """The runner's side: builds a loop's inputs from a scheduled step and dispatches it."""
    program = "spec loop"  # in the runner's table (KV cache, last tokens, head KV, streams donated)

    def __init__(self, runner, proposer, k: int, iterations: int):
        """Adds the loop to `runner`'s programs; warm-up (worker/bucket_compiler.py) compiles it
        per (rows, sampler variant, greedy only), a loop without one compiling through jit on its
        first call."""
        self.proposer, self.k, self.iterations = proposer, k, iterations
        runner.programs.add(self.program, _spec_loop, static_argnames=("variant", "greedy_only"),
                            donate_argnums=(1, 2, 5, 6), cfg=runner.cfg, head_cfg=proposer.cfg,
                            kernels=_prefill_kernels_only(runner.kernels),
                            head_kernels=_prefill_kernels_only(proposer.head_kernels),
                            block_size=runner.block_size, k=k, iterations=iterations,
                            plan=runner.plan, layers=tuple(proposer.aux_layers))
        self.dispatches = 0  # loops run (benchmarks, tests)

    def compile_specs(self, target_specs: tuple, batch: StepBatch,
                      variant: SamplerVariant) -> list[tuple[str, tuple, dict, tuple]]:
        """(name, lowering arguments, static arguments, key in the runner's table) of the loop
        over `batch`'s rows (an all-padding batch of `variant`), greedy-only and sampled.
        `target_specs`: the runner's (params, KV cache, last tokens) as shape specs."""
        p, s = self.proposer, batch.token_ids.shape[0]
        head = shape_specs((p.params, p.embed, p.kv_cache, p.streams))
        args = (*target_specs, *head, batch, jax.ShapeDtypeStruct((s, 3 + self.k), jnp.int32))
        # The executable cache keys on argument shapes and static arguments: the head's config,
        # k and N go in the name.
        tag = hashlib.sha256(repr((p.cfg, tuple(p.aux_layers))).encode()).hexdigest()[:12]
        return [(f"spec loop {s} {variant_label(variant)}{' greedy' if g else ''} k{self.k} "
                 f"x{self.iterations} head {tag}", args, dict(variant=variant, greedy_only=g),
                 (s, variant, g)) for g in (True, False)]

    def execute(self, runner, sched: SchedulerOutput):
        """Dispatch the loop on the runner's state (its block copies already applied): the new
        KV cache and last tokens, for the runner to keep, and the loop's handle."""
        p, k = self.proposer, self.k
        p.copy_blocks(sched.block_copies)
        rows = [dataclasses.replace(e, num_tokens=1, proposal=[]) for e in sched.decodes]
        s = runner.buckets.decode_shape(len(rows))
        variant = sampler_variant(rows)
        batch = runner.step_batch(rows, s, s, s, variant)  # LoRA slots as the runner's steps
        state = np.zeros((s, 3 + k), np.int32)  # room, then the catch-up: pos, num, ids
        behind = []  # rows further behind than one iteration's catch-up: one host-built call
        for r, e in enumerate(sched.decodes):
            seq, start = e.seq, e.start
            state[r, 0] = seq.token_limit - len(seq.token_ids)
            seen = min(seq.draft_computed, start - 1)
            if start - 1 - seen > k:
                behind.append((e, seen))
                seen = start - 1
            num = max(start - 1 - seen, 0)
            state[r, 1:3] = seen, num
            state[r, 3:3 + num] = seq.token_ids[seen + 1:start]
            seq.draft_computed = start  # at least; processing the loop sets where it ended
        p.run_catch_up(behind)
        greedy = all_greedy(rows)
        kv_cache, last_tokens, p.kv_cache, p.streams, out, extras = runner.programs.run(
            self.program, runner.params, runner.kv_cache, runner.last_tokens, p.params, p.embed,
            p.kv_cache, p.streams, place_step_inputs(batch, runner.plan), state,
            key=(s, variant, greedy), variant=variant, greedy_only=greedy)
        self.dispatches += 1
        return kv_cache, last_tokens, SpecLoopHandle(sched, out, self.iterations * (k + 1),
                                                     extras)
