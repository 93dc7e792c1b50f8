"""`jaxinfer batch -i requests.jsonl -o results.jsonl`: an OpenAI Batch file through the offline
engine (serve/batch.py), resumable: custom_ids already in the output file are skipped."""

from __future__ import annotations

import argparse
import sys


def add_parser(sub: argparse._SubParsersAction) -> None:
    from jaxinfer.engine.args import EngineArgs
    from serve.limits import add_limit_args
    from serve.tools import add_tool_args

    p = sub.add_parser(
        "batch", help="run an OpenAI Batch file (JSONL of /v1/completions and /v1/chat/completions requests)",
        description="Answer every line of an OpenAI Batch input file ({custom_id, method, url, body}) "
                    "with the offline engine, appending {id, custom_id, response: {status_code, "
                    "request_id, body}, error} lines to the output file. A line's body is what the HTTP "
                    "server would answer. Rerunning with the same output file skips the custom_ids it "
                    "already holds.",
        epilog="example: jaxinfer batch -i requests.jsonl -o results.jsonl --model checkpoints/demo-target")
    p.add_argument("-i", "--input-file", required=True, help="the batch input file (JSONL)")
    p.add_argument("-o", "--output-file", required=True, help="the results file (JSONL, appended to)")
    p.add_argument("--max-pending", type=int, default=1024,
                   help="most lines in the engine at once; finished lines are replaced at once "
                        "(default: %(default)s)")
    EngineArgs.add_cli_args(p)
    add_limit_args(p.add_argument_group("request limits (as `jaxinfer serve`)"))
    add_tool_args(p.add_argument_group("tool calling (as `jaxinfer serve`)"))
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from jaxinfer.engine.args import EngineArgs
    from jaxinfer.errors import ConfigError
    from jaxinfer.frontends.factory import create_engine
    from serve.batch import BatchRunner
    from serve.batch_file import done_ids, read_lines
    from serve.limits import RequestLimits
    from serve.tools import ToolOptions, check_tool_args

    if args.max_pending < 1:
        raise ConfigError(f"--max-pending must be >= 1, got {args.max_pending}")
    try:
        check_tool_args(args)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    total, lines = read_lines(args.input_file)
    skip = done_ids(args.output_file)
    engine = create_engine(EngineArgs.from_cli_args(args))
    if engine.tokenizer is None:
        raise ConfigError(f"model directory '{args.model}' has no tokenizer.json: batch requests need one")
    with open(args.output_file, "a", encoding="utf-8") as out, \
            tqdm(total=total, desc="batch", unit="req") as bar:
        counts = BatchRunner(engine, out, RequestLimits.from_args(args), args.max_pending,
                             ToolOptions.from_args(args)).run(lines, bar, skip=skip)
    print(f"{counts['ok']} answered, {counts['failed']} refused or failed, {counts['skipped']} already in "
          f"{args.output_file}", file=sys.stderr)
    return 0
