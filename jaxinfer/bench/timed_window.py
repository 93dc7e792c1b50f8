"""What an engine did during a benchmark's timed window, beside the figure it times: the prefix
cache's hit rate (a throughput figure whose prompts the cache already holds measures the cache,
not the workload: issue 38) and the step buckets still compiling when the window opened (their
steps run padded into a larger bucket, or wait for a compile).

    window = TimedWindow(llm.engine)
    ...timed run...
    metrics.update(window.figures("c256"))  # c256_prefix_hit_rate, c256_buckets_compiling

Prompts for a timed run come from `fresh_prompts` with a seed no warm-up used.
"""

from __future__ import annotations


def llm_engines(engine) -> list:
    """The LLMEngines inside an engine: itself, data-parallel replicas, or a disaggregated pair."""
    if hasattr(engine, "replicas"):
        return list(engine.replicas)
    if hasattr(engine, "prefill") and hasattr(engine, "decode"):
        return [engine.prefill, engine.decode]
    return [engine]


def prefix_counters(engine) -> tuple[int, int]:
    """(prompt tokens looked up in the prefix cache, of those found), summed over the engines."""
    queries = hits = 0
    for e in llm_engines(engine):
        st = e.scheduler.kv_cache_stats()[3]
        queries += st.queries
        hits += st.hits
    return queries, hits


def buckets_compiling(engine) -> int:
    """Step buckets (bucket_compiler.py units) not ready yet, over the engines."""
    left = 0
    for e in llm_engines(engine):
        compiler = e.runner.compiler
        if compiler is not None:
            left += compiler.num_units - compiler.num_ready
    return left


def fresh_prompts(vocab: int, n: int, length: int, seed: int, low: int = 3) -> list[list[int]]:
    """`n` random prompts of `length` token ids in [low, vocab); distinct seeds, distinct prompts
    (a shared first block is a 1 in vocab ** block_size chance)."""
    import numpy as np
    rng = np.random.default_rng(seed)
    return [rng.integers(low, vocab, length).tolist() for _ in range(n)]


class TimedWindow:
    """Counters at the window's start; `figures()` reads them again at its end."""

    def __init__(self, engine):
        self.engine = engine
        self.start = prefix_counters(engine)
        self.compiling = buckets_compiling(engine)

    @property
    def prefix_hit_rate(self) -> float:
        queries, hits = prefix_counters(self.engine)
        q = queries - self.start[0]
        return round((hits - self.start[1]) / q, 4) if q else 0.0

    def figures(self, prefix: str = "") -> dict:
        p = f"{prefix}_" if prefix else ""
        return {f"{p}prefix_hit_rate": self.prefix_hit_rate,
                f"{p}buckets_compiling": self.compiling}
