"""`jaxinfer` command line: generate, serve, batch, convert, memory, warmup, train-eagle, bench."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import signal
import sys
import threading
from pathlib import Path

from jaxinfer.errors import ConfigError, JaxinferError
from jaxinfer.model.quant_scheme import QUANTIZATIONS

LOG_LEVELS = ("debug", "info", "warning", "error")

DESCRIPTION = """\
jaxinfer: LLM inference in JAX with Pallas GPU kernels.

Serve a model over an OpenAI-compatible HTTP API, generate text from the command line, run an
OpenAI Batch file, convert
Hugging Face checkpoints to orbax or quantize them, size the KV cache for a model and accelerator,
or compile every step bucket into the cache before the first start (warmup), or train an
EAGLE-3 speculative-decoding head for a model (train-eagle), or benchmark a server or the engine
as `vllm bench` does (bench)."""


def _add_convert(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("convert", help="convert a Hugging Face model directory to an orbax checkpoint "
                                       "or a quantized one",
                       description="Write an orbax checkpoint of HF_DIR's weights (plus its config and "
                                   "tokenizer files) to OUT_DIR; with --quantization, a quantized "
                                   "safetensors checkpoint in the compressed-tensors layout instead. "
                                   "jaxinfer loads OUT_DIR like HF_DIR.")
    p.add_argument("hf_dir", metavar="HF_DIR", help="HF model directory (config.json + *.safetensors)")
    p.add_argument("out_dir", metavar="OUT_DIR", help="where to write the converted model")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                   help="dtype of the stored weights (default: %(default)s)")
    p.add_argument("--quantization", default=None, choices=QUANTIZATIONS,
                   help="quantize the linear layers' weights (fp8: e4m3, int8: weight-only; one "
                        "scale per output channel) and write safetensors")
    p.set_defaults(func=_run_convert)


def _run_convert(args: argparse.Namespace) -> int:
    import shutil

    import jax.numpy as jnp

    from jaxinfer.model.config import load_config
    from jaxinfer.model.quant_scheme import resolve_quantization
    from jaxinfer.model.quant_writer import write_quantized
    from jaxinfer.model.weights import load_params, save_orbax

    cfg = load_config(args.hf_dir)
    if cfg.quantization and not args.quantization:
        raise ConfigError(f"'{args.hf_dir}' is {cfg.quantization}-quantized; an orbax checkpoint "
                          f"holds unquantized weights only (pass --quantization "
                          f"{cfg.quantization} to rewrite it as safetensors)")
    cfg = dataclasses.replace(cfg, quantization=resolve_quantization(
        args.quantization, cfg.quantization, "safetensors"))
    params = load_params(args.hf_dir, cfg, getattr(jnp, args.dtype), load_format="safetensors")
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for f in Path(args.hf_dir).iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
            shutil.copy2(f, out / f.name)
    path = write_quantized(params, cfg, args.hf_dir, out) if cfg.quantization else save_orbax(params, out)
    print(f"wrote {path}")
    return 0


def _add_log_level(parser: argparse.ArgumentParser, default: str) -> None:
    parser.add_argument("--log-level", default=default, type=str.lower, choices=LOG_LEVELS,
                        help="default: warning")


def build_parser() -> argparse.ArgumentParser:
    # The sub-commands' modules import jax and the engine: imported here, inside main()'s Ctrl-C
    # handling, not when this module loads.
    from jaxinfer.cli import batch as cli_batch, generate as cli_generate, memory as cli_memory
    from jaxinfer.bench import cli as cli_bench
    from jaxinfer.cli import serve as cli_serve, train_eagle as cli_train_eagle, warmup as cli_warmup

    parser = argparse.ArgumentParser(prog="jaxinfer", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_log_level(parser, "warning")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    cli_generate.add_parser(sub)
    cli_serve.add_parser(sub)
    cli_batch.add_parser(sub)
    _add_convert(sub)
    cli_memory.add_parser(sub)
    cli_warmup.add_parser(sub)
    cli_train_eagle.add_parser(sub)
    cli_bench.add_parser(sub)
    for command in sub.choices.values():
        # Also after the command (`jaxinfer serve --log-level info`); SUPPRESS keeps a level given
        # before it when none is given after.
        _add_log_level(command, argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    """The `jaxinfer` command. Ctrl-C at any point before the server takes signals over (imports,
    model loading, compiling) exits with status 130 and one line."""
    with _exit_on_interrupt():
        args = build_parser().parse_args(argv)
    try:
        status = _run(args)
        sys.stdout.flush()  # inside the try: a reader gone by now breaks the pipe here
        return status
    except KeyboardInterrupt:
        print(f"jaxinfer {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return _reader_gone()


def _reader_gone() -> int:
    """stdout's reader closed the pipe (`jaxinfer memory | head`): what it took is all it wanted.
    stdout goes to /dev/null so the interpreter's flush at exit cannot raise a second time, and
    the status is a shell's for a command SIGPIPE ended (128 + 13)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 128 + int(signal.SIGPIPE)


def _exit_interrupted(signum, frame) -> None:
    sys.stderr.write("jaxinfer: interrupted\n")
    sys.stderr.flush()
    os._exit(130)


@contextlib.contextmanager
def _exit_on_interrupt():
    """Ctrl-C exits at once while jax and the engine import (the command's first seconds): raised
    inside a C extension's initialisation (numpy's, under jaxlib's), a KeyboardInterrupt is printed
    there, traceback and all, and replaced by an ImportError. Nothing is written yet to lose."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        yield  # SIGINT ignored (a background job), or handled by whoever called main()
        return
    signal.signal(signal.SIGINT, _exit_interrupted)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def _run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    # The server's own status lines (where it listens, shutting down) are INFO records, shown
    # unless --log-level asks for less than the default.
    if args.log_level in ("warning", "info", "debug"):
        logging.getLogger("serve.app").setLevel(min(logging.INFO, logging.getLogger().level))
    try:
        return int(args.func(args) or 0)
    except JaxinferError as e:
        print(f"jaxinfer {args.command}: error: {e}", file=sys.stderr)
        return 2
    except ValueError as e:  # invalid flag values found after parsing (e.g. sampling parameters)
        print(f"jaxinfer {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
