"""The import graph: no cycle between modules nor between the packages of any one parent, and no
import upward through the layers that docs/ARCHITECTURE.md ("Layers") lists, top first.

Imports are read with `ast` (nothing is imported), including those inside functions and under
TYPE_CHECKING: a lazy import is still a dependency."""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LAYERED = ("serve", "jaxinfer", "pallas_kernels")  # the layers doc orders these
# The `jaxinfer` command sits inside jaxinfer/ so that the wheel installs no top-level package named
# `cli`, yet it is the top layer, above serve/ (which imports jaxinfer): for the package-cycle check
# it is a top-level package of its own, where jaxinfer -> serve -> jaxinfer would otherwise read as
# a cycle between jaxinfer and serve.
HOISTED = "jaxinfer.cli"
OUTSIDE = ("benchmarks", "tests", "examples", "checkpoints")  # may import any layer

Graph = dict[str, set[str]]


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def statements(body: list[ast.stmt]):
    """Every statement, nested ones included (imports are statements: expressions are skipped,
    which is most of a tree)."""
    for node in body:
        yield node
        for field in ("body", "orelse", "finalbody", "handlers", "cases"):
            yield from statements(getattr(node, field, None) or [])


def module_graph(root: Path, packages: tuple[str, ...], missing: list[str] | None = None) -> Graph:
    """module -> the modules of `packages` it imports. `from p import x` is an edge to p.x when
    that is a module, else to p. Imports of modules of `packages` that do not exist (a stale path
    after a move) go to `missing`."""
    files = {module_name(p, root): p for pkg in packages for p in (root / pkg).rglob("*.py")}

    def resolve(name: str) -> str | None:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph: Graph = {}
    for mod, path in files.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        edges = graph.setdefault(mod, set())
        for node in statements(ast.parse(path.read_text(), str(path)).body):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
                targets = [resolve(n) for n in names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(parent + ([base] if base else []))
                names = [base]
                targets = [resolve(f"{base}.{a.name}") if f"{base}.{a.name}" in files else resolve(base)
                           for a in node.names]
            else:
                continue
            if missing is not None:
                missing += [f"{mod} imports {n}" for n in names
                            if n.split(".")[0] in packages and n not in files]
            edges.update(t for t in targets if t and t != mod)
    return graph


def cycles(graph: Graph) -> list[list[str]]:
    """The strongly connected components with more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def package_cycles(graph: Graph) -> list[list[str]]:
    """Cycles between the children (subpackages and modules) of any one package, the top level
    included: a.x -> b.y and b.z -> a.w is a cycle between a and b even when the modules form none.
    A package's own __init__ is a child of its own (`p.__init__`)."""
    found = []
    parents = {""} | {m.rpartition(".")[0] for m in graph} | set(graph)
    for parent in sorted(parents):
        prefix = parent + "." if parent else ""

        def child(mod: str) -> str | None:
            if mod == parent:
                return f"{parent}.__init__"
            if not mod.startswith(prefix):
                return None
            return prefix + mod[len(prefix):].split(".")[0]

        children: Graph = defaultdict(set)
        for a, targets in graph.items():
            ca = child(a)
            for b in targets:
                cb = child(b)
                if ca and cb and ca != cb:
                    children[ca].add(cb)
        found += cycles(children)
    return found


def read_layers(doc: Path) -> list[list[str]]:
    """The numbered list under "## Layers": each item's backquoted paths before its colon, as module
    names: `jaxinfer/engine/` -> "jaxinfer.engine." (the package, all of it), `jaxinfer/errors.py`
    -> "jaxinfer.errors", `jaxinfer/__init__.py` -> "jaxinfer" (that module only)."""
    section = doc.read_text().split("\n## Layers", 1)[1].split("\n## ", 1)[0]
    layers = []
    for line in section.splitlines():
        if m := re.match(r"\d+\. (.*?):", line):
            names = re.findall(r"`([^`]+)`", m.group(1))
            layers.append([re.sub(r"(/__init__)?\.py$", "", n).replace("/", ".") for n in names])
    return layers


def layer_of(mod: str, layers: list[list[str]]) -> int | None:
    """The layer of the most specific unit that holds `mod`."""
    best, best_len = None, -1
    for i, units in enumerate(layers):
        for unit in units:
            holds = mod == unit.rstrip(".") or (unit.endswith(".") and mod.startswith(unit))
            if holds and len(unit) > best_len:
                best, best_len = i, len(unit)
    return best


def layer_violations(graph: Graph, layers: list[list[str]]) -> list[str]:
    """Upward imports (to an earlier layer), imports of the outside (benchmarks, tests), and
    modules no layer holds."""
    found = []
    for a in sorted(graph):
        la = layer_of(a, layers)
        if la is None:
            found.append(f"{a}: in no layer")
            continue
        for b in sorted(graph[a]):
            if b.split(".")[0] in OUTSIDE:
                found.append(f"{a} -> {b}: imports from outside the layers")
            elif (lb := layer_of(b, layers)) is not None and lb < la:
                found.append(f"{a} -> {b}: upward ({layers[la][0]} is below {layers[lb][0]})")
    return found


def layered(graph: Graph) -> Graph:
    return {m: t for m, t in graph.items() if m.split(".")[0] in LAYERED}


def hoisted(graph: Graph, package: str) -> Graph:
    """`graph` with `package` and its modules renamed to a top-level package ("a.b.c" -> "a:b.c")."""
    top = package.replace(".", ":")

    def rename(mod: str) -> str:
        return top + mod[len(package):] if mod == package or mod.startswith(package + ".") else mod

    return {rename(m): {rename(t) for t in targets} for m, targets in graph.items()}


MISSING: list[str] = []


@pytest.fixture(scope="module")
def graph() -> Graph:
    MISSING.clear()
    return module_graph(ROOT, LAYERED + ("benchmarks",), MISSING)


def test_every_import_exists(graph):
    assert MISSING == []


def test_no_module_cycles(graph):
    assert cycles(graph) == []


def test_no_package_cycles(graph):
    assert package_cycles(hoisted(graph, HOISTED)) == []


def test_no_upward_imports(graph):
    layers = read_layers(ROOT / "docs" / "ARCHITECTURE.md")
    assert len(layers) >= 10
    assert layer_violations(layered(graph), layers) == []


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


def test_checker_finds_each_kind_of_violation(tmp_path):
    """A synthetic tree with one of each fault: the checks are not vacuous."""
    _write(tmp_path, {
        "serve/__init__.py": "",
        "serve/app.py": "from jaxinfer.engine import core_api\n",
        "jaxinfer/__init__.py": "",
        "jaxinfer/engine/__init__.py": "",
        "jaxinfer/engine/core_api.py": "from jaxinfer.core import sched\n",
        "jaxinfer/core/__init__.py": "",
        # upward (core -> engine), under a function and relative: still an edge
        "jaxinfer/core/sched.py": "def f():\n    from ..engine import core_api\n",
        # module cycle a <-> b; package cycle util <-> helpers without a module cycle
        "jaxinfer/core/a.py": "from . import b\n",
        "jaxinfer/core/b.py": "import jaxinfer.core.a\nfrom jaxinfer.util import x\n",
        "jaxinfer/util/__init__.py": "",
        "jaxinfer/util/x.py": "",
        "jaxinfer/util/y.py": "from jaxinfer.helpers.z import f\n",
        "jaxinfer/helpers/__init__.py": "",
        "jaxinfer/helpers/z.py": "from jaxinfer.util.x import g\nfrom benchmarks.results_io import w\n",
        "jaxinfer/stray.py": "from jaxinfer.gone import f\n",
        "benchmarks/__init__.py": "",
        "benchmarks/results_io.py": "",
    })
    missing: list[str] = []
    g = module_graph(tmp_path, ("serve", "jaxinfer", "benchmarks"), missing)
    assert g["jaxinfer.core.sched"] == {"jaxinfer.engine.core_api"}
    assert missing == ["jaxinfer.stray imports jaxinfer.gone"]
    assert sorted(cycles(g)) == [["jaxinfer.core.a", "jaxinfer.core.b"],
                                 ["jaxinfer.core.sched", "jaxinfer.engine.core_api"]]
    assert ["jaxinfer.helpers", "jaxinfer.util"] in package_cycles(g)
    assert ["jaxinfer.core", "jaxinfer.engine"] in package_cycles(g)
    # the clean part of the tree passes
    ok = {"serve.app": {"jaxinfer.engine.core_api"}, "jaxinfer.engine.core_api": set()}
    assert cycles(ok) == [] and package_cycles(ok) == []
    # the command inside jaxinfer/ imports serve/, which imports jaxinfer: a cycle unless hoisted
    cmd = {"jaxinfer.cli.main": {"serve.app"}, **ok}
    assert package_cycles(cmd) == [["jaxinfer", "serve"]]
    assert package_cycles(hoisted(cmd, "jaxinfer.cli")) == []

    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "A.md").write_text(
        "# x\n## Layers\n1. `serve/`: top\n2. `jaxinfer/engine/`: e\n"
        "3. `jaxinfer/core/`, `jaxinfer/util/`, `jaxinfer/helpers/`: c\n## Next\n4. `x/`: no\n")
    layers = read_layers(tmp_path / "docs" / "A.md")
    assert layers == [["serve."], ["jaxinfer.engine."],
                      ["jaxinfer.core.", "jaxinfer.util.", "jaxinfer.helpers."]]
    found = layer_violations({m: t for m, t in g.items() if not m.startswith("benchmarks")}, layers)
    assert "jaxinfer.core.sched -> jaxinfer.engine.core_api: upward (jaxinfer.core. is below " \
           "jaxinfer.engine.)" in found
    assert "jaxinfer.helpers.z -> benchmarks.results_io: imports from outside the layers" in found
    assert "jaxinfer.stray: in no layer" in found
    assert "jaxinfer: in no layer" in found
    assert not [f for f in found if f.startswith("serve.app")]
