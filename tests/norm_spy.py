"""A counting add + norm kernel for the kernel-table tests: the Pallas kernel (in its interpreter)
behind a module-level function that records each call, and the engine's table with it in the
norm slot. Calls happen while a step traces, so a step that ran through the kernel left some."""

from __future__ import annotations

import dataclasses

from jaxinfer.engine import kernels, kv_blocks, llm_engine
from pallas_kernels.norm.rms_norm import add_rms_norm_triton

CALLS: list[tuple[int, ...]] = []


def counted_norm(x, residual, weight, *, eps):
    CALLS.append(tuple(x.shape))
    return add_rms_norm_triton(x, residual, weight, eps=eps, interpret=True)


def with_counted_norm(config):
    """The engine's resolved table with `counted_norm` in its norm slot (what a GPU's has)."""
    return dataclasses.replace(kernels.engine_kernels(config), add_rms_norm=counted_norm)


def install(monkeypatch=None) -> None:
    """Engines built from here on resolve `with_counted_norm` (until `restore`, or the
    monkeypatch's undo)."""
    for module in (llm_engine, kv_blocks):
        if monkeypatch is None:
            module.engine_kernels = with_counted_norm
        else:
            monkeypatch.setattr(module, "engine_kernels", with_counted_norm)


def restore() -> None:
    for module in (llm_engine, kv_blocks):
        module.engine_kernels = kernels.engine_kernels
