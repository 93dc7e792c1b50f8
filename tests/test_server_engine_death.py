"""A failure that does kill the engine loop (the device's results lost) makes the server exit non-zero,
so that a supervisor restarts it, instead of answering 503 forever. Runs `serve_until_signal` (what
`jaxinfer serve` runs) on its own tiny engine, with the step's result fetch made to fail."""

from __future__ import annotations

import asyncio

import aiohttp

from server_harness import MODEL, free_port, make_tiny_model_dir, server_args, wait_healthy


def test_engine_death_exits_nonzero(tmp_path):
    from jaxinfer.engine.args import EngineArgs
    from jaxinfer.frontends.async_engine import AsyncEngine
    from serve.app import serve_until_signal

    model_dir = make_tiny_model_dir(tmp_path / "model")
    engine = AsyncEngine(EngineArgs(model=str(model_dir), served_model_name=MODEL, dtype="float32",
                                    max_model_len=256, block_size=16, num_blocks=64, max_num_seqs=4,
                                    max_num_batched_tokens=64, compilation_cache_dir="",
                                    attention_backend="reference", warmup=False))

    def device_lost(handle):
        raise RuntimeError("injected: device lost (XlaRuntimeError)")

    engine.engine.outputs.process = device_lost
    args = server_args(port=free_port(), shutdown_grace=0.0)
    url = f"http://127.0.0.1:{args.port}"

    async def scenario():
        serving = asyncio.create_task(serve_until_signal(engine, args))
        def alive():
            assert not serving.done(), serving

        await wait_healthy(url, alive)
        async with aiohttp.ClientSession() as s:
            async with s.post(url + "/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 4}) as r:
                status, body = r.status, await r.json()
        return status, body, await asyncio.wait_for(serving, 60)

    status, body, exit_status = asyncio.run(scenario())
    assert status == 503 and "device lost" in body["error"]["message"], body
    assert exit_status == 1
    assert engine.errored is not None  # (`jaxinfer serve` exits with serve_until_signal's status)
