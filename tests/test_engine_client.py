"""Every front end implements `EngineClient`, and what drives one (LLM, AsyncEngine, the batch
runner, the CLI) reads nothing else of it."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from jaxinfer.engine.llm_engine import LLMEngine
from jaxinfer.engine.protocol import EngineClient
from jaxinfer.frontends.data_parallel import DataParallelEngine
from jaxinfer.frontends.disaggregated import DisaggregatedEngine
from jaxinfer.frontends.multihost import StreamLeader

ROOT = Path(__file__).resolve().parent.parent
DRIVERS = ["jaxinfer/frontends/llm.py", "jaxinfer/frontends/async_engine.py", "serve/batch.py",
           "jaxinfer/cli/generate.py", "jaxinfer/cli/batch.py"]


@pytest.mark.parametrize("cls", [LLMEngine, DataParallelEngine, DisaggregatedEngine, StreamLeader])
def test_front_ends_implement_the_interface(cls):
    assert issubclass(cls, EngineClient)
    assert not inspect.isabstract(cls), cls.__abstractmethods__


def interface_names() -> set[str]:
    names = {n for n in dir(EngineClient) if not n.startswith("_")}
    return names | set(EngineClient.__annotations__)


def engine_reads(path: Path) -> set[str]:
    """The attributes read off `engine` / `self.engine` / `llm.engine` in a module."""
    reads = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute):
            held = node.value
            if (isinstance(held, ast.Name) and held.id == "engine") or (
                    isinstance(held, ast.Attribute) and held.attr == "engine"):
                reads.add(node.attr)
    return reads


@pytest.mark.parametrize("module", DRIVERS)
def test_drivers_use_only_the_interface(module):
    assert engine_reads(ROOT / module) - interface_names() == set()


def test_the_check_sees_a_foreign_read(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("def f(self, engine):\n    engine.step()\n    self.engine.scheduler.kv\n")
    assert engine_reads(path) - interface_names() == {"scheduler"}
