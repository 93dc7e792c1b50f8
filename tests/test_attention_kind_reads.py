"""The model config's MLA flag (`ModelConfig.mla`) is read only inside jaxinfer/model/: everything
else asks a layer's KV-cache spec (jaxinfer/model/kv_specs.py, `ModelConfig.layer_kv_specs`).

Read with `ast`: an attribute `.mla` or a `getattr(x, "mla")` anywhere outside jaxinfer/model/
and the tests fails, naming the file and line."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCANNED = ("cli", "serve", "jaxinfer", "pallas_kernels", "benchmarks", "tools", "examples")
ALLOWED = ROOT / "jaxinfer" / "model"


def mla_reads(source: str, name: str) -> list[int]:
    """Lines of `source` that read an attribute called `mla`."""
    lines = []
    for node in ast.walk(ast.parse(source, name)):
        if isinstance(node, ast.Attribute) and node.attr == "mla":
            lines.append(node.lineno)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "hasattr") and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant) and node.args[1].value == "mla"):
            lines.append(node.lineno)
    return sorted(lines)


def test_the_scan_sees_each_form_of_read():
    src = "a = cfg.mla\nif self.cfg.mla is None: pass\nb = getattr(cfg, 'mla', None)\nc = cfg.mlax\n"
    assert mla_reads(src, "example") == [1, 2, 3]


def test_mla_flag_is_read_only_in_the_model_package():
    offenders = []
    for top in SCANNED:
        for path in sorted((ROOT / top).rglob("*.py")):
            if ALLOWED in path.parents:
                continue
            rel = path.relative_to(ROOT)
            offenders += [f"{rel}:{line}" for line in mla_reads(path.read_text(), str(rel))]
    assert not offenders, ("ModelConfig.mla read outside jaxinfer/model/ (ask the layer's "
                           "KV-cache spec, ModelConfig.layer_kv_specs, instead): "
                           + ", ".join(offenders))
