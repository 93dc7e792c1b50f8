"""`jaxinfer serve`: the OpenAI-compatible HTTP server (serve/) over an engine-core process
(--engine-core process, the default) or an in-process AsyncEngine.

Multi-host: the same command runs on every host with its own --process-id. Process 0 serves HTTP
and publishes its request stream; every other process builds the same engine, binds no port and
replays that stream (jaxinfer/frontends/multihost.py) until process 0 shuts down."""

from __future__ import annotations

import argparse
import asyncio


def add_parser(sub: argparse._SubParsersAction) -> None:
    from jaxinfer.engine.args import EngineArgs
    from serve.app import add_server_args

    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API",
                       description="Serve a model over an OpenAI-compatible HTTP API: /v1/completions, "
                                   "/v1/chat/completions (streaming via SSE), /v1/models, /health, /metrics, "
                                   "/tokenize, /detokenize, /version. Multi-host: run the same command "
                                   "on every host with --coordinator-address, --num-processes and "
                                   "its own --process-id; process 0 serves HTTP, the others bind no "
                                   "port and replay its requests (docs/multi_gpu.md).")
    p.add_argument("model_tag", nargs="?", metavar="MODEL",
                   help="model directory (the same as --model; default: the bundled demo model)")
    EngineArgs.add_cli_args(p)
    add_server_args(p)
    # Streams see every step's time: a server keeps their inter-token latency to a target
    # (docs/engine.md, "Inter-token latency target"); offline runs keep whole prefill chunks.
    # And a stream gets each token as its step ends: the on-device decode loop (offline runs'
    # default) hands a loop's tokens over together, in bursts of 8 (issue 65: median ITL 45 ms
    # at a TPOT of 5.65 ms on an H100), for ~5 % of batch-1 throughput on an H200.
    p.set_defaults(func=run, itl_target_ms="auto", decode_steps_per_call=1)


def resolve_model_tag(args: argparse.Namespace) -> None:
    """`jaxinfer serve MODEL` is `--model MODEL`; giving both with different values is an error."""
    from jaxinfer.engine.args import DEFAULT_MODEL
    from jaxinfer.errors import ConfigError
    tag = getattr(args, "model_tag", None)
    if tag is None:
        return
    if args.model not in (DEFAULT_MODEL, tag):
        raise ConfigError(f"the positional MODEL '{tag}' and --model '{args.model}' differ; "
                          f"give one")
    args.model = tag


def run(args: argparse.Namespace) -> int:
    from jaxinfer.engine.args import EngineArgs
    from jaxinfer.frontends.server_engine import create_server_engine
    from jaxinfer.errors import ConfigError
    from serve.app import check_port_free, check_server_args, serve_until_signal

    from jaxinfer.parallel.distributed import distributed_settings

    check_server_args(args)
    resolve_model_tag(args)
    engine_args = EngineArgs.from_cli_args(args)
    multi = distributed_settings(engine_args)
    if multi is not None and multi["process_id"] != 0:
        # Only process 0 serves HTTP; this one replays its request stream until it stops.
        from jaxinfer.frontends.multihost import serve_as_follower
        return serve_as_follower(engine_args)
    check_port_free(args.host, args.port)
    engine = create_server_engine(engine_args, args.engine_core)
    if engine.tokenizer is None:  # every API route takes or returns text
        raise ConfigError(f"model directory '{args.model}' has no tokenizer.json: the server needs "
                          f"one (token-id-only models can be run with the offline LLM API)")
    # Non-zero when the engine loop died: a supervisor (systemd, Kubernetes) restarts the server.
    return asyncio.run(serve_until_signal(engine, args))
