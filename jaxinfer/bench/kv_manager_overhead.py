"""Host cost of the KV-cache manager's work in one scheduling step (CPU).

The workload: 256 running sequences decoding (each step: allocate a slot for one token, read the
block table for the runner, cache the block that just filled), plus per step 2 new requests
admitted by prefix match on a shared system prompt (512-token prompts), 2 forks (parallel sampling;
their first appends copy-on-write) and 4 finished requests freed, so the batch stays at 256.
Reports the median and p99 wall time over many steps, and the median CPU time, in µs.

    jaxinfer bench throughput --host-overhead --kv-manager [--num-seqs 256] [--steps 3000]
        [--block-size 16] [--num-blocks 65536] [--save [DIR]]   # record kv_manager_block<N>
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections import deque

import numpy as np

from jaxinfer.bench import results_io
from jaxinfer.core.kv_cache import KVCacheManager

SYSTEM_PROMPT = list(range(1000, 1256))  # 256 tokens = 16 blocks of 16, shared by every request


class Workload:
    def __init__(self, num_running: int, num_blocks: int, block_size: int, seed: int,
                 num_prompts: int):
        self.mgr = KVCacheManager(num_blocks, block_size, enable_prefix_caching=True)
        self.rng = random.Random(seed)
        # Prompts are made up front so that the timed steps measure the manager, not the RNG.
        user = np.random.default_rng(seed).integers(0, 32000, (num_prompts + num_running, 256))
        self.prompts = deque(SYSTEM_PROMPT + row for row in user.tolist())
        self.tokens: dict[int, list[int]] = {}
        self.running: deque[int] = deque()
        self.next_id = 0
        for _ in range(num_running):
            self.admit()
            self.finish_prefill()

    def admit(self) -> int:
        rid, prompt = self.next_id, self.prompts.popleft()
        self.next_id += 1
        hit = self.mgr.get_computed_blocks(rid, prompt)
        if not self.mgr.allocate_slots(rid, len(prompt) - hit):
            raise SystemExit("benchmark pool too small: raise --num-blocks")
        self.tokens[rid] = prompt
        self.running.append(rid)
        return rid

    def finish_prefill(self) -> None:
        rid = self.running[-1]
        self.mgr.cache_blocks(rid, self.tokens[rid], len(self.tokens[rid]))
        self.tokens[rid].append(7)  # first sampled token, no KV yet

    def step(self) -> None:
        """One step's manager work: what the scheduler, runner and output processing call."""
        mgr, tokens = self.mgr, self.tokens
        admitted = {self.admit() for _ in range(2)}  # prefix match + prompt allocation
        for _ in range(2):  # parallel sampling: fork a running sequence
            parent = self.running[self.rng.randrange(len(self.running))]
            child = self.next_id
            self.next_id += 1
            mgr.fork(parent, child)
            tokens[child] = list(tokens[parent])
            self.running.append(child)
        for _ in range(4):  # finished requests
            mgr.free(self.running.popleft())
        decoding = [rid for rid in self.running if rid not in admitted]  # admitted: prefill
        for rid in decoding:
            if not mgr.allocate_slots(rid, 1):
                raise SystemExit("benchmark pool too small: raise --num-blocks")
        mgr.take_pending_copies()
        num_block_entries = sum(len(mgr.get_block_ids(rid)) for rid in self.running)  # runner
        # After the step: the KV of every scheduled token is written.
        for rid in decoding:
            toks = tokens[rid]
            mgr.cache_blocks(rid, toks, len(toks))
            toks.append(7)
        for rid in admitted:
            mgr.cache_blocks(rid, tokens[rid], len(tokens[rid]))
            tokens[rid].append(7)
        assert num_block_entries > 0


WARMUP_STEPS = 200  # untimed first: the pool's free lists and the prefix cache settle
DEFAULT_NUM_BLOCKS = 65536


def run(args: argparse.Namespace) -> dict:
    """The throughput driver's flags: --num-seqs running sequences, --steps timed steps,
    --block-size, --num-blocks (default 65536), --seed."""
    running, warmup, steps = args.num_seqs, WARMUP_STEPS, args.steps
    block_size, num_blocks = args.block_size, args.num_blocks or DEFAULT_NUM_BLOCKS
    w = Workload(running, num_blocks, block_size, args.seed,
                 num_prompts=2 * (warmup + steps))
    times, cpu_times = [], []  # wall clock, and CPU time of this thread (robust to a busy host)
    for i in range(warmup + steps):
        t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
        w.step()
        if i >= warmup:
            times.append((time.perf_counter_ns() - t0) / 1e3)
            cpu_times.append((time.thread_time_ns() - c0) / 1e3)
    times.sort()
    stats = w.mgr.stats
    result = {
        "running": running, "steps": steps, "block_size": block_size,
        "num_blocks": num_blocks,
        "median_us": statistics.median(times), "p99_us": times[int(0.99 * len(times))],
        "mean_us": statistics.fmean(times), "median_cpu_us": statistics.median(cpu_times),
        "prefix_hit_rate": stats.hit_rate, "usage_at_end": w.mgr.usage,
    }
    print(f"KV-cache manager, one step: {running} decodes + 2 prefix-matched admissions + "
          f"2 forks + 4 frees (block size {block_size})")
    print(f"  median {result['median_us']:.0f} µs   p99 {result['p99_us']:.0f} µs   "
          f"mean {result['mean_us']:.0f} µs   (CPU time: median {result['median_cpu_us']:.0f} µs)   "
          f"over {steps} steps")
    print(f"  prefix hit rate {stats.hit_rate:.1%}, pool usage {w.mgr.usage:.1%}")
    if args.save:
        config = dict(running=running, steps=steps, warmup=warmup, block_size=block_size,
                      num_blocks=num_blocks, seed=args.seed)
        metrics = {k: v for k, v in result.items() if k not in config}
        results_io.save(args.save, args.name or f"kv_manager_block{block_size}", config=config,
                        metrics=metrics)
    return result
