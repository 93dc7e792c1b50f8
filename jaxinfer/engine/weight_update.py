"""Checking and placing a new params pytree so it can replace the engine's weights in place.

The compiled step executables take the params as an argument, so new weights need no recompilation
as long as every leaf keeps the shape, dtype and sharding the executables were compiled for.
`check_params` refuses anything else, naming the parameter's path; `place_like` moves each leaf to
the sharding of the leaf it replaces (device to device for arrays already on devices, one transfer
for host numpy; uncommitted leaves stay uncommitted, see there) and casts it to that leaf's dtype
on the device.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jaxinfer.errors import JaxinferError


class ParamsMismatchError(JaxinferError, ValueError):
    """A params pytree does not fit the model: `path` names the offending parameter."""

    def __init__(self, message: str, path: str):
        super().__init__(message)
        self.path = path


def _leaves_by_path(tree) -> dict[str, object]:
    leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {jax.tree_util.keystr(path): leaf for path, leaf in leaves}


def check_params(new, ref) -> list:
    """The leaves of `new` in the order of `ref`'s leaves, after checking that `new` has exactly
    `ref`'s parameter paths, each with the same shape and a dtype it can be cast to (any float
    dtype for a float parameter, the same dtype otherwise). Raises ParamsMismatchError."""
    got = _leaves_by_path(new)
    want = _leaves_by_path(ref)
    missing = [p for p in want if p not in got]
    if missing:
        raise ParamsMismatchError(f"params{missing[0]} is missing from the new params "
                                  f"({len(missing)} parameter(s) missing)", missing[0])
    extra = [p for p in got if p not in want]
    if extra:
        raise ParamsMismatchError(f"params{extra[0]} is not a parameter of this model", extra[0])
    leaves = []
    for path, old in want.items():
        leaf = got[path]
        shape, dtype = getattr(leaf, "shape", None), getattr(leaf, "dtype", None)
        if shape is None or dtype is None:
            raise ParamsMismatchError(f"params{path} is a {type(leaf).__name__}, not an array",
                                      path)
        if tuple(shape) != tuple(old.shape):
            raise ParamsMismatchError(f"params{path} has shape {tuple(shape)}; the model's is "
                                      f"{tuple(old.shape)}", path)
        floating = jnp.issubdtype(old.dtype, jnp.floating)
        if (floating and not jnp.issubdtype(dtype, jnp.floating)) or (
                not floating and jnp.dtype(dtype) != old.dtype):
            raise ParamsMismatchError(
                f"params{path} has dtype {jnp.dtype(dtype).name}; the model's is "
                f"{jnp.dtype(old.dtype).name}" + (" (any float dtype is cast)" if floating else ""),
                path)
        leaves.append(leaf)
    return leaves


@functools.partial(jax.jit, static_argnums=1)
def _cast(leaves: list, dtypes: tuple) -> list:
    # One program for the whole tree (compiled once per tree of shapes and dtypes), not one per leaf.
    return [x.astype(d) for x, d in zip(leaves, dtypes)]


def place_like(new, ref):
    """`new` (checked against `ref`) as a pytree of `ref`'s structure whose every leaf has the
    sharding and dtype of the leaf of `ref` it replaces. Never aliases `new`'s buffers: a trainer
    may donate or delete its params after handing them over."""
    leaves = check_params(new, ref)
    ref_leaves, treedef = jax.tree_util.tree_flatten(ref)
    to_cast = [i for i, (leaf, old) in enumerate(zip(leaves, ref_leaves))
               if jnp.dtype(leaf.dtype) != old.dtype]
    # Where each old leaf lives. An uncommitted leaf (a single-device engine's, on the default
    # device) takes an uncommitted new one (numpy, or an array computed from uncommitted inputs)
    # as uncommitted, because jit keys its compilations on commitment; a new array committed to a
    # device is moved to the old leaf's device committed, which recompiles each step shape once.
    targets = [old.sharding if old.committed or getattr(leaf, "committed", False) else None
               for leaf, old in zip(leaves, ref_leaves)]
    # A cast makes a new buffer anyway; otherwise copy, so the engine never shares the caller's.
    # One call for every leaf, so the transfers are issued together.
    cast_set = set(to_cast)
    placed = jax.device_put(leaves, targets, may_alias=[i in cast_set for i in range(len(leaves))])
    if to_cast:
        cast = _cast([placed[i] for i in to_cast], tuple(ref_leaves[i].dtype for i in to_cast))
        for i, x in zip(to_cast, cast):
            placed[i] = x
    return jax.tree_util.tree_unflatten(treedef, placed)
