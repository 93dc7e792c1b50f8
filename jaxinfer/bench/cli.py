"""`jaxinfer bench`: the benchmark drivers, after `vllm bench`. Each driver is one module with
`add_parser(subparsers)` and the `run(args)` its parser points at."""

from __future__ import annotations

import argparse
import sys

from jaxinfer.bench import (host_path_suite, kernels, latency, memory_plan, serve, startup,
                            throughput)

DRIVERS = (serve, throughput, latency, startup, kernels, memory_plan, host_path_suite)
DESCRIPTION = """\
Benchmark jaxinfer, or any OpenAI-compatible server, with the flags and result files of
`vllm bench` (`jaxinfer bench BENCHMARK --help` for each). `--save [DIR] --name NAME` on any of
them also writes the project's record (benchmarks/results/<name>.json: name, date, commit,
machine, command, config, metrics)."""


def _add_drivers(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    drivers = p.add_subparsers(dest="bench_command", metavar="BENCHMARK", required=True,
                               title="benchmarks")
    for driver in DRIVERS:
        driver.add_parser(drivers)
    return p


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """`bench` under the `jaxinfer` command."""
    return _add_drivers(sub.add_parser(
        "bench", help="benchmark a server or the engine (as `vllm bench`)", description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter))


def main(argv: list[str] | None = None) -> int:
    """`jaxinfer bench ARGV` on its own (`python -m jaxinfer.bench.cli serve ...`)."""
    parser = _add_drivers(argparse.ArgumentParser(
        prog="jaxinfer bench", description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter))
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
