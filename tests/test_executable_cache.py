"""The executable cache (jaxinfer/worker/executable_cache.py): a warm start loads every forward,
decode loop, sampler and block copy instead of tracing and compiling them, with greedy tokens identical to a
compiled start; anything that shapes a step (a flag, the model config) is a miss, never a wrong executable; an
unreadable entry is a miss."""

from __future__ import annotations

import dataclasses
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.sampling_params import SamplingParams
from jaxinfer.worker.executable_cache import stable_repr, step_key
from test_engine_support import make_engine, prompt_ids, run_all, tiny_model

GREEDY = dict(temperature=0.0, ignore_eos=True)
WORKLOAD = [(prompt_ids(300 + i, 3 + 5 * i), 6 + i) for i in range(5)]


@pytest.fixture(scope="module", autouse=True)
def no_persistent_cache(without_jax_persistent_cache):
    """These tests store executables: jax's persistent cache (tests/conftest.py) off here."""


@pytest.fixture(autouse=True)
def fresh_process_compiles(no_persistent_cache):
    """Each test here starts as a fresh process would: with jax's in-memory executables dropped.
    Otherwise an engine an earlier test built with the same shapes hands its samplers over, and
    XLA CPU cannot serialize a sort that has already run ("`LessThan` is not serializable"), so
    they are not stored and the counts depend on which tests ran before in this process."""
    jax.clear_caches()


def greedy_tokens(engine) -> list[list[int]]:
    for i, (prompt, n) in enumerate(WORKLOAD):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=n, **GREEDY))
    out = run_all(engine)
    return [out[f"r{i}"][0][0] for i in range(len(WORKLOAD))]


def cached_engine(tmp_path, **kwargs):
    return make_engine(warmup=True, compilation_cache_dir=str(tmp_path), decode_steps_per_call=4,
                       **kwargs)


@pytest.fixture(scope="module")
def cold(tmp_path_factory, no_persistent_cache):
    """A cold start's engine over a new cache directory, built once for the tests below; they
    read the directory or work on copies of it (it is built before the autouse fixture runs)."""
    jax.clear_caches()
    return cached_engine(tmp_path_factory.mktemp("cold"))


def copy_of(engine, tmp_path):
    shutil.copytree(engine.runner.executable_cache.dir, tmp_path / "executables")
    return tmp_path


def test_warm_start_loads_every_step_and_keeps_greedy_tokens(cold, tmp_path):
    cache = cold.runner.executable_cache
    r = cold.runner
    stored = sum(map(len, r.programs.compiled.values()))
    # 3 variants per sequence bucket
    assert len(r.programs.compiled["packed sample"]) == 3 * len(r.buckets.decode_buckets)
    assert cache.hits == 0 and cache.misses == stored
    assert len(list(cache.dir.glob("*.exe"))) == stored
    expected = greedy_tokens(cold)

    warm = cached_engine(cache.dir.parent)
    assert warm.runner.executable_cache.hits == stored
    assert warm.runner.executable_cache.misses == 0
    assert greedy_tokens(warm) == expected
    assert warm.runner.num_dispatches > 0

    # A truncated entry is recompiled (and rewritten), the others still load.
    copy_of(cold, tmp_path)
    victim = sorted((tmp_path / "executables").glob("*.exe"))[0]
    victim.write_bytes(victim.read_bytes()[:100])
    again = cached_engine(tmp_path)
    assert (again.runner.executable_cache.hits, again.runner.executable_cache.misses) == \
        (stored - 1, 1)
    assert greedy_tokens(again) == expected


def test_a_flag_that_shapes_the_step_misses(cold, tmp_path):
    # decode_steps_per_call is a static argument of the decode loop: its loops miss, the
    # forwards and samplers (which it does not shape) still load.
    other = make_engine(warmup=True, compilation_cache_dir=str(copy_of(cold, tmp_path)),
                        decode_steps_per_call=2)
    runner = other.runner
    compiled = runner.programs.compiled
    assert runner.executable_cache.hits == (len(compiled["packed forward"])
                                            + len(compiled["packed sample"]) + len(compiled["copy"]))
    assert runner.executable_cache.misses == len(compiled["decode loop"]) > 0


def test_key_covers_config_inputs_and_statics():
    cfg, params = tiny_model()
    args = (params, np.zeros((4, 8), np.float32))
    base = step_key("mixed 16", (cfg, 4), args)
    assert step_key("mixed 16", (cfg, 4), args) == base  # deterministic
    # Same shapes, another model config value (traced into the step): a miss.
    eps = dataclasses.replace(cfg, rms_norm_eps=cfg.rms_norm_eps * 2)
    assert step_key("mixed 16", (eps, 4), args) != base
    assert step_key("mixed 16", (cfg, 8), args) != base
    assert step_key("mixed 32", (cfg, 4), args) != base
    assert step_key("mixed 16", (cfg, 4), (params, np.zeros((4, 9), np.float32))) != base
    assert step_key("mixed 16", (cfg, 4), (params, np.zeros((4, 8), np.int32))) != base
    assert step_key("mixed 16", (cfg, 4), (params, jnp.zeros((4, 8), jnp.float32))) != base


def test_stable_repr_drops_addresses():
    def kernel():
        return None
    assert "0x" not in stable_repr((kernel, object()))
    assert "kernel" in stable_repr(kernel)


def test_a_failed_write_is_only_a_miss(tmp_path):
    """Storing never fails a start: here the cache directory cannot be created."""
    from jaxinfer.worker.executable_cache import ExecutableCache
    blocker = tmp_path / "file"
    blocker.write_text("")
    cache = ExecutableCache(blocker / "executables")
    compiled = jax.jit(lambda x: x + 1).lower(np.zeros(3, np.float32)).compile()
    cache.store("k", compiled)
    assert cache.load("k") is None and cache.misses == 1
    ok = ExecutableCache(tmp_path / "ok")
    ok.store("k", compiled)
    assert np.array_equal(ok.load("k")(np.ones(3, np.float32)), np.full(3, 2, np.float32))


def test_nothing_is_stored_while_jax_persistent_cache_is_on(tmp_path):
    """An executable jax loaded from its persistent cache re-serializes without its kernels' code
    (XLA CPU: "Function ... not found" when the stored copy runs), so with that cache on the
    executable cache writes nothing; building an engine never turns it on."""
    from jaxinfer.worker.executable_cache import ExecutableCache
    compiled = jax.jit(lambda x: x * 3).lower(np.zeros(3, np.float32)).compile()
    cache = ExecutableCache(tmp_path / "exe")
    previous = jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "xla"))
    try:
        cache.store("k", compiled)
    finally:
        jax.config.update("jax_compilation_cache_dir", previous)
    assert not (tmp_path / "exe").exists()
    cache.store("k", compiled)
    assert np.array_equal(cache.load("k")(np.ones(3, np.float32)), np.full(3, 3, np.float32))
    from pathlib import Path

    from jaxinfer.engine.args import EngineArgs
    from jaxinfer.engine.llm_engine import LLMEngine
    llama = Path(__file__).parent / "fixtures" / "models" / "llama"
    engine = LLMEngine.from_engine_args(EngineArgs(
        model=str(llama), dtype="float32", num_blocks=16, block_size=4, max_model_len=64, max_num_seqs=2,
        max_num_batched_tokens=16, warmup=False, compilation_cache_dir=str(tmp_path / "flags")))
    assert engine.runner.executable_cache is not None
    assert jax.config.jax_compilation_cache_dir == previous


def test_the_planners_activation_figure_is_cached(tmp_path):
    from jaxinfer.worker.executable_cache import ExecutableCache
    from jaxinfer.worker.activation_bytes import step_activation_bytes
    from jaxinfer.model.kernel_table import REFERENCE_KERNELS
    from test_engine_features import counting_compilations
    cfg, params = tiny_model()
    cache = ExecutableCache(tmp_path)

    def plan(cache, max_num_seqs=8):
        return step_activation_bytes(cfg, params, REFERENCE_KERNELS, kv_dtype=jnp.float32,
                                     block_size=4, max_model_len=64, max_num_seqs=max_num_seqs,
                                     max_num_batched_tokens=32, cache=cache)

    first = plan(cache)
    assert first > 0 and len(list(tmp_path.glob("*.figure"))) == 1
    with counting_compilations() as compilations:
        assert plan(cache) == first
        assert compilations[0] == 0  # read back, not compiled
    plan(cache, max_num_seqs=4)  # another step shape: a new figure
    assert len(list(tmp_path.glob("*.figure"))) == 2


def test_a_warm_start_is_ready_with_every_cached_bucket(cold):
    """Issue 38: every bucket the cache holds is loaded before ready, so a warm start after one
    complete start (or `jaxinfer warmup`) runs nothing in the background beside its first steps."""
    warm = cached_engine(cold.runner.executable_cache.dir.parent, background_compile=True)
    compiler = warm.runner.compiler
    assert compiler.num_ready == compiler.num_units and compiler._thread is None
