"""The runner is the one owner of step batches, compiled programs and its own state: no module
outside jaxinfer/worker/ builds a step batch or assigns a runner's attributes, and the proposers
the runner runs contribute functions to its program table (worker/programs.py) rather than jit
their own. Read with `ast`; the benchmark tools (jaxinfer/bench/) may reach into a runner."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OWNER = ROOT / "jaxinfer" / "worker"
TOOLS = ROOT / "jaxinfer" / "bench"
# The speculative decoding modules whose programs the runner runs (eagle_train.py trains a head).
PROPOSER_MODULES = ("draft.py", "eagle.py", "spec_loop.py", "target_step.py")


def _names_runner(node: ast.expr) -> bool:
    """`runner`, `x.runner` (`self.runner`, `engine.runner`, ...)."""
    return ((isinstance(node, ast.Name) and node.id == "runner")
            or (isinstance(node, ast.Attribute) and node.attr == "runner"))


def _assigned(node: ast.AST) -> list[ast.expr]:
    if isinstance(node, ast.Assign):
        targets = node.targets
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        targets = [node.target]
    else:
        return []
    out = []
    for t in targets:
        out += t.elts if isinstance(t, (ast.Tuple, ast.List)) else [t]
    return out


def violations(source: str, name: str, *, proposer: bool = False) -> list[str]:
    """What `source` (module `name`, outside worker/) does that only the runner may."""
    found = []
    for node in ast.walk(ast.parse(source, name)):
        if isinstance(node, ast.Name) and node.id == "build_step_batch" or (
                isinstance(node, ast.alias) and node.name == "build_step_batch"):
            found.append(f"{name}:{getattr(node, 'lineno', '?')} builds a step batch")
        for target in _assigned(node):
            while isinstance(target, ast.Subscript):
                target = target.value
            if isinstance(target, ast.Attribute) and _names_runner(target.value):
                found.append(f"{name}:{node.lineno} assigns runner.{target.attr}")
        if proposer and isinstance(node, ast.Attribute) and node.attr == "jit" and (
                isinstance(node.value, ast.Name) and node.value.id == "jax"):
            found.append(f"{name}:{node.lineno} jits a program of its own")
    return found


def test_only_the_worker_builds_batches_and_writes_runner_state():
    found = []
    for pkg in ("jaxinfer", "serve"):
        for path in sorted((ROOT / pkg).rglob("*.py")):
            if path.is_relative_to(OWNER) or path.is_relative_to(TOOLS):
                continue
            proposer = path.parent.name == "spec_decode" and path.name in PROPOSER_MODULES
            found += violations(path.read_text(), str(path.relative_to(ROOT)), proposer=proposer)
    assert not found, "\n".join(found)


def test_the_checker_finds_each_kind_of_violation():
    src = """
from jaxinfer.worker.step_inputs import build_step_batch
import jax
def f(self, engine, runner):
    batch = build_step_batch([], 0, 8, 8, None, 16, 4, 64, None)
    self.runner.params = {}
    engine.runner.kv_cache, x = None, 1
    runner.params["lora"] = None
    runner.num_dispatches += 1
    return jax.jit(f)
"""
    found = violations(src, "m.py", proposer=True)
    assert sum("builds a step batch" in f for f in found) == 2  # the import and the call
    assert sorted(f.split(" assigns ")[1] for f in found if " assigns " in f) == [
        "runner.kv_cache", "runner.num_dispatches", "runner.params", "runner.params"]
    assert sum("jits a program" in f for f in found) == 1
    assert violations("runner.replace_kv_cache(f)\nx = runner.params\n", "ok.py") == []
