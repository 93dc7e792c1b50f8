"""What the `jaxinfer bench` drivers and the benchmarks/ suites share: the engine flags (with
--preset), the project record (--save/--record through results_io), the vLLM-shaped --output-json
file, the engine an offline driver times, and a section run in a child process."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import time
from importlib import metadata
from pathlib import Path

from jaxinfer.bench import presets, results_io


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions kept as written; a flag's default after its help where it has one worth
    saying (not None or False) and the help does not name it already."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (action.default not in (None, False, argparse.SUPPRESS) and "default" not in text
                and action.option_strings):
            text += (" " if text else "") + "(default: %(default)s)"
        return text


USAGE = "%(prog)s [options]"


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """The engine's own flags (as `jaxinfer serve` takes them) and --preset."""
    from jaxinfer.engine.args import EngineArgs
    g = parser.add_argument_group("preset")
    g.add_argument("--preset", choices=sorted(presets.PRESETS), default=None,
                   help="a model shape and workload from benchmarks/results' records; flags given "
                        "on the command line win. " + "; ".join(
                            f"{k}: {p.description}" for k, p in sorted(presets.PRESETS.items())))
    EngineArgs.add_cli_args(parser)


def add_record_args(parser: argparse.ArgumentParser, default_name: str) -> None:
    g = parser.add_argument_group("project record (benchmarks/results/<name>.json)")
    results_io.add_save_arg(g, default_name)


def add_output_json(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("--output-json", default=None, metavar="PATH",
                        help=f"write {what} as JSON (the file `vllm bench` writes)")


def write_json(path: str | Path, obj: dict) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=4, allow_nan=False))
    print(f"wrote {path}")
    return path


def cli_module() -> str:
    """The module behind the installed `jaxinfer` command (its console-script entry point), for
    starting `jaxinfer serve` as `python -m MODULE`."""
    (entry,) = metadata.entry_points(group="console_scripts", name="jaxinfer")
    return entry.module


def record_config(args: argparse.Namespace) -> dict:
    """The flags of the run, for the record's `config` (the driver plumbing left out; paths and
    other values JSON has no type for as their text)."""
    skip = {"save", "name", "output_json", "func", "command", "bench_command", "log_level"}
    flags = {k: v for k, v in vars(args).items() if k not in skip and not k.startswith("_")}
    return json.loads(json.dumps(flags, default=str))


def numeric(result: dict) -> dict:
    """The scalar figures of a result, for the record's `metrics`."""
    return {k: v for k, v in result.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def build_llm(args: argparse.Namespace):
    """The offline front end over an engine made from the parsed engine flags."""
    from jaxinfer.engine.args import EngineArgs
    from jaxinfer.engine.llm_engine import LLMEngine
    from jaxinfer.frontends.llm import LLM
    engine = LLMEngine.from_engine_args(EngineArgs.from_cli_args(args))
    return LLM(engine=engine)


def timed_generate(llm, prompts: list[list[int]], n: int) -> float:
    """Seconds to generate exactly n greedy tokens for each prompt."""
    from jaxinfer.sampling_params import SamplingParams
    t0 = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=n, ignore_eos=True, temperature=0),
                 use_tqdm=False)
    return time.perf_counter() - t0


def child(argv: list[str], timeout: float, grace_s: float = 15) -> tuple[str, str, int | None]:
    """Runs a benchmark section in its own process (one that crashes or hangs leaves the others'
    figures) -> (stdout, stderr, returncode, None when it timed out). Past `timeout` it gets
    SIGABRT first, so faulthandler (on in the child) prints every thread's Python stack into
    stderr (where a hung step waits is then on record); `grace_s` later it is killed."""
    env = {**os.environ, "PYTHONFAULTHANDLER": "1"}
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
        return stdout, stderr, proc.returncode
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGABRT)
        try:
            stdout, stderr = proc.communicate(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, stderr = proc.communicate()
        stderr = "\n".join(l for l in stderr.splitlines() if "/s]" not in l)  # no progress bars
        return stdout, stderr + f"\n[timed out after {timeout:.0f} s]", None
