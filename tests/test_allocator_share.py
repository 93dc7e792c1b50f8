"""`--gpu-memory-utilization` is a share of the card, as vLLM's flag is: the engine gives JAX's GPU
allocator that share before JAX starts, and where the allocator holds less the plan stays in it."""

import logging
import os
import subprocess
import sys

import pytest

from jaxinfer.worker.kv import planner
from jaxinfer.worker.kv.planner import (MEM_FRACTION_ENVS, allocator_fraction,
                                        claim_allocator_share, device_memory_bytes,
                                        usable_card_bytes)

GIB = 1 << 30
H100 = 80 * GIB


@pytest.fixture
def no_share(monkeypatch):
    for name in MEM_FRACTION_ENVS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv(planner.DEVICE_MEMORY_ENV, raising=False)


def test_the_plan_takes_the_card_or_stays_within_the_allocator():
    # The allocator holds the share asked for (or more): the card's figure.
    assert usable_card_bytes(H100, int(0.9 * H100), 0.9) == H100
    assert usable_card_bytes(H100, int(0.95 * H100), 0.9) == H100
    # JAX's default 0.75: 0.9 of the figure is the allocator's whole limit, not 0.9 of the card.
    figure = usable_card_bytes(H100, int(0.75 * H100), 0.9)
    assert figure < H100 and abs(0.9 * figure - 0.75 * H100) < 2


def test_claim_sets_the_share_only_before_jax_starts_and_when_nobody_set_it(no_share, monkeypatch):
    from jax._src import xla_bridge
    monkeypatch.setattr(xla_bridge, "backends_are_initialized", lambda: False)
    assert claim_allocator_share(0.85)
    assert os.environ["XLA_CLIENT_MEM_FRACTION"] == "0.85" and allocator_fraction() == 0.85
    assert not claim_allocator_share(0.5)  # set already
    assert allocator_fraction() == 0.85
    monkeypatch.delenv("XLA_CLIENT_MEM_FRACTION")
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.6")  # the older name counts too
    assert not claim_allocator_share(0.9) and "XLA_CLIENT_MEM_FRACTION" not in os.environ
    assert allocator_fraction() == 0.6
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION")
    monkeypatch.setattr(xla_bridge, "backends_are_initialized", lambda: True)
    assert not claim_allocator_share(0.9) and allocator_fraction() == 0.75  # JAX's default


class _GPU:
    platform = "gpu"

    def __init__(self, limit):
        self.limit = limit

    def memory_stats(self):
        return {"bytes_limit": self.limit}


def test_device_memory_is_the_cards_and_warns_when_the_allocator_holds_less(
        no_share, monkeypatch, caplog):
    monkeypatch.setenv("XLA_CLIENT_MEM_FRACTION", "0.9")
    limit = int(0.9 * H100)
    with caplog.at_level(logging.WARNING, logger=planner.__name__):
        figure = device_memory_bytes(0.9, _GPU(limit))
    assert abs(figure - H100) < 2 and not caplog.records
    monkeypatch.delenv("XLA_CLIENT_MEM_FRACTION")  # JAX's 0.75 (started before the engine)
    limit = int(0.75 * H100)
    with caplog.at_level(logging.WARNING, logger=planner.__name__):
        figure = device_memory_bytes(0.9, _GPU(limit))
    assert int(0.9 * figure) <= limit and int(0.9 * figure) > limit - 2
    assert "less than --gpu-memory-utilization 0.9" in caplog.text


@pytest.mark.parametrize("entry", ["jaxinfer.engine.llm_engine:LLMEngine.from_engine_args",
                                   "jaxinfer.frontends.factory:create_engine"])
def test_engine_entry_points_claim_the_share_before_jax_starts(entry, tmp_path):
    """Both ways to build an engine set the allocator's share first: a missing model fails
    after the claim and before JAX starts (the child then reports both)."""
    module, attr = entry.split(":")
    code = (f"import importlib, os, jax\n"
            f"from jaxinfer.engine.args import EngineArgs\n"
            f"from jax._src import xla_bridge\n"
            f"target = importlib.import_module({module!r})\n"
            f"for part in {attr!r}.split('.'): target = getattr(target, part)\n"
            f"try:\n"
            f"    target(EngineArgs(model={str(tmp_path / 'none')!r}, gpu_memory_utilization=0.8))\n"
            f"except Exception as e:\n"
            f"    print('failed', type(e).__name__)\n"
            f"print('share', os.environ.get('XLA_CLIENT_MEM_FRACTION'))\n")
    env = {k: v for k, v in os.environ.items() if k not in MEM_FRACTION_ENVS}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert "share 0.8" in out.stdout, out.stdout + out.stderr[-2000:]
    assert "failed" in out.stdout
