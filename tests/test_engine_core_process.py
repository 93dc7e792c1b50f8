"""The engine-core process's life as the server sees it: a core killed mid-stream gives the open
stream an error event and makes the server exit non-zero (a supervisor restarts it), never an
endless 503; a request the core refuses is a 400 naming the field; a stop string found in the
server process frees the request's blocks in the core."""

from __future__ import annotations

import asyncio
import json
import os
import signal

import aiohttp

from server_harness import free_port, make_tiny_model_dir, server_args, tiny_engine_args, wait_healthy


def test_killing_the_core_mid_stream_errors_the_stream_and_exits_nonzero(tmp_path):
    from jaxinfer.frontends.core_client import CoreProcessEngine
    from serve.app import serve_until_signal

    engine = CoreProcessEngine(tiny_engine_args(make_tiny_model_dir(tmp_path / "model")))
    args = server_args(port=free_port(), shutdown_grace=0.0)
    url = f"http://127.0.0.1:{args.port}"

    async def scenario():
        serving = asyncio.create_task(serve_until_signal(engine, args))

        def alive():
            assert not serving.done(), serving

        await wait_healthy(url, alive)
        events = []
        async with aiohttp.ClientSession() as s:
            # a refusal by the core's own validation: the client's 400, the core goes on
            async with s.post(url + "/v1/completions",
                              json={"prompt": [5, 6, 7], "max_tokens": 4, "n": 17}) as r:
                refused = r.status, await r.json()
            body = {"prompt": [5, 6, 7], "max_tokens": 200, "ignore_eos": True, "stream": True}
            async with s.post(url + "/v1/completions", json=body) as r:
                assert r.status == 200
                async for line in r.content:
                    if line.startswith(b"data: "):
                        events.append(line[6:].strip())
                        if len(events) == 2:
                            os.kill(engine.cores.procs[0].pid, signal.SIGKILL)
        return refused, events, await asyncio.wait_for(serving, 60)

    (status, refusal), events, exit_status = asyncio.run(scenario())
    assert status == 400 and refusal["error"]["param"] == "n", refusal
    assert exit_status == 1
    assert events[-1] == b"[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == 503 and "engine-core process died" in error["message"], error
    assert engine.errored is not None and engine.cores.procs[0].returncode == -signal.SIGKILL


def test_a_stop_string_found_in_the_server_frees_the_request_in_the_core(tmp_path):
    from jaxinfer.frontends.core_client import CoreProcessEngine
    from jaxinfer.sampling_params import SamplingParams

    engine = CoreProcessEngine(tiny_engine_args(make_tiny_model_dir(tmp_path / "model")))

    async def scenario():
        await engine.start()
        try:
            greedy = dict(max_tokens=40, temperature=0.0, ignore_eos=True)
            text = ""
            async for out in engine.generate([5, 6, 7], SamplingParams(**greedy), "full"):
                text += out.outputs[0].new_text
            stop = text[len(text) // 2:][:2]  # certainly in the text, well before its end
            outs = [o async for o in engine.generate([5, 6, 7], SamplingParams(**greedy, stop=[stop]),
                                                      "stopped")]
            await asyncio.sleep(0.2)  # the finish_choice call reaches the core
            return text, stop, outs, await engine.call("kv_pool_state"), \
                await engine.call("live_request_ids")
        finally:
            await engine.shutdown()

    text, stop, outs, (free, total, holders), live = asyncio.run(scenario())
    last = outs[-1].outputs[0]
    assert (last.finish_reason, last.stop_reason) == ("stop", stop)
    assert text.startswith(last.text) and stop not in last.text and len(last.token_ids) < 40
    assert free == total and not holders and not live


def test_data_parallel_replicas_are_core_processes_of_their_own(tmp_path):
    """--data-parallel-size 2: two core processes, requests spread over both, /metrics summed over
    them, and greedy tokens equal to one in-process engine's."""
    from jaxinfer.frontends.server_engine import create_server_engine
    from jaxinfer.sampling_params import SamplingParams
    model_dir = make_tiny_model_dir(tmp_path / "model")
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)

    async def run(mode: str, dp: int):
        args = tiny_engine_args(model_dir)
        args.data_parallel_size = dp
        engine = create_server_engine(args, mode)
        await engine.start()

        async def one(i):
            return [t async for o in engine.generate([5, 6, 7 + i], greedy, f"r{i}")
                    for t in o.outputs[0].new_token_ids]
        try:
            tokens = await asyncio.gather(*(one(i) for i in range(6)))
            if mode == "in-process":
                return tokens, None
            per_core = [await engine.call("metrics_text", core=c) for c in range(dp)]
            return tokens, (per_core, await engine.metrics_text(), engine.num_total_blocks)
        finally:
            await engine.shutdown()

    tokens, (per_core, merged, blocks) = asyncio.run(run("process", 2))
    expected, _ = asyncio.run(run("in-process", 1))
    assert tokens == expected
    generated = [_sample(text, "jaxinfer:generation_tokens_total") for text in per_core]
    assert all(g > 0 for g in generated) and sum(generated) == 60, generated
    assert _sample(merged, "jaxinfer:generation_tokens_total") == 60
    steps = [_sample(text, "jaxinfer:engine_steps_total") for text in per_core]
    assert all(n > 0 for n in steps) and _sample(merged, "jaxinfer:engine_steps_total") == sum(steps)
    assert blocks == 2 * tiny_engine_args(model_dir).num_blocks


def _sample(text: bytes, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families
    return sum(s.value for f in text_string_to_metric_families(text.decode()) for s in f.samples
               if s.name == name)


def test_a_core_that_cannot_load_raises_the_engines_own_error(tmp_path):
    """The server process raises what the core's engine raised (as `--engine-core in-process`
    would), and no core process is left behind."""
    import pytest

    from jaxinfer.errors import ConfigError
    from jaxinfer.frontends.core_processes import CoreProcesses
    args = tiny_engine_args(make_tiny_model_dir(tmp_path / "model"))
    args.max_model_len = 100_000
    cores = CoreProcesses(args)
    try:
        with pytest.raises(ConfigError, match="exceeds the model's max_position_embeddings 256"):
            cores.wait_loaded()
    finally:
        cores.close()
    assert all(p.returncode == 1 for p in cores.procs)
