"""frontends/output_stream.OutputStream and core/outputs.merge_outputs: a consumer that fell
behind takes the outputs queued up as one, deltas joined and everything cumulative from the
last; an exception is never merged; through the engine, a lagging stream's deltas still add up
to the request's text, ids and logprobs, in fewer outputs."""

from __future__ import annotations

import asyncio

import numpy as np

from jaxinfer.core.outputs import CompletionOutput, IdsSoFar, RequestOutput, merge_outputs
from jaxinfer.core.sampled_logprobs import SampledLogprobs
from jaxinfer.errors import RequestFailedError
from jaxinfer.frontends.async_engine import AsyncEngine
from jaxinfer.frontends.output_stream import OutputStream
from jaxinfer.sampling_params import SamplingParams
from test_engine_support import make_engine, prompt_ids


def _out(ids: list[int], upto: int, new: int, choices=(0,), finish=None) -> RequestOutput:
    outs = [CompletionOutput(i, "t" * upto, IdsSoFar(ids[:upto]), "t" * new, ids[upto - new:upto],
                             None, finish, None) for i in choices]
    return RequestOutput("r", [1], outs, finish is not None, 1, upto * len(choices))


def test_merge_joins_deltas_and_keeps_the_later_totals():
    ids = list(range(10, 20))
    a, b = _out(ids, 3, 3, choices=(0, 1)), _out(ids, 5, 2, choices=(1,), finish="length")
    m = merge_outputs(a, b)
    assert [c.index for c in m.outputs] == [0, 1] and m.finished and m.num_generated_tokens == 5
    zero, one = m.outputs
    assert zero is a.outputs[0]  # unchanged since the first
    assert one.new_text == "ttttt" and one.new_token_ids == ids[:5] and one.token_ids == ids[:5]
    assert one.finish_reason == "length"


def test_logprob_views_of_one_store_join_into_one_view():
    store = SampledLogprobs(1)
    for t in range(4):
        store.append(t, -float(t), [t], [-float(t)])
    first, later = store.view(0, 2), store.view(2, 4)
    joined = first.followed_by(later)
    assert joined is not None and list(joined) == [*first, *later]
    assert first.followed_by(store.view(3, 4)) is None


def test_stream_merges_what_queued_and_never_an_exception():
    async def main():
        ids = list(range(10))
        s = OutputStream()
        for upto in (1, 2, 3):
            s.put_nowait(_out(ids, upto, 1))
        error = RequestFailedError("boom")
        s.put_nowait(error)
        s.put_nowait(_out(ids, 4, 1))
        merged = await s.get()
        assert merged.outputs[0].new_token_ids == [0, 1, 2] and merged.num_generated_tokens == 3
        assert await s.get() is error
        assert (await s.get()).outputs[0].new_token_ids == [3]
        s.put_nowait(_out(ids, 5, 1, finish="stop"))
        s.put_nowait(_out(ids, 6, 1))  # (never after a finish; still: a finished one stays apart)
        assert (await s.get()).finished and not (await s.get()).finished

    asyncio.run(main())


def test_a_lagging_consumer_gets_every_token_in_fewer_outputs():
    async def main():
        engine = AsyncEngine(engine=make_engine())
        await engine.start()
        try:
            params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2)
            runs = {}
            for lag in (0.0, 0.05):
                outs, ids, lps = 0, [], []
                async for out in engine.generate(prompt_ids(3, 5), params, f"lag{lag}"):
                    c = out.outputs[0]
                    outs, ids, lps = outs + 1, ids + list(c.new_token_ids), lps + list(c.new_logprobs)
                    last = c
                    await asyncio.sleep(lag)  # a busy server
                assert ids == list(last.token_ids) and len(ids) == 24
                assert [e.token_id for e in lps] == ids and list(last.logprobs) == lps
                runs[lag] = outs, ids, [e.logprob for e in lps]
            (fast_n, fast_ids, fast_lp), (slow_n, slow_ids, slow_lp) = runs[0.0], runs[0.05]
            assert slow_ids == fast_ids and np.allclose(slow_lp, fast_lp)
            assert slow_n < fast_n
        finally:
            await engine.shutdown()

    asyncio.run(main())
