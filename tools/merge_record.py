"""Fold a new benchmark record into the stored one of the same name: the new run's metrics
replace the stored figures of the same keys, the rest stay, and `config.merged_from` lists every
run that contributed (commit, date, command, the keys it set), so each figure keeps its source.

    python -m tools.merge_record NEW.json benchmarks/results/NAME.json [--prefix P] [--only K,...]

--prefix renames the new keys (a variant run beside the production one); --only keeps the named
keys of the new record.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def merge(new: dict, stored: dict | None, *, prefix: str = "", only: list[str] | None = None) -> dict:
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("new", type=Path)
    ap.add_argument("stored", type=Path)
    ap.add_argument("--prefix", default="")
    ap.add_argument("--only", default=None, help="comma-separated keys of NEW to keep")
    a = ap.parse_args()
    stored = json.loads(a.stored.read_text()) if a.stored.exists() else None
    out = merge(json.loads(a.new.read_text()), stored, prefix=a.prefix,
                only=a.only.split(",") if a.only else None)
    a.stored.write_text(json.dumps(out, indent=1) + "\n")
    print(f"{a.stored}: {len(out['metrics'])} metrics, {len(out['config']['merged_from'])} runs")


if __name__ == "__main__":
    main()
