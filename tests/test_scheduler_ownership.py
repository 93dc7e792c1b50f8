"""The scheduler is the one writer of a sequence's progress: `num_computed` (tokens whose KV is
written or scheduled) and `num_pending` (sampled tokens the host has not seen) are assigned only
in core/scheduler.py, its KV-load helper (core/kv_loads.py) and the Sequence's constructor. The
output processor reports what arrived (`take_counts`), and a failed dispatch is undone through
`Scheduler.unschedule`. Read with `ast`; the benchmark tools may reach in."""

from __future__ import annotations

import ast
from pathlib import Path

from test_runner_ownership import _assigned

ROOT = Path(__file__).resolve().parent.parent
FIELDS = ("num_computed", "num_pending")
WRITERS = {Path("jaxinfer/core/scheduler.py"), Path("jaxinfer/core/kv_loads.py"),
           Path("jaxinfer/core/request.py")}


def writes(source: str, name: str) -> list[str]:
    """Each assignment in `source` to a field the scheduler owns."""
    found = []
    for node in ast.walk(ast.parse(source, name)):
        for target in _assigned(node):
            if isinstance(target, ast.Attribute) and target.attr in FIELDS:
                found.append(f"{name}:{node.lineno} assigns {ast.unparse(target)}")
    return found


def test_only_the_scheduler_writes_a_sequences_progress():
    found, seen = [], set()
    for pkg in ("jaxinfer", "serve"):
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = path.relative_to(ROOT)
            if rel.parts[:2] == ("jaxinfer", "bench"):
                continue
            hits = writes(path.read_text(), str(rel))
            if rel in WRITERS:
                seen.update([rel] if hits else [])
            else:
                found += hits
    assert not found, "\n".join(found)
    assert seen == WRITERS  # (an allowance nobody uses goes)


def test_the_checker_finds_each_write():
    src = "def f(seq, entry):\n    seq.num_computed += 1\n    entry.seq.num_pending = 0\n" \
          "    a, seq.num_computed = 1, 2\n    x = seq.num_computed\n"
    assert [f.split(" assigns ")[1] for f in writes(src, "m.py")] == [
        "seq.num_computed", "entry.seq.num_pending", "seq.num_computed"]
