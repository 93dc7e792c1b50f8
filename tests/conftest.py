"""Shared test setup: CPU, float32 matmuls at full precision, the test servers that files share (the
tiny model, the demo model, the tiny model with LoRA), and how xdist groups the files."""

import gc
import os
import shutil
import tempfile

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Mosaic GPU's interpreter runs each warpgroup as a thread whose program is a chain of blocking
# callbacks (barrier waits). XLA CPU's concurrency-optimized scheduler deadlocks it: a flash-prefill
# kernel whose consumers synchronise every step hung on a 1-2 core machine (CI has 2), inside a jit
# or even eagerly on one core, and ran with this scheduler off. It only orders CPU programs.
# The tests' programs are tiny: compiling them costs far more than running them, and LLVM's
# optimization passes are most of a CPU compile (an engine's first steps: -36 % CPU time at level
# 0). The passes do not change float results (XLA emits the same IR; LLVM may not reassociate
# float math without fast-math, which XLA CPU leaves off).
os.environ["XLA_FLAGS"] = " ".join(filter(None, [
    os.environ.get("XLA_FLAGS"), "--xla_cpu_enable_concurrency_optimized_scheduler=false",
    "--xla_backend_optimization_level=0"]))

# jax's persistent compilation cache, one per run in a fresh directory: the two xdist workers
# and the subprocesses they start (which inherit the variable) build the same tiny engines, and a
# program one of them compiled is loaded by the others (4 engine files, run twice: 36 s of CPU
# the first time, 10 s the second). Every program is kept, however fast its compile: most of the
# suite's programs take well under the default second. A run that names its own directory keeps it.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jaxinfer-tests-xla-")
    os.environ["JAXINFER_TESTS_OWN_XLA_CACHE"] = os.environ["JAX_COMPILATION_CACHE_DIR"]
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"

import jax  # noqa: E402 - after JAX_PLATFORMS, XLA_FLAGS and the cache are set

jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    """The tiny-llama server (tests/server_harness.py), started once per test process; its engine
    core runs in a process of its own, as `jaxinfer serve` runs it."""
    from server_harness import start_shared_server
    st = start_shared_server(tmp_path_factory.mktemp("tiny-llama"))
    yield st
    st.stop()


@pytest.fixture(scope="session")
def in_process_server(tmp_path_factory):
    """The tiny-llama server with the engine core in the test process (`--engine-core
    in-process`), for tests that reach into the engine's objects (fault injection)."""
    from server_harness import start_shared_server
    st = start_shared_server(tmp_path_factory.mktemp("tiny-llama-in-process"), "in-process")
    yield st
    st.stop()


@pytest.fixture(scope="session")
def demo_server():
    """The demo model behind the server (tests/server_harness.py), started once per test process."""
    from server_harness import start_demo_server
    st = start_demo_server()
    yield st
    st.stop()


@pytest.fixture(scope="session")
def lora_server(tmp_path_factory):
    """The tiny model with LoRA on behind the server (tests/lora_support.py), started once per test
    process for test_lora_server.py and test_lora_hard_edges.py."""
    from lora_support import start_lora_server
    st = start_lora_server(tmp_path_factory.mktemp("lora-server"))
    yield st
    st.stop()


@pytest.fixture(scope="session")
def client(server):
    """The official openai client on the server's "main" app."""
    import openai
    return openai.OpenAI(base_url=server.urls["main"] + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the xdist_group marks
def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` (tests/gpu/) run only where jax sees a CUDA GPU (`make test-gpu` on the
    H200); elsewhere they are skipped, so the CPU suite collects them without running them.
    Under `-n N --dist loadgroup` (`make test`), each file runs on one worker, and so do files that
    share an expensive fixture (see `_group_files`; its marks mean nothing to other runs)."""
    _group_files(items)
    if jax.devices()[0].platform == "gpu":
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _group_files(items):
    """One xdist group per file, and one per set of files joined by the project's session-scoped
    fixtures (the files using one, such as all the `server` tests). Each xdist worker builds its
    own copy of such a fixture, so spread over two workers the test servers or the
    parallel-checks subprocesses would be built twice; grouped, each is built once and its tests
    run in file order, as in a serial run. A file's tests also share what its module caches (a
    model, jitted steps: jax compiles each once per process), so split test by test over two
    workers, a file's compiles were paid twice (a sample of six engine files: -21 % CPU time).
    A file too long to leave to one worker marks its tests with `part(name)`: each part is a group
    of its own (test_parallel.py: one subprocess per part, shared through module-scoped fixtures).
    The files of a fixture in SHARDED_FIXTURES are dealt over that many groups instead (a fixture
    cheap next to its files' length: built once per shard, so on both workers)."""
    parent: dict[str, str] = {}

    def find(x: str) -> str:
        while parent.setdefault(x, x) != x:
            x = parent[x]
        return x

    for item in items:
        file = str(item.path)
        for defs in item._fixtureinfo.name2fixturedefs.values():
            fixture = defs[-1]
            if not fixture.baseid or fixture.scope not in ("package", "session"):
                continue  # pytest's and plugins' own fixtures (tmp_path_factory, ...), module ones
            parent[find(file)] = find(f"fixture:{fixture.argname}")
    shard_of = _shard_files(items, find)
    groups = {}
    for item in items:
        root = find(str(item.path))
        name = root.removeprefix("fixture:") if root.startswith("fixture:") else item.path.stem
        if str(item.path) in shard_of:
            name = f"{name}.{shard_of[str(item.path)]}"
        part = item.get_closest_marker("part")
        if part and not root.startswith("fixture:"):  # a slow file's parts, apart
            # (no "]" in a group name: xdist then takes the whole test id for the group)
            name = f"{name}.{part.args[0]}"
        item.add_marker(pytest.mark.xdist_group(name))
        groups[item] = name
    _longest_first(items, groups)


# Session fixtures cheap to build again next to the length of the files that share them: their
# files are dealt over this many groups (one fixture per worker that runs one), so that the
# longest set of files, the tiny-model server's (`server`, and `client` over it: a dozen files,
# test_server_fuzz.py among them), does not run on one worker while the other idles.
SHARDED_FIXTURES = {"server": 2, "client": 2}
# A file marked `slow` takes a minute or more; the sharded files' other tests a fraction of a
# second each: one slow file weighs as many tests.
SLOW_FILE_WEIGHT = 100


def _shard_files(items, find) -> dict[str, int]:
    """The shard of each file joined to others only through SHARDED_FIXTURES: the files of one such
    set, heaviest first (a test is 1, a slow file SLOW_FILE_WEIGHT), each to its lightest shard.
    A set that also shares an unsharded fixture (a demo server) stays whole."""
    fixtures: dict[str, set[str]] = {}
    weight: dict[str, int] = {}
    for item in items:
        file = str(item.path)
        root = find(file)
        if not root.startswith("fixture:"):
            continue
        fixtures.setdefault(root, set()).update(
            name for name, defs in item._fixtureinfo.name2fixturedefs.items()
            if defs[-1].baseid and defs[-1].scope in ("package", "session"))
        slow = item.get_closest_marker("slow") is not None
        weight[file] = max(weight.get(file, 0) + 1, SLOW_FILE_WEIGHT if slow else 0)
    shard_of = {}
    for root, names in fixtures.items():
        if not names <= SHARDED_FIXTURES.keys():
            continue
        files = sorted((f for f in weight if find(f) == root), key=lambda f: (-weight[f], f))
        loads = [0] * min(SHARDED_FIXTURES[n] for n in names)
        for file in files:
            k = loads.index(min(loads))
            shard_of[file] = k
            loads[k] += weight[file]
    return shard_of


def _longest_first(items, groups: dict) -> None:
    """Orders the groups for xdist as the longest-first rule does: a worker takes the next group
    when it is free, so a long group taken last leaves the other worker idle for its length. Groups
    holding a test marked `slow` (a file's `pytestmark`: the files that take a minute or more)
    go first, the rest by their number of tests (xdist's own order, which conftest's
    pytest_configure turns off so this one holds); a file's tests keep their order."""
    size: dict[str, int] = {}
    slow: set[str] = set()
    for item in items:
        size[groups[item]] = size.get(groups[item], 0) + 1
        if item.get_closest_marker("slow"):
            slow.add(groups[item])
    first = {}
    for i, item in enumerate(items):
        first.setdefault(groups[item], i)
    items.sort(key=lambda it: (groups[it] not in slow, -size[groups[it]], first[groups[it]]))


@pytest.fixture(scope="module")
def without_jax_persistent_cache():
    """jax's persistent compilation cache off for a module's tests, as in a process that never set
    it: jaxinfer's executable cache stores nothing while it is on, and an executable jax loaded
    from it re-serializes without its kernels' code. jax decides once per process whether the
    cache is in use (compilation_cache.is_cache_used): that decision is reset on the way in and
    out, and the executables in memory, maybe loaded from it, are dropped."""
    from jax.experimental.compilation_cache import compilation_cache
    previous = jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", None)
    compilation_cache.reset_cache()
    jax.clear_caches()
    try:
        yield
    finally:
        jax.config.update("jax_compilation_cache_dir", previous)
        compilation_cache.reset_cache()


def pytest_configure(config):
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist: keep the order set above
        config.option.loadscopereorder = False


def pytest_unconfigure(config):
    """The run's own compilation cache goes with it (the controller's, after its workers')."""
    own = os.environ.get("JAXINFER_TESTS_OWN_XLA_CACHE")
    if own and not hasattr(config, "workerinput"):
        shutil.rmtree(own, ignore_errors=True)


# XLA CPU maps each executable's code into memory regions of its own. A worker that kept every
# program of its files passed the kernel's limit of mappings per process (vm.max_map_count,
# 65,530) late in a full run: LLVM's next mmap failed and the compile segfaulted (then xdist hung).
# Three engine files alone kept 13,350 mappings, and test_hf_parity.py adds ~15,000 on its own.
# Past this many, the programs are dropped.
MAX_MAPPINGS_KEPT = 30_000


@pytest.fixture(autouse=True)
def release_executables():
    """After each test, drop jax's compiled programs if the process holds more than
    MAX_MAPPINGS_KEPT memory mappings (always where /proc cannot tell). Kept otherwise: the next
    tests and files build the same tiny engines, and compiling again costs more than running them."""
    yield
    try:
        with open(f"/proc/{os.getpid()}/maps", "rb") as maps:
            mappings = sum(1 for _ in maps)
    except OSError:
        mappings = MAX_MAPPINGS_KEPT + 1
    if mappings > MAX_MAPPINGS_KEPT:
        jax.clear_caches()
        gc.collect()
