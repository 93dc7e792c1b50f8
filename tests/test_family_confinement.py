"""A model family is named only inside jaxinfer/model/: no module outside it compares against a
family's architecture or model-type name (the engine, server and kernels ask a layer's KV spec or
the kernel table instead). Read with `ast`. Docstrings, and names that are a public API's own
(vLLM's reasoning-parser names, the EAGLE-3 head's architecture), are not a family's dispatch.
The benchmarks (jaxinfer/bench/) name the models they measure."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from jaxinfer.model.families import SUPPORTED_ARCHITECTURES

ROOT = Path(__file__).resolve().parent.parent
SCANNED = ("jaxinfer", "serve", "pallas_kernels")
EXEMPT = ("jaxinfer/model/", "jaxinfer/bench/", "jaxinfer/demo_models/")
# (module, name): a public API's own name that happens to spell a family's.
ALLOWED = {
    ("serve/reasoning/parsers.py", "qwen3"),  # vLLM's --reasoning-parser names
    ("serve/reasoning/parsers.py", "gpt_oss"),
    ("jaxinfer/spec_decode/eagle_head.py", "llama"),  # an EAGLE-3 head is a Llama layer
    ("jaxinfer/spec_decode/eagle_head.py", "LlamaForCausalLM"),
}


def family_names() -> set[str]:
    """Each family's architecture, and its stem in the spellings a model type takes
    (Qwen3Next: qwen3next, qwen3_next)."""
    names = set(SUPPORTED_ARCHITECTURES)
    for arch in SUPPORTED_ARCHITECTURES:
        stem = re.sub(r"For(CausalLM|ConditionalGeneration)$", "", arch)
        names |= {stem.lower(), re.sub(r"(?<=[a-z0-9])([A-Z])", r"_\1", stem).lower()}
    return names


def _docstrings(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                ids.add(id(body[0].value))
    return ids


def named_families(source: str, module: str, names: set[str]) -> list[tuple[int, str]]:
    """(line, name) of each string constant in `source` that is a family's name (docstrings
    left out)."""
    tree = ast.parse(source, module)
    docs = _docstrings(tree)
    return [(node.lineno, node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str)
            and id(node) not in docs and node.value in names]


def test_no_family_is_named_outside_the_model_package():
    names = family_names()
    found, allowed_seen = [], set()
    for top in SCANNED:
        for path in sorted((ROOT / top).rglob("*.py")):
            module = path.relative_to(ROOT).as_posix()
            if module.startswith(EXEMPT):
                continue
            for line, name in named_families(path.read_text(), module, names):
                if (module, name) in ALLOWED:
                    allowed_seen.add((module, name))
                else:
                    found.append(f"{module}:{line} names the family {name!r}")
    assert not found, "\n".join(found)
    assert allowed_seen == ALLOWED, f"no longer needed: {ALLOWED - allowed_seen}"


def test_the_checker_finds_a_family_compared_by_name():
    names = family_names()
    assert {"deepseek_v3", "qwen3_next", "gpt_oss", "GptOssForCausalLM"} <= names
    source = ('"""Mentions gemma3 in prose."""\n'
              'def f(cfg):\n'
              '    """And DeepseekV3ForCausalLM here."""\n'
              '    return cfg.model_type == "deepseek_v3" or cfg.arch in ("Gemma3ForCausalLM",)\n')
    assert named_families(source, "jaxinfer/engine/x.py", names) == [
        (4, "deepseek_v3"), (4, "Gemma3ForCausalLM")]
