"""`jaxinfer serve` across two processes (jaxinfer/frontends/multihost.py): the same command on
both, joined through jax.distributed on localhost with TP = 2 over one CPU device each (gloo).
Process 0 serves HTTP; process 1 binds no port and replays process 0's request stream. Concurrent
greedy completions (one aborted mid-stream by its client) equal a single-process run's; so do
completions on a LoRA adapter given at start and on one loaded through /v1/load_lora_adapter,
sharing one slot (both processes swap it at the same step); a bad adapter is refused with a 400
and the processes serve on; unloading works. SIGINT to process 0 stops both with status 0.

The two server processes are started by a module fixture, which conftest.py's grouping keeps on
one xdist worker.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import numpy as np
import pytest

from jaxinfer.model.config import load_config
from jaxinfer.model.lora.peft import save_adapter
from lora_support import random_adapter
from server_harness import FIXTURE, free_port, make_tiny_model_dir, wait_healthy

pytestmark = pytest.mark.slow  # minutes on the CI machine: xdist starts its group first (conftest.py)

ROOT = Path(__file__).resolve().parent.parent
ENGINE_FLAGS = ["--dtype", "float32", "--max-num-seqs", "4", "--max-num-batched-tokens", "64",
                "--block-size", "16", "--max-model-len", "256",
                "--no-warmup", "--compilation-cache-dir", "", "--seed", "0",
                "--enable-lora", "--max-loras", "1", "--max-lora-rank", "8"]
MAX_TOKENS = 12
LONG = 200  # the request its client leaves mid-stream
TIMEOUT_S = 120  # (processes that disagree hang in a collective)


def _prompts() -> list[list[int]]:
    golden = np.load(FIXTURE / "golden.npz")
    return [golden[k].tolist() for k in ("greedy_prompt", "prompt_1", "prompt_2")]


@pytest.fixture(scope="module")
def two_servers(tmp_path_factory):
    root = tmp_path_factory.mktemp("multihost")
    model_dir = make_tiny_model_dir(root / "model")
    cfg = load_config(model_dir)
    # "a" is served from the start, "b" is loaded through the admin route
    adapters = {name: save_adapter(random_adapter(cfg, 4, seed, scale=0.5), cfg, root / name)
                for seed, name in ((1, "a"), (2, "b"))}
    port, coordinator = free_port(), free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu",
           # Optimization level 0: compile-bound tiny programs, as in tests/conftest.py.
           "XLA_FLAGS": "--xla_force_host_platform_device_count=1 --xla_backend_optimization_level=0",
           "JAX_DEFAULT_MATMUL_PRECISION": "highest"}
    procs = [subprocess.Popen(
        [sys.executable, "-m", "jaxinfer.cli.main", "serve", "--model", str(model_dir),
         "--port", str(port), "--shutdown-grace", "0", *ENGINE_FLAGS,
         "--tensor-parallel-size", "2", "--coordinator-address", f"127.0.0.1:{coordinator}",
         "--num-processes", "2", "--process-id", str(i),
         "--lora-modules", f"a={adapters['a']}", "--allow-runtime-lora-updating"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for i in range(2)]
    try:
        yield model_dir, adapters, f"http://127.0.0.1:{port}", procs
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def _reference(model_dir: Path, adapters: dict[str, Path]) -> list[tuple[list[int], str]]:
    """One process, one device: each prompt's greedy token ids and their text, then the first
    prompt's on adapter "a" and the second's on adapter "b"."""
    from jaxinfer import LLM, LoRARequest, SamplingParams
    llm = LLM(str(model_dir), dtype="float32", max_num_seqs=4, max_num_batched_tokens=64,
              block_size=16, max_model_len=256, warmup=False, compilation_cache_dir=None, seed=0,
              enable_lora=True, max_loras=1, max_lora_rank=8)
    prompts = _prompts()
    loras = [LoRARequest(name, i, str(adapters[name])) for i, name in enumerate("ab", 1)]
    outs = llm.generate([*prompts, *prompts[:2]], SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True), use_tqdm=False,
        lora_request=[None] * len(prompts) + loras)
    return [(list(o.outputs[0].token_ids), o.outputs[0].text) for o in outs]


async def _complete(s: aiohttp.ClientSession, url: str, prompt, stream: bool,
                    max_tokens: int = MAX_TOKENS, leave_after: int | None = None,
                    model: str | None = None):
    """(text, completion tokens) of a greedy completion (on the LoRA adapter `model` names);
    with `leave_after`, the client closes the connection after that many streamed chunks."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": stream, **({"stream_options": {"include_usage": True}} if stream else {}),
            **({"model": model} if model else {})}
    async with s.post(url + "/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        if not stream:
            got = await r.json()
            return got["choices"][0]["text"], got["usage"]["completion_tokens"]
        text, tokens, chunks = "", None, 0
        while True:
            event = (await r.content.readuntil(b"\n\n")).strip()
            if event == b"data: [DONE]":
                return text, tokens
            data = json.loads(event[len(b"data: "):])
            for c in data["choices"]:
                text += c["text"]
            if data.get("usage"):
                tokens = data["usage"]["completion_tokens"]
            chunks += 1
            if leave_after is not None and chunks >= leave_after:
                r.close()  # the client disconnects: the server aborts the request
                return text, None


async def _post(s: aiohttp.ClientSession, url: str, path: str, body: dict) -> tuple[int, str]:
    async with s.post(url + path, json=body) as r:
        return r.status, await r.text()


async def _lora_scenario(s: aiohttp.ClientSession, url: str, adapters: dict[str, Path],
                         prompts: list) -> dict:
    """Load "b" beside "a" (one slot: requests of the two take turns in it), refuse a bad adapter,
    unload "b"; "a" again after that."""
    got = {"load": await _post(s, url, "/v1/load_lora_adapter",
                               {"lora_name": "b", "lora_path": str(adapters["b"])}),
           "bad": await _post(s, url, "/v1/load_lora_adapter",
                              {"lora_name": "c", "lora_path": str(adapters["a"].parent / "nope")})}
    got["ab"] = await asyncio.gather(_complete(s, url, prompts[0], stream=True, model="a"),
                                     _complete(s, url, prompts[1], stream=False, model="b"))
    got["unload"] = await _post(s, url, "/v1/unload_lora_adapter", {"lora_name": "b"})
    got["unloaded"] = (await _post(s, url, "/v1/completions",
                                   {"prompt": prompts[1], "max_tokens": 2, "model": "b"}))[0]
    got["a_again"] = await _complete(s, url, prompts[0], stream=False, model="a")
    return got


def test_two_process_server_replays_requests_and_stops_cleanly(two_servers):
    model_dir, adapters, url, (leader, follower) = two_servers
    t0 = time.monotonic()
    *reference, ref_a, ref_b = _reference(model_dir, adapters)  # while the servers start
    prompts = _prompts()

    def alive():
        for p in (leader, follower):
            assert p.poll() is None, f"a server process exited: {p.communicate()[1][-3000:]}"

    async def scenario():
        await wait_healthy(url, alive)
        async with aiohttp.ClientSession() as s:
            first = await asyncio.gather(
                _complete(s, url, prompts[0], stream=False),
                _complete(s, url, prompts[1], stream=True),
                _complete(s, url, [5, 6, 7], stream=True, max_tokens=LONG, leave_after=2),
                _complete(s, url, prompts[2], stream=True))
            # After the abort both processes still agree: a request that runs after it.
            again = await _complete(s, url, prompts[0], stream=True)
            lora = await _lora_scenario(s, url, adapters, prompts)
        return [first[0], first[1], first[3]], again, first[2], lora

    got, again, left, lora = asyncio.run(asyncio.wait_for(scenario(), TIMEOUT_S))
    assert got == [(text, len(ids)) for ids, text in reference]
    assert again == got[0]
    assert left[1] is None and left[0]  # streamed a little, then its client left
    assert lora["load"] == (200, "Success: LoRA adapter 'b' added successfully."), lora["load"]
    assert lora["bad"][0] == 400 and "lora_path" in lora["bad"][1], lora["bad"]
    want_a, want_b = [(ref[1], len(ref[0])) for ref in (ref_a, ref_b)]
    assert lora["ab"] == [want_a, want_b]
    assert want_a != got[0] and want_b != got[1]  # the adapters change the tokens
    assert lora["unload"] == (200, "Success: LoRA adapter 'b' removed successfully.")
    assert lora["unloaded"] == 404
    assert lora["a_again"] == want_a
    leader.send_signal(signal.SIGINT)
    out = {}
    for name, p in (("leader", leader), ("follower", follower)):
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
        out[name] = p.communicate()[1]
        assert p.returncode == 0, f"{name} exited {p.returncode}: {out[name][-3000:]}"
    assert "following process 0's request stream (no HTTP here)" in out["follower"]
    assert "on http://" not in out["follower"]  # it bound no port
    replayed = re.search(r"process 0 stopped; (\d+) steps replayed", out["follower"])
    assert replayed and int(replayed[1]) > 0, out["follower"][-3000:]
    print(f"two-process serve test: {time.monotonic() - t0:.1f} s")
