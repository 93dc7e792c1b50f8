"""On-disk cache of compiled step executables, so a warm start neither traces, lowers nor compiles
its step buckets: it deserializes them (`jax.experimental.serialize_executable`).

jax's persistent compilation cache is keyed by the lowered HLO, so reaching it still costs tracing
and lowering every shape (most of a warm start). This cache is consulted *before* tracing, so its key
must name everything that can change the executable without the caller noticing:
- the step: its name and the static arguments (model config, attention backend, block size,
  sampler variant, loop length);
- every input's shape, dtype and sharding (hence the KV cache's blocks, the buckets, the mesh);
- the code that traces it: a digest of the jaxinfer and pallas_kernels sources;
- the compiler: jax and jaxlib versions, platform, platform version, device kind, device count,
  x64 mode, default matmul precision, $XLA_FLAGS.
A changed part is a miss (a new entry), never a wrong executable. Entries are written atomically;
one that fails to load is treated as a miss. Loading unpickles: only point it at a directory you
trust (it is the user's own cache directory).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import pickle
import re
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from jax.experimental import serialize_executable

log = logging.getLogger(__name__)

_SOURCE_PACKAGES = ("jaxinfer", "pallas_kernels")
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


@functools.lru_cache(maxsize=None)
def source_digest() -> str:
    """sha256 over the Python sources of the packages that trace a step (a few ms)."""
    h = hashlib.sha256()
    for pkg in _SOURCE_PACKAGES:
        root = Path(__import__(pkg).__file__).resolve().parent
        for path in sorted(root.rglob("*.py")):
            h.update(str(path.relative_to(root)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def compiler_identity() -> tuple:
    dev = jax.devices()[0]
    return (jax.__version__, jax.lib.__version__, dev.platform, dev.client.platform_version,
            getattr(dev, "device_kind", ""), jax.device_count(), jax.config.jax_enable_x64,
            str(jax.config.jax_default_matmul_precision), os.environ.get("XLA_FLAGS", ""))


def _sharding_signature(sharding) -> str:
    """The sharding with its devices, in mesh order: a sharding's repr names the mesh's axes but
    not its devices, and two data-parallel replicas differ only in those."""
    if sharding is None:
        return "None"
    mesh = getattr(sharding, "mesh", None)
    ids = (mesh.device_ids.tolist() if mesh is not None
           else sorted(d.id for d in sharding.device_set))
    return f"{sharding!r}@{ids}"


def _leaf_signature(leaf) -> str:
    sharding = _sharding_signature(getattr(leaf, "sharding", None))
    committed = getattr(leaf, "committed", None)
    return f"{jnp.shape(leaf)}:{jnp.result_type(leaf)}:{sharding}:{committed}"


def stable_repr(obj) -> str:
    """repr without memory addresses: functions (a backend's kernels) are named by module and
    qualified name, which with the source digest pins their code."""
    return _ADDRESS.sub("", repr(obj))


def step_key(name: str, static: tuple, args: tuple) -> str:
    """The cache key of compiling step `name` with static arguments `static` for inputs `args`."""
    leaves, treedef = jax.tree_util.tree_flatten(args)
    parts = (name, stable_repr(static), str(treedef), [_leaf_signature(x) for x in leaves],
             source_digest(), compiler_identity())
    return hashlib.sha256(repr(parts).encode()).hexdigest()


class ExecutableCache:
    @classmethod
    def under(cls, compilation_cache_dir: str | None) -> "ExecutableCache | None":
        """The cache of `--compilation-cache-dir` (its `executables/`); None when that is off."""
        return cls(Path(compilation_cache_dir) / "executables") if compilation_cache_dir else None

    def __init__(self, directory: str | os.PathLike):
        self.dir = Path(directory)
        self.hits = 0
        self.misses = 0
        self.load_seconds = 0.0   # reading and deserializing hits
        self.store_seconds = 0.0  # serializing and writing new entries, summed over threads
        self._lock = threading.Lock()
        self._warned_persistent = False

    def _path(self, key: str) -> Path:
        return self.dir / f"{key}.exe"

    def has(self, key: str) -> bool:
        return self._path(key).exists()

    def load(self, key: str) -> jax.stages.Compiled | None:
        start = time.perf_counter()
        try:
            return self._load(key)
        finally:
            self.load_seconds += time.perf_counter() - start

    def _load(self, key: str) -> jax.stages.Compiled | None:
        path = self._path(key)
        if not path.exists():
            self.misses += 1
            return None
        try:
            blob, in_tree, out_tree, device_ids = pickle.loads(path.read_bytes())
            by_id = {d.id: d for d in jax.devices()}
            # Onto exactly its own devices, in order: the default (every device of the backend)
            # aborts the process for an executable of a sub-mesh.
            exe = serialize_executable.deserialize_and_load(
                blob, in_tree, out_tree, execution_devices=[by_id[i] for i in device_ids])
        except Exception as e:  # a truncated or stale entry: recompile and overwrite it
            log.warning("executable cache entry %s unreadable (%r); recompiling", path.name, e)
            self.misses += 1
            return None
        self.hits += 1
        return exe

    def load_figure(self, key: str) -> int | None:
        """A number measured from a compiled step (the memory planner's activation bytes), so a
        warm start need not compile that step again; None when absent or unreadable."""
        try:
            return int(self._path(key).with_suffix(".figure").read_text())
        except (OSError, ValueError):
            return None

    def store_figure(self, key: str, value: int) -> None:
        path = self._path(key).with_suffix(".figure")
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            tmp.write_text(str(int(value)))
            os.replace(tmp, path)
        except OSError as e:
            log.warning("figure not cached (%s): %r", key[:12], e)

    def store(self, key: str, compiled: jax.stages.Compiled) -> None:
        """Thread-safe (warm-up stores from its compile threads). Stores nothing while jax's
        persistent compilation cache is on: `compiled` may then be a copy jax loaded from it, and
        such a copy serializes without its kernels' code (it fails when run after loading)."""
        if jax.config.jax_compilation_cache_dir and jax.config.jax_enable_compilation_cache:
            if not self._warned_persistent:
                log.warning("executable cache not written: jax's persistent compilation cache is on")
                self._warned_persistent = True
            return
        start = time.perf_counter()
        try:
            self._store(key, compiled)
        finally:
            with self._lock:
                self.store_seconds += time.perf_counter() - start

    def _store(self, key: str, compiled: jax.stages.Compiled) -> None:
        # A failed write (a backend or kernel that cannot serialize, a full disk) costs the next
        # start its compile, never this start.
        tmp = self._path(key).with_suffix(f".tmp{os.getpid()}")
        try:
            device_ids = [d.id for d in compiled.runtime_executable().local_devices()]
            data = pickle.dumps((*serialize_executable.serialize(compiled), device_ids))
            self.dir.mkdir(parents=True, exist_ok=True)
            tmp.write_bytes(data)
            os.replace(tmp, self._path(key))
        except Exception as e:
            log.warning("executable not cached (%s): %r", key[:12], e)
            with contextlib.suppress(OSError):
                tmp.unlink()
