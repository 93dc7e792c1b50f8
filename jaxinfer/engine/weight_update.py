"""Checking and placing a new params pytree so it can replace the engine's weights in place.

The compiled step executables take the params as an argument, so new weights need no recompilation
as long as every leaf keeps the shape, dtype and sharding the executables were compiled for.
`check_params` refuses anything else, naming the parameter's path; `place_like` moves each leaf to
the sharding of the leaf it replaces (device to device for arrays already on devices, host numpy
copied on parallel threads; uncommitted leaves stay uncommitted, see there), casts it to that
leaf's dtype on the device and can free each old leaf as its replacement lands.
"""

from __future__ import annotations

import concurrent.futures
import functools
import os

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
def _cast(x: jax.Array, dtype) -> jax.Array:
    return x.astype(dtype)


class PartialUpdateError(JaxinferError, RuntimeError):
    """Placing the new weights failed after some old leaves were already freed: `params` holds the
    new leaves placed so far and the old ones elsewhere (a usable tree of mixed versions)."""

    def __init__(self, message: str, params):
        super().__init__(message)
        self.params = params


def _transfer_threads(num_leaves: int) -> int:
    # Host -> device copies of separate leaves proceed in parallel (each stages through host
    # memory on its own thread); more threads than cores only contend.
    return max(1, min(num_leaves, os.cpu_count() or 1, 16))


def place_like(new, ref, *, release_old: bool = False, threads: int | None = None):
    """`new` (checked against `ref`) as a pytree of `ref`'s structure whose every leaf has the
    sharding and dtype of the leaf of `ref` it replaces. Never aliases `new`'s buffers: a trainer
    may donate or delete its params after handing them over.

    Each leaf goes on its own worker thread (`threads`, default one per core up to 16): straight to
    the old leaf's sharding, in the dtype it comes in (the cast to the engine's dtype runs on the
    device, not in host memory). `release_old` frees each old leaf as soon as its replacement is
    placed, so the update needs about one leaf of extra device memory rather than a second copy
    of the weights; only for weights no one else holds (the engine's own)."""
    leaves = check_params(new, ref)
    ref_leaves, treedef = jax.tree_util.tree_flatten(ref)

    def place(i: int) -> jax.Array:
        leaf, old = leaves[i], ref_leaves[i]
        cast = jnp.dtype(leaf.dtype) != old.dtype
        # Where the old leaf lives. An uncommitted leaf (a single-device engine's, on the default
        # device) takes an uncommitted new one (numpy, or an array computed from uncommitted
        # inputs) as uncommitted, because jit keys its compilations on commitment; a new array
        # committed to a device is moved to the old leaf's device committed, which recompiles each
        # step shape once.
        target = old.sharding if old.committed or getattr(leaf, "committed", False) else None
        # A cast makes a new buffer anyway; otherwise copy, so the engine never shares the caller's.
        x = jax.device_put(leaf, target, may_alias=cast)
        if cast:
            x = _cast(x, old.dtype)
        if release_old:
            x.block_until_ready()  # (the old leaf goes only once the new one is in place)
            old.delete()
        return x

    with concurrent.futures.ThreadPoolExecutor(threads or _transfer_threads(len(leaves))) as pool:
        futures = [pool.submit(place, i) for i in range(len(leaves))]
    failed = [(i, f.exception()) for i, f in enumerate(futures) if f.exception() is not None]
    if not failed:
        return jax.tree_util.tree_unflatten(treedef, [f.result() for f in futures])
    i, error = failed[0]
    path = jax.tree_util.keystr(jax.tree_util.tree_flatten_with_path(ref)[0][i][0])
    message = (f"placing params{path} failed ({len(failed)} of {len(leaves)} parameter(s) "
               f"failed): {error!r}")
    if not release_old:  # the old weights are untouched
        raise RuntimeError(message) from error
    mixed = [ref_leaves[i] if f.exception() is not None else f.result()
             for i, f in enumerate(futures)]
    raise PartialUpdateError(message + "; the engine holds the new parameters placed so far and "
                             "the old ones elsewhere", jax.tree_util.tree_unflatten(treedef, mixed)
                             ) from error
