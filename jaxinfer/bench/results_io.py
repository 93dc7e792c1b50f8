"""Benchmark results as data: one JSON record per benchmark name under benchmarks/results/ (in a
checkout; elsewhere ./bench_results/), the project's own record, beside the vLLM-shaped file that
`jaxinfer bench serve --save-result` writes.

A record is `{name, date, commit, machine, command, config, metrics}`; anchors and ceilings
measured in the same run go inside `metrics` beside the figures they anchor. Only the latest run
per name is kept in the tree (git keeps the history). A benchmark uses it in two lines:

    results_io.add_save_arg(parser, "soak_<gpu>")        # --save [DIR], --name NAME (--record)
    ...
    if args.save:
        name = args.name or f"soak_{results_io.device_slug()}"
        results_io.save(args.save, name, config={...}, metrics={...})

`commit` comes from `git rev-parse` (with "+dirty" when the tree has uncommitted changes), or from
$BENCH_COMMIT where the benchmark runs from a copy without git (the GPU machine).
"""

from __future__ import annotations

import datetime
import re
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

# The checkout's records when this package runs from one (jaxinfer/bench/ -> the repository root),
# else a directory under the working directory (an installed wheel has no benchmarks/).
_CHECKOUT_RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
RESULTS_DIR = _CHECKOUT_RESULTS if _CHECKOUT_RESULTS.is_dir() else Path("bench_results")
KEYS = ("name", "date", "commit", "machine", "command", "config", "metrics")


def git_commit(cwd: Path | None = None) -> str:
    """The checkout's commit, "+dirty" if tracked files differ from it; $BENCH_COMMIT wins."""
    if os.environ.get("BENCH_COMMIT"):
        return os.environ["BENCH_COMMIT"]
    cwd = cwd or Path(__file__).resolve().parent

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True,
                              check=True).stdout.strip()

    try:
        sha = git("rev-parse", "--short=12", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return sha + ("+dirty" if dirty else "")


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> dict:
    """Where the run happened: the accelerator jax sees (if jax is already imported: this never
    starts a backend by itself), the CPU model and count, and the host name."""
    out = {"host": platform.node(), "cpu": _cpu_model(), "cpu_count": os.cpu_count()}
    jax = sys.modules.get("jax")
    if jax is not None:
        dev = jax.devices()[0]
        out.update(platform=dev.platform, device=getattr(dev, "device_kind", str(dev)),
                   device_count=jax.device_count(), jax=jax.__version__)
    return out


def device_slug() -> str:
    """The accelerator's short name for record names ("h200" for an NVIDIA H200, "h100" for an
    "NVIDIA H100 80GB HBM3"), else "cpu"."""
    import jax
    dev = jax.devices()[0]
    if dev.platform == "cpu":
        return "cpu"
    return kind_slug(getattr(dev, "device_kind", dev.platform))


def kind_slug(kind: str) -> str:
    """The model token of a device kind: the first word of letters then digits that is not a
    memory type (HBM3), else the last word."""
    words = kind.split()
    model = next((w for w in words if re.fullmatch(r"[A-Za-z]+\d\w*", w)
                  and not w.upper().startswith("HBM")), words[-1])
    return model.lower().replace("-", "_")


def invocation() -> str:
    """How this process was started: `jaxinfer` for the installed command, `python -m
    jaxinfer.bench.suites.x` for a module run, else the script's path."""
    if Path(sys.argv[0]).name == "jaxinfer":
        return "jaxinfer"
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None and spec.origin and Path(spec.origin).resolve() == Path(sys.argv[0]).resolve():
        # `python -m jaxinfer.bench.cli` is the installed `jaxinfer bench` run from a checkout,
        # `python -m jaxinfer.cli.main` the installed `jaxinfer`
        installed = {"jaxinfer.bench.cli": "jaxinfer bench", "jaxinfer.cli.main": "jaxinfer"}
        return installed.get(spec.name, f"python -m {spec.name}")
    return Path(sys.argv[0]).as_posix()


def record(name: str, *, config: dict, metrics: dict, command: str | None = None,
           date: str | None = None, commit: str | None = None,
           machine_info: dict | None = None) -> dict:
    """A result record; the defaults describe this process (now, this checkout, this machine,
    sys.argv). Historical records pass the original date, commit, machine and command."""
    return {
        "name": name,
        "date": date or datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "commit": commit or git_commit(),
        "machine": machine_info if machine_info is not None else machine(),
        "command": command or " ".join([invocation(), *sys.argv[1:]]),
        "config": config,
        "metrics": metrics,
    }


def fold(new: dict, stored: dict | None, *, prefix: str = "", only: list[str] | None = None) -> dict:
    """`new` folded into the `stored` record of the same name: the new run's metrics (renamed with
    `prefix`, `only` those keys) replace the stored figures of the same keys, the rest stay, and
    `config.merged_from` lists every run that contributed (commit, date, command, the keys it
    set), so each figure keeps its source."""
    metrics = {prefix + k: v for k, v in new["metrics"].items() if only is None or k in only}
    if stored is None:
        out = dict(new, metrics=metrics)
        out["config"] = dict(new.get("config", {}), merged_from=[])
    else:
        out = dict(stored, metrics={**stored["metrics"], **metrics})
        out["config"] = dict(stored.get("config", {}))
        out["config"].setdefault("merged_from", [])
        out["date"], out["commit"] = new["date"], new["commit"]
    out["config"]["merged_from"] = out["config"]["merged_from"] + [
        {"commit": new.get("commit"), "date": new.get("date"), "command": new.get("command"),
         "keys": sorted(metrics)}]
    return out


def save(directory: str | Path | None, name: str, *, config: dict, metrics: dict,
         merge: str | Path | None = None, **kwargs) -> Path:
    """Writes record(name, ...) to DIRECTORY/<name>.json (default benchmarks/results) and
    returns the path. `merge`: a stored record (`add_merge_arg`) this run's metrics are folded
    into (`merge`: its other keys kept, `config.merged_from` naming each run); absent file: this
    run's record alone."""
    directory = Path(directory or RESULTS_DIR)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.json"
    rec = record(name, config=config, metrics=metrics, **kwargs)
    if merge is not None and Path(merge).is_file():
        rec = dict(fold(rec, json.loads(Path(merge).read_text())), name=name)
    path.write_text(json.dumps(rec, indent=1, sort_keys=False) + "\n")
    print(f"saved {path}", flush=True)
    return path


def load(name: str, directory: str | Path | None = None) -> dict:
    return json.loads((Path(directory or RESULTS_DIR) / f"{name}.json").read_text())


def add_merge_arg(parser) -> None:
    """--merge RECORD.json: fold this run's metrics into that stored record (`save`'s `merge`),
    e.g. --save $OUT --name quant_h200 --merge benchmarks/results/quant_h200.json."""
    parser.add_argument("--merge", default=None, metavar="RECORD.json",
                        help="a stored record whose other metrics the saved one keeps (this "
                             "run's keys replace its figures of the same names)")


def add_save_arg(parser, default_name: str = "") -> None:
    """--save [DIR]: write this run's record to DIR/<name>.json (default benchmarks/results);
    --name NAME: the record's name instead of the benchmark's default (`args.name`)."""
    parser.add_argument("--save", nargs="?", const=str(RESULTS_DIR), default=None, metavar="DIR",
                        help="write the run's project record ({name, date, commit, machine, "
                             "command, config, metrics}) to DIR/<name>.json (default: "
                             f"{RESULTS_DIR})")
    parser.add_argument("--name", "--record", dest="name", default=None,
                        help="the record's name" + (f" (default: {default_name})" if default_name
                                                    else ""))
