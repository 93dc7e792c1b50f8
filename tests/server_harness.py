"""Test harness for the server: a tiny random-weight llama (the HF-parity fixture's weights) with a
byte-level BPE tokenizer trained in-process, served by the real AsyncEngine + aiohttp app on its own
event loop in a background thread. Tests talk to it over loopback, as any client would.

`start_shared_server` builds the one server that test_server_api.py and test_server_faults.py share
(the session-scoped `server` fixture in conftest.py); the helpers below read its KV pool and /metrics."""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import socket
import threading
import time
from pathlib import Path

import aiohttp
from prometheus_client.parser import text_string_to_metric_families
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

FIXTURE = Path(__file__).parent / "fixtures" / "models" / "llama"
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")
CORPUS = ("The quick brown fox jumps over the lazy dog. Once upon a time there was a little robot who "
          "liked to count numbers: one two three four five six seven eight nine ten. Hello world! "
          "Serving language models over HTTP with streaming responses and paged attention caches.")

# The shared test server's flags.
MODEL = "tiny-llama"
MAX_MODEL_LEN = 256
API_KEY = "sk-test-key"
NO_EOS = {"ignore_eos": True}  # random weights may sample EOS; fixed lengths keep counts exact


def make_tiny_model_dir(out: Path) -> Path:
    """The fixture llama (vocab 384, bos/eos/pad 383/382/381, 256 positions) plus a tokenizer whose
    ids line up with it: 381 learned tokens, then <pad>, <|im_end|> (EOS), <s>."""
    out.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copy(FIXTURE / name, out / name)
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=381, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator([CORPUS] * 10, trainer)
    tok.add_special_tokens(["<pad>", "<|im_end|>", "<s>"])
    assert tok.token_to_id("<|im_end|>") == 382, "tokenizer ids must line up with the model's EOS"
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "bos_token": None, "add_bos_token": False,
         "chat_template": CHAT_TEMPLATE}))
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_args(**overrides) -> argparse.Namespace:
    """The server's flags at their defaults (as `jaxinfer serve` parses them), loopback on a free port."""
    from serve.app import add_server_args
    parser = argparse.ArgumentParser()
    add_server_args(parser)
    ns = vars(parser.parse_args([]))
    ns.update(port=0, api_key=None, max_waiting=1024, shutdown_grace=1.0)
    ns.update(overrides)
    return argparse.Namespace(**ns)


class ServerThread:
    """One engine, several apps over it (each its own port and flags), on a private event loop.
    `engine_core`: as `jaxinfer serve --engine-core`; "process" (the default, as served) unless a
    test reaches into the engine's objects."""

    def __init__(self, engine_args, app_args: dict[str, argparse.Namespace],
                 engine_core: str = "process"):
        self.engine_args = engine_args
        self.engine_core = engine_core
        self.app_args = app_args
        self.loop = asyncio.new_event_loop()
        self.urls: dict[str, str] = {}
        self.apps: dict = {}  # name -> its aiohttp Application
        self.engine = None
        self._servers = []
        self._thread = threading.Thread(target=self.loop.run_forever, name="test-server", daemon=True)

    def start(self) -> "ServerThread":
        self._thread.start()
        self.call(self._start(), timeout=600)
        return self

    def call(self, coro, timeout: float = 60):
        """Run a coroutine on the server's loop (e.g. to read engine state without racing it)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _start(self) -> None:
        from jaxinfer.frontends.server_engine import create_server_engine
        from serve.app import create_app, server_for
        self.engine = create_server_engine(self.engine_args, self.engine_core)
        await self.engine.start()
        for name, args in self.app_args.items():
            self.apps[name] = create_app(self.engine, args, owns_engine=False)
            server = server_for(self.apps[name], args)
            await server.start()
            self._servers.append(server)
            self.urls[name] = f"http://127.0.0.1:{server.port}"

    async def _stop(self) -> None:
        for server in self._servers:
            await server.stop()
        await self.engine.shutdown()

    def stop(self) -> None:
        try:
            self.call(self._stop(), timeout=60)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=10)


def tiny_engine_args(model_dir: Path):
    """The shared server's engine flags."""
    from jaxinfer.engine.args import EngineArgs
    # Small batches keep the CPU compile count low (shapes compile lazily, warm-up off); 64 concurrent
    # streams then also exercise the waiting queue.
    return EngineArgs(model=str(model_dir), served_model_name=MODEL, dtype="float32",
                      max_model_len=MAX_MODEL_LEN, block_size=16, num_blocks=256, max_num_seqs=16,
                      max_num_batched_tokens=64, compilation_cache_dir="",
                      attention_backend="reference", warmup=False)


def start_shared_server(model_dir: Path, engine_core: str = "process") -> ServerThread:
    """The tiny model served twice over one engine: "main" with default flags, "strict" with auth, a
    small body limit and no waiting queue."""
    make_tiny_model_dir(model_dir)
    return ServerThread(tiny_engine_args(model_dir), {
        "main": server_args(),
        "strict": server_args(api_key=API_KEY, max_request_bytes=2048, max_waiting=0),
    }, engine_core).start()


DEMO = Path(__file__).parents[1] / "checkpoints" / "demo-target"
# The demo model's engine flags for tests that need real text (structured output, tool calls): small
# buckets, compiled lazily.
DEMO_ENGINE = dict(dtype="float32", max_model_len=256, block_size=16, num_blocks=1024, max_num_seqs=64,
                   max_num_batched_tokens=512, compilation_cache_dir="", warmup=False,
                   attention_backend="reference")


def start_demo_server() -> ServerThread:
    """The demo model served three times over one engine: "main" with default flags, "hermes" and
    "llama3_json" with --enable-auto-tool-choice and that --tool-call-parser."""
    from jaxinfer.engine.args import EngineArgs
    return ServerThread(EngineArgs(model=str(DEMO), **DEMO_ENGINE), {
        "main": server_args(),
        **{parser: server_args(enable_auto_tool_choice=True, tool_call_parser=parser)
           for parser in ("hermes", "llama3_json")},
    }).start()


# ---- reading the server's state ------------------------------------------------------------------

def kv_pool_state(server: ServerThread) -> tuple[int, int, list]:
    """(free blocks, blocks, request ids holding blocks), read between the engine's steps."""
    async def read():
        if hasattr(server.engine, "call"):  # the engine-core process: an admin call
            return await server.engine.call("kv_pool_state")
        m = server.engine.engine.scheduler.kv
        return m.num_free_blocks, m.num_blocks, m.request_ids()
    return tuple(server.call(read()))


def wait_pool_free(server: ServerThread, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        free, total, live = kv_pool_state(server)
        if free == total and not live:
            return
        assert time.monotonic() < deadline, f"KV pool not freed: {free}/{total} free, live requests {live}"
        time.sleep(0.05)


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    async def get():
        async with aiohttp.ClientSession() as s:
            async with s.get(url + "/metrics") as r:
                assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
                return await r.text()
    samples = {}
    for family in text_string_to_metric_families(asyncio.run(get())):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def metric(samples, name: str, **labels) -> float:
    return sum(v for (n, ls), v in samples.items() if n == name and all(dict(ls).get(k) == v2
                                                                        for k, v2 in labels.items()))


def metric_delta(before, after, name: str, **labels) -> float:
    return metric(after, name, **labels) - metric(before, name, **labels)


def add_app(server: ServerThread, name: str, **flags) -> str:
    """Serve another app (its own flags and port) over the shared server's engine; returns its URL."""
    from serve.app import create_app, server_for
    args = server_args(**flags)

    async def start():
        srv = server_for(create_app(server.engine, args, owns_engine=False), args)
        await srv.start()
        server._servers.append(srv)
        return f"http://127.0.0.1:{srv.port}"
    server.urls[name] = server.call(start())
    return server.urls[name]


def post_raw(url: str, path: str, data: bytes, timeout: float = 120) -> tuple[int, dict, bytes]:
    """One POST with a raw JSON body (any bytes: big integers, lone-surrogate escapes, deep nesting)."""
    import http.client
    from urllib.parse import urlsplit
    u = urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    try:
        conn.request("POST", path, body=data, headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, dict(r.getheaders()), r.read()
    finally:
        conn.close()


def check_error_shape(raw: bytes, status: int, param=None) -> dict:
    """An OpenAI-shaped error body: {"error": {"message", "type", "param", "code"}}."""
    error = json.loads(raw)["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["code"] == status and isinstance(error["type"], str) and error["message"], error
    if param is not None:
        assert error["param"] == param, error
    return error


def raw_json(obj) -> bytes:
    return json.dumps(obj).encode()  # big ints as digits, lone surrogates as \\ud800 escapes


def health_ok(url: str) -> None:
    import urllib.request

    with urllib.request.urlopen(url + "/health", timeout=10) as r:
        assert r.status == 200


def completion_text(url: str, **extra) -> str:
    body = {"model": MODEL, "prompt": "Hello world", "max_tokens": 6, "temperature": 0, **NO_EOS, **extra}
    status, _, raw = post_raw(url, "/v1/completions", raw_json(body))
    assert status == 200, raw
    return json.loads(raw)["choices"][0]["text"]


async def wait_healthy(url: str, check_alive, timeout: float = 120.0) -> None:
    """Poll `url`/health until it answers 200; `check_alive()` asserts, before each poll, that the
    server being waited for has not exited."""
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            check_alive()
            try:
                async with s.get(url + "/health") as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientConnectionError:
                pass
            await asyncio.sleep(0.2)
    raise AssertionError("server did not become healthy")
