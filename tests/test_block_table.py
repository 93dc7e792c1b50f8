"""The runner's persistent block tables (worker/block_table.py) never go stale: after any mix of
KV-manager changes (appends, copy-on-write after a fork, a deduplicated block, a truncation, a
windowed group's skipped blocks, a fixed state's pages, a slot taken by a new sequence, a
preempted sequence back in the same slot), a slot's row equals its tables built from scratch, in
the manager alone and in the engine's own steps (every step's arrays equal a from-list build)."""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.core.kv_cache import FixedStateSpec, FullAttentionSpec, KVCacheGroups
from jaxinfer.core.kv_cache.manager import KVCacheManager
from jaxinfer.core.scheduler_output import ScheduledSeq
from jaxinfer.sampling_params import SamplingParams
from jaxinfer.worker.block_table import BlockTable
from jaxinfer.worker.runner import StepHandle, StepResult
from jaxinfer.worker.step_inputs import build_step_batch
from test_engine_support import make_engine, prompt_ids

BS = 4
WIDTH = 16
NUM_SLOTS = 4
PAGE = FullAttentionSpec(1, 2)  # 4 float32 tokens x (K + V) x 2 = 64 bytes a page
LAYOUTS = {
    "one group": KVCacheGroups.full_attention(1),
    "sliding window": KVCacheGroups.from_layer_windows([None, 6]),
    "fixed state": KVCacheGroups.from_layer_specs([PAGE, FixedStateSpec(100, page_of=PAGE)]),
}


class _Driver:
    """Random KV-manager traffic over NUM_SLOTS slots, as the scheduler makes it."""

    def __init__(self, groups: KVCacheGroups, seed: int):
        self.rng = np.random.default_rng(seed)
        stateful = any(p is not None for p in groups.state_pages(BS, jnp.float32))
        # (A fixed state's prefix hits need the engine's snapshots: no prefix caching here.)
        self.mgr = KVCacheManager(40, BS, not stateful, groups, kv_dtype=jnp.float32)
        pages = groups.state_pages(BS, jnp.float32)
        self.table = BlockTable(NUM_SLOTS, groups.num_groups, WIDTH,
                                [g for g, p in enumerate(pages) if p is None])
        self.slot: dict[str, int] = {}
        self.tokens: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.seen = dict(copies=0, truncations=0, resumed_in_place=0, reused=0, edits=0)
        self._ids = iter(range(10**6))
        self._last_owner: list[str | None] = [None] * NUM_SLOTS

    def free_slot(self) -> int | None:
        free = sorted(set(range(NUM_SLOTS)) - set(self.slot.values()))
        return int(self.rng.choice(free)) if free else None

    def take_slot(self, rid: str, slot: int) -> None:
        if self._last_owner[slot] not in (None, rid):
            self.seen["reused"] += 1
        self._last_owner[slot] = rid
        self.slot[rid] = slot

    def admit(self, rid: str, tokens: list[int], slot: int) -> bool:
        mgr = self.mgr
        match = bool(self.rng.random() < 0.7)  # else computed again: its blocks deduplicated
        n = mgr.get_computed_blocks(rid, tokens, match=match)
        if not mgr.allocate_slots(rid, len(tokens) - n):
            mgr.free(rid, admitted=False)
            return False
        self.take_slot(rid, slot)
        self.tokens[rid], self.computed[rid] = tokens, len(tokens)
        mgr.cache_blocks(rid, tokens, len(tokens))
        return True

    def step(self) -> None:
        mgr, rng = self.mgr, self.rng
        op = rng.choice(["admit", "decode", "decode", "fork", "speculate", "finish", "preempt"])
        live = sorted(self.slot)
        slot = self.free_slot()
        if op == "admit" or not live:
            if slot is not None:  # a few shared prefixes: prefix hits and duplicate blocks
                prompt = [int(rng.integers(3))] * 5 + rng.integers(3, 9, rng.integers(1, 9)).tolist()
                self.admit(f"r{next(self._ids)}", prompt, slot)
            return
        rid = live[int(rng.integers(len(live)))]
        if op in ("decode", "speculate"):
            extra = int(rng.integers(1, 6)) if op == "speculate" else 1
            if not mgr.allocate_slots(rid, extra):
                return
            if op == "speculate":  # the proposals' slots (the step is built with them), then
                self.check([rid])  # the rejected ones' back
                accepted = int(rng.integers(0, extra))
                held = len(mgr.get_block_ids(rid))
                mgr.truncate(rid, self.computed[rid] + accepted + 1)
                self.seen["truncations"] += len(mgr.get_block_ids(rid)) < held
                extra = accepted + 1
            self.tokens[rid] += [int(t) for t in rng.integers(3, 9, extra)]
            self.computed[rid] += extra
            mgr.cache_blocks(rid, self.tokens[rid], self.computed[rid])
        elif op == "fork" and slot is not None:
            child = f"r{next(self._ids)}"
            mgr.fork(rid, child)
            self.take_slot(child, slot)
            self.tokens[child], self.computed[child] = list(self.tokens[rid]), self.computed[rid]
        elif op == "finish":
            mgr.free(rid)
            del self.slot[rid]
        elif op == "preempt":  # freed, then back (the scheduler's recompute) in any free slot
            mgr.free(rid)
            old = self.slot.pop(rid)
            back = self.free_slot()
            if self.admit(rid, self.tokens[rid], back):
                self.seen["resumed_in_place"] += back == old
        self.seen["copies"] += len(mgr.take_pending_copies())

    def check(self, rids) -> None:
        """Bring the rows of `rids` (this step's scheduled ones) up to date, compare them."""
        mgr, g = self.mgr, self.mgr.groups.num_groups
        for rid in rids:
            tables = mgr.get_block_tables(rid)
            entry = ScheduledSeq(types.SimpleNamespace(slot=self.slot[rid]), 0, 1, False,
                                 tables[0], tables if g > 1 else None, mgr.table_version(rid))
            want = np.zeros((g, WIDTH), np.int32)
            for i, t in enumerate(tables):
                want[i, :len(t)] = t
            assert self.table.row_of(entry) == self.slot[rid]
            np.testing.assert_array_equal(self.table.rows[:, self.slot[rid]], want, err_msg=rid)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_rows_follow_every_kind_of_table_change(layout):
    driver = _Driver(LAYOUTS[layout], seed=sorted(LAYOUTS).index(layout))
    versions: dict[str, int] = {}
    for _ in range(1500):
        driver.step()
        live = sorted(driver.slot)
        for rid in live:  # (a version that changed under an unchanged request: an edit)
            v = driver.mgr.table_version(rid)
            driver.seen["edits"] += rid in versions and versions[rid] != v
            versions[rid] = v
        # Some rows sit out some steps: their changes pile up until they are scheduled again.
        driver.check([r for r in live if driver.rng.random() < 0.6])
    seen = driver.seen
    assert seen["reused"] and seen["resumed_in_place"] and seen["edits"], seen
    assert seen["copies"] and seen["truncations"], seen


def test_a_row_without_slot_or_version_is_built_from_its_lists():
    """An n > 1 prompt sequence (no slot) and a proposer's catch-up piece (no version) get the
    padding row, which stays zeros; build_step_batch fills their tables from their lists."""
    table = BlockTable(2, 1, 4, [0])
    seq = types.SimpleNamespace(slot=-1)
    assert table.row_of(ScheduledSeq(seq, 0, 1, False, [5, 6], None, 3)) == table.pad
    seq.slot = 1
    assert table.row_of(ScheduledSeq(seq, 0, 1, False, [5, 6], None, None)) == table.pad
    assert not table.rows.any()


def _fake_result(sched, rng) -> StepResult:
    n = len(sched.scheduled)
    return StepResult(rng.integers(2, 30, (1, n)).astype(np.int32), None, None, None)


def test_engine_steps_match_a_build_from_lists():
    """The engine's own scheduler and output side (no device: each step's tokens are drawn):
    arrivals sharing prefixes, n = 2 forks, aborts and preemption in a small pool; every step's
    arrays with the persistent tables equal those built from the rows' lists."""
    rng = np.random.default_rng(0)
    engine = make_engine(num_blocks=24, long_prefill_chunk=8)
    runner, scheduler = engine.runner, engine.scheduler
    shared = prompt_ids(1, 9)
    reused_slots, steps = 0, 0
    owners: dict[int, object] = {}
    for i in range(40):
        prompt = shared[:int(rng.integers(4, 10))] + prompt_ids(100 + i, int(rng.integers(1, 12)))
        engine.add_request(f"r{i}", prompt, SamplingParams(
            n=int(rng.choice([1, 2])), max_tokens=int(rng.integers(1, 14)), ignore_eos=True))
        if rng.random() < 0.1:
            engine.abort(f"r{int(rng.integers(i + 1))}")
        for _ in range(int(rng.integers(1, 4))):
            sched = scheduler.schedule()
            if not sched:
                continue
            batch, variant, _ = runner.build(sched)
            md = batch.md
            scratch = build_step_batch(
                sched.scheduled, md.num_decodes, batch.token_ids.shape[0], md.num_seqs,
                runner.sampling_table, runner.block_size, runner.max_blocks,
                runner.max_model_len, variant, runner.has_lora, runner.kv_groups.kv_layout)
            jax.tree_util.tree_map(np.testing.assert_array_equal, batch, scratch)
            for entry in sched.scheduled:
                slot = entry.seq.slot
                reused_slots += slot >= 0 and owners.get(slot, entry.seq) is not entry.seq
                owners[slot] = entry.seq
            handle = StepHandle(sched, None, 1, 0.0, False)
            handle._result = _fake_result(sched, rng)
            engine._collect(engine._process(handle))
            steps += 1
    assert steps > 50 and reused_slots and scheduler.num_preemptions
    assert scheduler.kv.stats.hits
