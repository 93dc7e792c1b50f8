"""`jaxinfer warmup`: compile every step bucket into the compilation cache, then exit.

`jaxinfer serve` is ready once its first buckets are compiled and compiles the rest in the
background while it serves; a process that exits before that ends leaves them for the next start
to compile again. Run once with the flags the server will get (the cache is keyed by them, by the
model's shapes and by the KV cache's size) and every later start loads all of its buckets before
ready: no compile runs beside its first requests (docs/startup.md)."""

from __future__ import annotations

import argparse
import time


def add_parser(sub: argparse._SubParsersAction) -> None:
    from jaxinfer.engine.args import EngineArgs

    p = sub.add_parser("warmup", help="compile every step bucket into the compilation cache and exit",
                       description=__doc__.split("\n\n", 1)[1].replace("\n", " "),
                       epilog="example: jaxinfer warmup checkpoints/demo-target --max-num-seqs 64")
    p.add_argument("model_tag", nargs="?", metavar="MODEL",
                   help="model directory (the same as --model; default: the bundled demo model)")
    EngineArgs.add_cli_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from jaxinfer.cli.serve import resolve_model_tag
    from jaxinfer.engine.args import EngineArgs
    from jaxinfer.errors import ConfigError
    from jaxinfer.frontends.factory import create_engine

    resolve_model_tag(args)
    if not args.compilation_cache_dir:
        raise ConfigError("--compilation-cache-dir is off: warmup would keep nothing")
    args.warmup, args.background_compile = True, False
    t0 = time.perf_counter()
    engine = create_engine(EngineArgs.from_cli_args(args))
    engines = (getattr(engine, "replicas", None)
               or [getattr(engine, role) for role in ("prefill", "decode") if hasattr(engine, role)]
               or [engine])  # data-parallel replicas, a disaggregated pair, or one engine
    units = sum(e.runner.compiler.num_units for e in engines)
    print(f"{units} step buckets compiled or loaded in {time.perf_counter() - t0:.1f} s; "
          f"cached under {args.compilation_cache_dir}")
    return 0
