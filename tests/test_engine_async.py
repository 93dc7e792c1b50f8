"""AsyncEngine: concurrent streams, validation errors before any output, aborting by leaving the
stream, shutdown with a grace period, metrics."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import generate_latest

from jaxinfer.frontends.async_engine import AsyncEngine
from jaxinfer.errors import InvalidRequestError
from jaxinfer.sampling_params import SamplingParams
from test_engine_support import make_engine, prompt_ids

# A step whose KV cache could not be donated would copy the whole cache every step.
pytestmark = pytest.mark.filterwarnings("error:Some donated buffers were not usable")

GREEDY = dict(temperature=0.0, ignore_eos=True)


async def collect(engine, prompt, params, rid):
    text, ids, last = "", [], None
    async for out in engine.generate(prompt, params, rid):
        c = out.outputs[0]
        text += c.new_text
        ids += c.new_token_ids
        last = out
    return text, ids, last


def test_streams_validation_abort_and_shutdown():
    async def main():
        engine = AsyncEngine(engine=make_engine())
        await engine.start()
        assert engine.is_ready
        # Concurrent streams; deltas add up to the final text and ids.
        results = await asyncio.gather(*[
            collect(engine, prompt_ids(i, 3 + i), SamplingParams(max_tokens=5 + i, **GREEDY), f"r{i}")
            for i in range(4)])
        for i, (text, ids, last) in enumerate(results):
            assert last.finished and ids == last.outputs[0].token_ids and len(ids) == 5 + i
            assert text == last.outputs[0].text
            assert last.num_generated_tokens == 5 + i
        # Validation errors surface on the first __anext__.
        with pytest.raises(InvalidRequestError) as e:
            await collect(engine, [], SamplingParams(), "bad")
        assert e.value.param == "prompt"
        # A duplicate request_id is rejected and does not disturb the request that owns it.
        owner = asyncio.create_task(collect(engine, prompt_ids(7, 4),
                                            SamplingParams(max_tokens=55, **GREEDY), "dup"))
        await asyncio.sleep(0.01)
        with pytest.raises(InvalidRequestError) as e:
            await collect(engine, prompt_ids(7, 4), SamplingParams(max_tokens=3), "dup")
        assert e.value.param == "request_id"
        _, ids, last = await owner
        assert last.outputs[0].finish_reason == "length" and len(ids) == 55
        # Leaving the stream early (break, or cancelling the consuming task) aborts the request
        # and frees its blocks.
        async for _ in engine.generate(prompt_ids(9, 6), SamplingParams(max_tokens=50, **GREEDY),
                                       "leave"):
            break
        started = asyncio.Event()
        seen = []

        async def consume():
            async for out in engine.generate(prompt_ids(8, 6),
                                             SamplingParams(max_tokens=50, **GREEDY), "cancel"):
                seen.append(out)
                started.set()
                await asyncio.sleep(10)  # a slow client

        consumer = asyncio.create_task(consume())
        await started.wait()
        consumer.cancel()
        for _ in range(200):
            if engine.engine.scheduler.kv.num_free_blocks == engine.num_total_blocks \
                    and not engine.engine.requests:
                break
            await asyncio.sleep(0.02)
        assert engine.engine.scheduler.kv.num_free_blocks == engine.num_total_blocks
        assert not engine.engine.requests
        assert len(seen) == 1 and not seen[0].finished
        # Shutdown without grace aborts what is still running: its stream ends with "abort".
        long = asyncio.create_task(collect(engine, prompt_ids(10, 4),
                                           SamplingParams(max_tokens=60, **GREEDY), "long"))
        await asyncio.sleep(0.05)
        await engine.shutdown(grace_s=0)
        _, _, last = await asyncio.wait_for(long, 10)
        assert last.finished and last.outputs[0].finish_reason in ("abort", "length")
        assert engine.errored is None
        metrics = generate_latest(engine.metrics.registry).decode()
        assert 'jaxinfer:generation_tokens_total{model_name="tiny"}' in metrics
        assert "jaxinfer:time_to_first_token_seconds_bucket" in metrics
    asyncio.run(main())
