"""`jaxinfer serve` as a process: it says when it is ready; SIGTERM stops accepting, ends in-flight
streams cleanly (a final chunk with a finish_reason, then [DONE]) once the grace period is over, and
the process exits 0."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys

import aiohttp

from server_harness import free_port, make_tiny_model_dir, wait_healthy


def _alive(proc: subprocess.Popen) -> None:
    assert proc.poll() is None, f"server exited early: {proc.communicate()[1][-3000:]}"


def test_sigterm_ends_streams_cleanly_and_exits_0(tmp_path):
    model_dir = make_tiny_model_dir(tmp_path / "model")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "jaxinfer.cli.main", "serve", "--model", str(model_dir),
         "--port", str(port), "--dtype", "float32", "--max-model-len", "256", "--num-blocks", "64",
         "--no-warmup", "--compilation-cache-dir", "", "--attention-backend", "reference",
         "--shutdown-grace", "0"],
        env={**os.environ, "JAX_PLATFORMS": "cpu"}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        async def scenario():
            await wait_healthy(url, lambda: _alive(proc))
            body = {"prompt": "Hello", "max_tokens": 240, "stream": True, "ignore_eos": True}
            async with aiohttp.ClientSession() as s:
                async with s.post(url + "/v1/completions", json=body) as r:
                    assert r.status == 200
                    first = await r.content.readuntil(b"\n\n")
                    proc.send_signal(signal.SIGTERM)
                    rest = await r.read()
            return first + rest

        raw = asyncio.run(scenario())
        events = raw.split(b"\n\n")
        assert events[-1] == b"" and events[-2] == b"data: [DONE]"
        last = json.loads(events[-3][len(b"data: "):])
        # No grace: the in-flight stream is aborted, and still gets its final chunk and [DONE].
        assert last["choices"][0]["finish_reason"] == "abort"
        assert proc.wait(timeout=30) == 0
        # At the default --log-level: where it listens, then (once /health answered 200) "ready".
        log = [line for line in proc.communicate()[1].splitlines() if line.startswith("INFO")]
        assert log[0].endswith(f"on {url} (OpenAI API under /v1)")
        assert log[1] == f"INFO serve.app: ready: serving on {url}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
