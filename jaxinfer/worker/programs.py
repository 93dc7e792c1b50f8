"""The runner's compiled programs, in one table: every jitted function a step runs (its forward,
sampler, decode loop and block copy, and what a proposer contributes: the verifying step, the
on-device speculative loop, an EAGLE-3 head's stream-writing forward, chain and catch-up, a
draft model's loop and catch-up), with the executables warm-up compiled for them.

A program is a plain function with its static configuration bound (model config, kernel table,
mesh plan, ...), jitted once per process for that configuration (`shared_jit`): engines built one
after another, e.g. in tests, reuse each other's compilations. Its executables are kept by the
program's name and a bucket key (bucket_compiler.py fills them); a call for which none was
compiled runs the jitted function, which compiles on first use as before warm-up had them. The
keys' pieces (sampler variants, a forward's shape) are here too, for the compiler and its callers.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Hashable

import jax

from jaxinfer.worker.sampler import BASE_SAMPLER, FULL_SAMPLER, MASKED_SAMPLER, SamplerVariant
from jaxinfer.worker.step_inputs import StepBatch

# The keys executables are compiled and found under: sampler variants, forward shapes.
LOOP_VARIANTS = (BASE_SAMPLER, FULL_SAMPLER)
# The decode loop never runs constrained rows (each needs a fresh bitmask from the host per token).
SAMPLE_VARIANTS = (*LOOP_VARIANTS, MASKED_SAMPLER)


def variant_label(variant: SamplerVariant | None) -> str:
    if variant is None:
        return ""
    return "masked" if variant.masked else "full" if variant.advanced else "base"


def model_inputs(batch: StepBatch) -> StepBatch:
    """The batch without its sampling tensors, whose pytree differs per sampler variant: the
    forward neither needs them nor should be compiled once per variant."""
    return dataclasses.replace(batch, sampling=None)


def forward_key(batch: StepBatch) -> tuple[int, int, int]:
    return batch.token_ids.shape[0], batch.md.num_seqs, batch.md.num_decodes


def shape_specs(tree):
    """Shapes, dtypes and shardings of live arrays; an uncommitted array's spec names no sharding,
    so the executable's outputs stay uncommitted too (jit keys later calls on that)."""
    return jax.tree_util.tree_map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype,
                                       sharding=a.sharding if a.committed else None), tree)


@functools.lru_cache(maxsize=None)
def shared_jit(fn: Callable, bound: tuple[tuple[str, Hashable], ...],
               static_argnames: tuple[str, ...], donate_argnums: tuple[int, ...]) -> Callable:
    """`fn` with the keyword arguments `bound` fixed, jitted; one per process for each."""
    return jax.jit(functools.partial(fn, **dict(bound)), static_argnames=static_argnames,
                   donate_argnums=donate_argnums)


class ProgramTable:
    """Programs by name: `jitted[name]` (lower it, or call it with its static arguments) and
    `compiled[name]`, its executables by bucket key."""

    def __init__(self):
        self.jitted: dict[str, Callable] = {}
        self.compiled: dict[str, dict[Hashable, jax.stages.Compiled]] = {}

    def add(self, name: str, fn: Callable, *, static_argnames: tuple[str, ...] = (),
            donate_argnums: tuple[int, ...] = (), **bound) -> None:
        """`fn` as program `name`, its keyword arguments `bound` fixed (hashable: they key the
        process-wide jit); `static_argnames` vary per call, `donate_argnums` are donated."""
        self.register(name, shared_jit(fn, tuple(sorted(bound.items())), tuple(static_argnames),
                                       tuple(donate_argnums)))

    def register(self, name: str, jitted: Callable) -> None:
        """An already jitted function as program `name` (its executables start empty)."""
        self.jitted[name] = jitted
        self.compiled[name] = {}

    def run(self, name: str, *args, key: Hashable = None, **static):
        """The executable compiled for `key`, else the jitted function with `static`; only
        dispatches. `key` None: never a compiled one (a shape warm-up does not make)."""
        exe = None if key is None else self.compiled[name].get(key)
        return exe(*args) if exe is not None else self.jitted[name](*args, **static)
