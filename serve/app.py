"""The aiohttp application: routes, middlewares, engine start-up and graceful shutdown.

Lifecycle: the socket is bound first and the engine warms up (compiles) in the background, so
`/health` answers 503 until it is ready. On SIGINT/SIGTERM the server stops accepting connections,
gives in-flight requests `--shutdown-grace` seconds to finish, aborts the rest (their streams end with
`finish_reason: "abort"` and `[DONE]`), and returns so the process exits 0. If the engine loop dies
(a device failure; one request's failure only fails that request), it returns 1 instead: a process
that can no longer serve exits, so a supervisor restarts it.

Every request-size limit and connection timeout is a flag (serve/limits.py, serve/connections.py).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal

from aiohttp import web

from serve import chat, completions, info
from serve.app_keys import (ALLOW_LORA_UPDATES, BODY_TIMEOUT, CREATED, ENGINE,
                            MAX_REQUEST_BYTES, MAX_WAITING, OWNS_ENGINE, SHUTDOWN_GRACE)
from serve.auth import make_auth_middleware
from serve.choices import now
from serve.connections import (DEFAULT_BODY_TIMEOUT_S, DEFAULT_HEADER_TIMEOUT_S,
                               DEFAULT_KEEPALIVE_TIMEOUT_S, GuardedTCPSite)
from serve.embeddings import EMBEDDINGS, add_embedding_args, create_embedding, embeddings_config
from serve.engine_requests import LIFECYCLE, Lifecycle
from serve.errors import error_middleware
from serve.http_metrics import SERVER_METRICS, ServerMetrics, get_metrics, make_metrics_middleware
from serve.json_body import BODY_PARSER, BodyParser, give_large_buffers_back, max_json_items
from serve.lora_routes import add_lora_routes, add_lora_server_args
from serve.limits import LIMITS, RequestLimits, add_limit_args, check_limit_args
from serve.reasoning.request import REASONING_PARSER, add_reasoning_args, parser_from_args
from serve.responses import handlers as responses
from serve.responses.store import RESPONSE_STORE, ResponseStore, add_store_args, check_store_args
from serve.tools import TOOL_OPTIONS, ToolOptions, add_tool_args, check_tool_args

logger = logging.getLogger(__name__)

# A 128k-token prompt sent as JSON token ids is about 1 MB; leave room for batches of them.
DEFAULT_MAX_REQUEST_BYTES = 32 * 1024 * 1024
DEFAULT_MAX_WAITING = 1024
DEFAULT_SHUTDOWN_GRACE_S = 10.0


def add_server_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("HTTP server")
    g.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default: %(default)s, loopback only; 0.0.0.0 for all)")
    g.add_argument("--port", type=int, default=8000, help="port to bind (default: %(default)s)")
    # The environment variable keeps the key out of `ps` output, as VLLM_API_KEY does for vLLM.
    g.add_argument("--api-key", default=os.environ.get("JAXINFER_API_KEY"),
                   help="require 'Authorization: Bearer <key>' on every API route "
                        "(default: $JAXINFER_API_KEY; unset = no authentication)")
    g.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                   help="largest request body accepted; larger ones get 413 (default: %(default)s)")
    g.add_argument("--max-waiting", type=int, default=DEFAULT_MAX_WAITING,
                   help="most sequences waiting for the engine: a request whose n x prompts would pass "
                        "it gets 503 + Retry-After, whole (default: %(default)s)")
    g.add_argument("--shutdown-grace", type=float, default=DEFAULT_SHUTDOWN_GRACE_S,
                   help="seconds in-flight requests may finish after SIGINT/SIGTERM before they are "
                        "aborted (default: %(default)s)")
    g.add_argument("--header-timeout", type=float, default=DEFAULT_HEADER_TIMEOUT_S,
                   help="seconds a client may take to send a request's headers once it started; "
                        "slower connections are closed (default: %(default)s)")
    g.add_argument("--body-timeout", type=float, default=DEFAULT_BODY_TIMEOUT_S,
                   help="seconds a client may take to send a request body; slower ones get 408 "
                        "(default: %(default)s)")
    g.add_argument("--keepalive-timeout", type=float, default=DEFAULT_KEEPALIVE_TIMEOUT_S,
                   help="seconds an idle keep-alive connection stays open (default: %(default)s)")
    g.add_argument("--engine-core", choices=("process", "in-process"), default="process",
                   help="where the engine core (scheduler, device steps) runs: its own process, so "
                        "HTTP, tokenizing and streaming never hold up a step, or this one, for "
                        "debugging and comparison (default: %(default)s; docs/engine_core.md)")
    add_limit_args(g)
    add_lora_server_args(g)
    add_tool_args(parser.add_argument_group("tool calling"))
    add_reasoning_args(parser.add_argument_group("reasoning"))
    add_store_args(parser.add_argument_group("Responses API"))
    add_embedding_args(parser.add_argument_group("embeddings"))


def check_server_args(args: argparse.Namespace) -> None:
    for name in ("max_request_bytes", "max_waiting"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.shutdown_grace < 0:
        raise ValueError(f"--shutdown-grace must be >= 0, got {args.shutdown_grace}")
    for name in ("header_timeout", "body_timeout", "keepalive_timeout"):
        if not getattr(args, name) > 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    check_limit_args(args)
    check_tool_args(args)
    check_store_args(args)
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")


def check_port_free(host: str, port: int) -> None:
    """Refuse a port another process holds before the model loads (minutes), in one line. (A
    race with a process that binds it meanwhile still fails at start-up.)"""
    import socket
    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as e:
        raise ValueError(f"--host {host}: {e}") from None
    family, _, _, _, address = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server binds it
        try:
            sock.bind(address)
        except OSError as e:
            raise ValueError(f"cannot serve on {host}:{port}: {e.strerror or e} "
                             f"(choose another --port)") from None


async def _start_engine(app: web.Application) -> None:
    engine = app[ENGINE]
    if engine.is_ready:  # started by the caller (tests share one warmed-up engine)
        return
    task = asyncio.create_task(engine.start(), name="engine-start")
    task.add_done_callback(_log_start_failure)
    app[LIFECYCLE].engine_start = task


def _log_ready(start: asyncio.Task, url: str) -> None:
    """The moment /health turns 200: the engine's start has returned."""
    if not start.cancelled() and start.exception() is None:
        logger.info("ready: serving on %s", url)


def _log_start_failure(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.error("engine failed to start: %r", task.exception())


async def _stop_engine(app: web.Application) -> None:
    """on_shutdown: runs after the listening sockets closed, before aiohttp waits for handlers."""
    life = app[LIFECYCLE]
    life.shutting_down = True
    start = life.engine_start
    if start is not None and not start.done():
        start.cancel()
    if app[OWNS_ENGINE]:
        await app[ENGINE].shutdown(grace_s=app[SHUTDOWN_GRACE])


async def _close_body_parser(app: web.Application) -> None:
    app[BODY_PARSER].close()


def create_app(engine, args: argparse.Namespace, owns_engine: bool = True) -> web.Application:
    """The application for `engine`. With owns_engine=False the caller starts and shuts the engine
    down itself (several apps over one engine, as in tests)."""
    give_large_buffers_back()  # RSS returns to where it was after a 30 MB request body
    server_metrics = ServerMetrics(engine.model_name)
    middlewares = [make_metrics_middleware(server_metrics), error_middleware]
    if args.api_key:
        middlewares.append(make_auth_middleware(args.api_key))
    app = web.Application(client_max_size=args.max_request_bytes, middlewares=middlewares)
    app[ENGINE] = engine
    app[SERVER_METRICS] = server_metrics
    app[MAX_WAITING] = args.max_waiting
    app[MAX_REQUEST_BYTES] = args.max_request_bytes
    app[SHUTDOWN_GRACE] = args.shutdown_grace
    limits = RequestLimits.from_args(args)
    app[LIMITS] = limits
    app[TOOL_OPTIONS] = ToolOptions.from_args(args)
    app[REASONING_PARSER] = parser_from_args(args)
    app[EMBEDDINGS] = embeddings_config(args, engine.config.model.model)
    app[RESPONSE_STORE] = ResponseStore.from_args(args)
    app[BODY_TIMEOUT] = getattr(args, "body_timeout", DEFAULT_BODY_TIMEOUT_S)
    app[BODY_PARSER] = BodyParser(max_json_items(limits.max_prompts_per_request,
                                                 engine.max_model_len))
    app[OWNS_ENGINE] = owns_engine
    app[LIFECYCLE] = Lifecycle()
    app[CREATED] = now()
    app[ALLOW_LORA_UPDATES] = getattr(args, "allow_runtime_lora_updating", False)
    app.router.add_post("/v1/completions", completions.create_completion)
    app.router.add_post("/v1/chat/completions", chat.create_chat_completion)
    app.router.add_post("/v1/responses", responses.create_response)
    app.router.add_get("/v1/responses/{response_id}", responses.get_response)
    app.router.add_delete("/v1/responses/{response_id}", responses.delete_response)
    app.router.add_post("/v1/embeddings", create_embedding)
    app.router.add_get("/v1/models", info.list_models)
    add_lora_routes(app)
    app.router.add_get("/health", info.health)
    app.router.add_get("/ping", info.health)
    app.router.add_get("/version", info.get_version)
    app.router.add_get("/metrics", get_metrics)
    app.router.add_post("/tokenize", info.tokenize)
    app.router.add_post("/detokenize", info.detokenize)
    app.on_startup.append(_start_engine)
    app.on_shutdown.append(_stop_engine)
    app.on_cleanup.append(_close_body_parser)
    return app


class Server:
    """The app bound to a socket. `handler_cancellation` makes aiohttp cancel a handler whose client
    disconnected, which is what aborts its engine requests mid-prefill or mid-decode."""

    def __init__(self, app: web.Application, host: str, port: int, shutdown_grace: float,
                 header_timeout: float = DEFAULT_HEADER_TIMEOUT_S,
                 keepalive_timeout: float = DEFAULT_KEEPALIVE_TIMEOUT_S):
        self.app = app
        self.host, self.port = host, port
        self.header_timeout = header_timeout
        self._runner = web.AppRunner(app, handler_cancellation=True, keepalive_timeout=keepalive_timeout,
                                     shutdown_timeout=shutdown_grace + 5.0)

    async def start(self) -> None:
        await self._runner.setup()
        site = GuardedTCPSite(self._runner, self.host, self.port, header_timeout=self.header_timeout)
        await site.start()
        self.port = self._runner.addresses[0][1]  # the real port when 0 was asked for
        url = f"http://{self.host}:{self.port}"
        logger.info("serving %s on %s (OpenAI API under /v1)", self.app[ENGINE].model_name, url)
        start = self.app[LIFECYCLE].engine_start
        if start is not None:  # None: the caller started the engine (tests share one)
            start.add_done_callback(lambda task: _log_ready(task, url))

    async def stop(self) -> None:
        """Stop accepting, let in-flight requests finish within the grace period, abort the rest."""
        await self._runner.cleanup()


def server_for(app: web.Application, args: argparse.Namespace) -> Server:
    return Server(app, args.host, args.port, args.shutdown_grace,
                  getattr(args, "header_timeout", DEFAULT_HEADER_TIMEOUT_S),
                  getattr(args, "keepalive_timeout", DEFAULT_KEEPALIVE_TIMEOUT_S))


async def _engine_died(engine) -> None:
    while engine.dead is None:  # start() (in the background) creates the event
        await asyncio.sleep(0.1)
    await engine.dead.wait()


async def serve_until_signal(engine, args: argparse.Namespace) -> int:
    """Serve until SIGINT/SIGTERM (returns 0) or until the engine loop dies (returns 1)."""
    server = server_for(create_app(engine, args), args)
    await server.start()
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    signalled = asyncio.create_task(stop.wait())
    died = asyncio.create_task(_engine_died(engine))
    await asyncio.wait([signalled, died], return_when=asyncio.FIRST_COMPLETED)
    status = 0
    if died.done():
        logger.error("the engine loop died (%r): exiting with status 1 so that a supervisor restarts "
                     "the server", engine.errored)
        status = 1
    else:
        logger.info("shutting down: finishing in-flight requests (up to %.1f s)", args.shutdown_grace)
    signalled.cancel()
    died.cancel()
    for sig in (signal.SIGINT, signal.SIGTERM):  # a second Ctrl-C interrupts the grace period
        loop.remove_signal_handler(sig)
    await server.stop()
    return status
