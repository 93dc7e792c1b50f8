"""Benchmarks never time prompts their own warm-up put in the prefix cache (issue 38): the shared
throughput helper, at tiny shapes on the CPU, reports the timed window's prefix-cache hit rate,
which is 0 for its random (non-reuse) workload."""

from __future__ import annotations

from jaxinfer.bench.suites.multi_gpu import _throughput
from jaxinfer.bench.timed_window import TimedWindow
from jaxinfer.frontends.llm import LLM
from jaxinfer.sampling_params import SamplingParams
from test_engine_support import make_engine


def test_throughput_times_prompts_the_warm_up_did_not_cache():
    llm = LLM(engine=make_engine())
    out = _throughput(llm, 2, 2, "c2", in_len=8, out_len=2)
    assert out["c2_out_tok_s"] > 0
    assert out["c2_prefix_hit_rate"] == 0.0 and out["c2_buckets_compiling"] == 0
    # The window does see reuse: the same prompts again are all but their last block cached.
    prompts = [[5 + i] * 8 for i in range(2)]
    params = SamplingParams(max_tokens=2, ignore_eos=True, temperature=0)  # (1: finishes uncached)
    llm.generate(prompts, params, use_tqdm=False)
    window = TimedWindow(llm.engine)
    llm.generate(prompts, params, use_tqdm=False)
    assert window.prefix_hit_rate == 0.5  # 4 of 8 tokens: the last block is always computed
