"""benchmarks/RESULTS.md, generated from the records: benchmarks/RESULTS.in.md is the page as
written, each figure taken from a record a placeholder `{{RECORD:KEY|FORMAT}}` that renders that
record's metric (KEY: a metric key, or a dotted path into a nested one) with the Python FORMAT spec;
a FORMAT starting with `%` renders the value times 100 (a fraction as a percentage), one starting
with `GB` the value over 1e9 (bytes as GB). A table or
sentence then cannot disagree with its record: re-running a benchmark and regenerating the page
updates every figure it cites.

    python -m jaxinfer.bench.results_md            # rewrite benchmarks/RESULTS.md
    python -m jaxinfer.bench.results_md --check    # exit 1 if it differs from what the records give
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from jaxinfer.bench import results_io

TEMPLATE = results_io.RESULTS_DIR.parent / "RESULTS.in.md"
PAGE = results_io.RESULTS_DIR.parent / "RESULTS.md"
PLACEHOLDER = re.compile(r"\{\{([\w.+-]+):([\w.]+)\|(%|GB)?([^}]*)\}\}")
SCALES = {"%": 100, "GB": 1e-9}


def metric(record: dict, path: str):
    """The record's metric at `path` (`a.b` looks into the dict metrics["a"])."""
    value = record["metrics"]
    for part in path.split("."):
        if not isinstance(value, dict) or part not in value:
            raise KeyError(f"{record['name']}: no metric {path!r}")
        value = value[part]
    return value


def render(template: str, records_dir: Path | None = None) -> str:
    """The template with every placeholder replaced by its record's figure."""
    records: dict[str, dict] = {}

    def figure(m: re.Match) -> str:
        name, path, scale, spec = m.groups()
        if name not in records:
            records[name] = results_io.load(name, records_dir)
        value = metric(records[name], path)
        return format(value * SCALES[scale] if scale else value, spec)

    return PLACEHOLDER.sub(figure, template)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true",
                    help="only compare: exit 1 when RESULTS.md is not what the records give")
    args = ap.parse_args(argv)
    page = render(TEMPLATE.read_text())
    if args.check:
        if PAGE.read_text() != page:
            print(f"{PAGE} differs from its records: python -m jaxinfer.bench.results_md",
                  file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(page)
    print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
