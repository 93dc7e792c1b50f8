"""LoRA against a hostile client: an adapter with non-finite weights or scaling is refused, and a
slot that holds NaN anyway never reaches a row of another slot (both delta paths, and the server's
greedy text); a catastrophic `target_modules` regex is refused within 2 s while /health answers;
paths, numbers, nesting and names the OS or the parser would choke on get a 400 naming the field
and register nothing."""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.model.config import load_config
from jaxinfer.model.lora.delta import lora_delta, lora_delta_gather
from jaxinfer.model.lora.peft import (LoRAAdapter, LoRAAdapterError, adapter_from_tensors,
                                      peft_tensors)
from jaxinfer.model.lora.target_regex import TargetRegexError, fullmatches
from lora_support import PATHOLOGICAL, random_adapter
from pallas_kernels.lora.segment_matmul import lora_shrink_expand, segment_plan
from server_harness import (FIXTURE, MODEL, check_error_shape,
                            post_raw, raw_json)

# ---- the delta: a NaN slot stays in its own rows --------------------------------------------
def _stacks(rng, n: int, fan_in: int, rank: int, fan_out: int):
    a = jnp.asarray(rng.normal(size=(n + 1, fan_in, rank)), jnp.float32).at[0].set(0)
    b = jnp.asarray(rng.normal(size=(n + 1, rank, fan_out)), jnp.float32).at[0].set(0)
    return a, b


def test_xla_delta_keeps_non_finite_slots_out_of_other_rows():
    """Slot 2 NaN in A and B, slot 3 inf in B: the rows of slots 0 and 1 (and an unused slot 4's
    garbage) get exactly what they get with clean stacks; slot 0's rows exactly zero."""
    rng = np.random.default_rng(0)
    a, b = _stacks(rng, 4, 24, 8, 40)
    poisoned_a = a.at[2].set(jnp.nan).at[4].set(jnp.nan)
    poisoned_b = b.at[2].set(jnp.nan).at[3].set(jnp.inf).at[4].set(-jnp.inf)
    slot = jnp.asarray(rng.choice([0, 1, 2, 3], 33), jnp.int32)
    x = jnp.asarray(rng.normal(size=(33, 24)), jnp.float32)
    got = np.asarray(jax.jit(lora_delta)(x, poisoned_a, poisoned_b, slot))
    clean = np.asarray(lora_delta_gather(x, a, b, slot))
    others = np.isin(np.asarray(slot), [0, 1])
    np.testing.assert_allclose(got[others], clean[others], rtol=1e-5, atol=1e-5)
    assert not got[np.asarray(slot) == 0].any()


def test_pallas_kernels_keep_a_nan_slot_out_of_other_rows():
    """The kernels (interpreted) with slot 2 all NaN and used by some rows of the step: every row
    of slots 0 and 1 equals the clean XLA path (y of slot 0 untouched)."""
    rng = np.random.default_rng(1)
    a, b = _stacks(rng, 3, 32, 16, 32)
    slot = jnp.asarray(rng.choice([0, 1, 2], 20), jnp.int32)
    x = jnp.asarray(rng.normal(size=(20, 32)), jnp.float32)
    y = jnp.asarray(rng.normal(size=(20, 32)), jnp.float32)
    plan = segment_plan(slot, 4, 16)
    got = np.asarray(lora_shrink_expand(x, a.at[2].set(jnp.nan), b.at[2].set(jnp.nan), y, plan,
                                        interpret=True))
    clean = np.asarray(y + lora_delta(x, a, b, slot))
    others = np.asarray(slot) != 2
    np.testing.assert_allclose(got[others], clean[others], rtol=1e-5, atol=1e-5)
    assert np.isnan(got[~others]).all()  # the poisoned slot did run on its own rows


def test_update_lora_tensors_with_nan_are_refused():
    cfg = load_config(FIXTURE)
    tensors = peft_tensors(random_adapter(cfg, 4, 1))
    name = next(iter(tensors))
    tensors[name] = tensors[name].copy()
    tensors[name][0, 0] = np.nan
    with pytest.raises(LoRAAdapterError, match="NaN") as e:
        adapter_from_tensors(tensors, cfg, 4, 2.0, "x")
    assert e.value.param == "lora_path"


def test_regex_targets_match_as_re_fullmatch_in_a_time_limited_child():
    paths = [f"model.layers.{i}.{block}.{proj}" for i in (0, 11)
             for block, proj in (("self_attn", "q_proj"), ("self_attn", "v_proj"), ("mlp", "up_proj"))]
    pattern = r".*\.1\d\.self_attn\.(q|v)_proj"
    assert fullmatches(pattern, paths) == [re.fullmatch(pattern, p) is not None for p in paths]
    with pytest.raises(TargetRegexError, match="not a valid regex"):
        fullmatches("(q_proj", paths)
    with pytest.raises(TargetRegexError, match="characters long"):
        fullmatches("a" * 1001, paths)
    start = time.monotonic()
    with pytest.raises(TargetRegexError, match="within 0.5 s"):
        fullmatches(PATHOLOGICAL, paths, timeout_s=0.5)
    assert time.monotonic() - start < 1.5


# ---- the server --------------------------------------------------------------------------------
def _models(url: str) -> list[str]:
    with urllib.request.urlopen(url + "/v1/models", timeout=30) as r:
        return sorted(m["id"] for m in json.loads(r.read())["data"])


def _text(url: str, model: str) -> str:
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0,
            "ignore_eos": True}
    status, _, raw = post_raw(url, "/v1/completions", raw_json(body))
    assert status == 200, raw
    return json.loads(raw)["choices"][0]["text"]


def _load(st, name, path: str) -> tuple[int, bytes]:
    body = {"lora_name": name, "lora_path": str(st.paths.get(path, path))}
    status, _, raw = post_raw(st.urls["main"], "/v1/load_lora_adapter", raw_json(body))
    return status, raw


def _assert_refused_and_nothing_registered(st, status, raw, param, before) -> None:
    assert status == 400, raw
    check_error_shape(raw, 400, param)
    assert _models(st.urls["main"]) == before

    async def names():
        return st.engine.engine.lora.names()
    assert sorted(st.call(names())) == sorted(n for n in before if n != MODEL)


@pytest.mark.parametrize("path, param", [
    ("nan", "lora_path"), ("inf", "lora_path"), ("alpha", "lora_alpha"),
    ("alpha_nan", "lora_alpha"), ("rslora", "lora_alpha"), ("huge_b", "lora_alpha"),
])
def test_non_finite_adapters_are_refused(lora_server, path, param):
    before = _models(lora_server.urls["main"])
    status, raw = _load(lora_server, "x", path)
    _assert_refused_and_nothing_registered(lora_server, status, raw, param, before)


@pytest.mark.parametrize("name, path, param", [
    ("x", "/" + "a" * 300, "lora_path"),
    ("x", "/a" * 3000, "lora_path"),
    ("x", "/tmp/\0nul", "lora_path"),
    ("x", "/tmp/\ud800", "lora_path"),
    ("x", "digits", "r"),
    ("x", "deep", "lora_path"),
    ("x", "deepish", "modules_to_save"),  # parsed, but never repr'd in full
    ("\ud800", "good", "lora_name"),
    ("a\nb", "good", "lora_name"),
    ("n" * 300, "good", "lora_name"),
    (7, "good", "lora_name"),
], ids=["component-past-NAME_MAX", "path-past-PATH_MAX", "NUL-in-path", "surrogate-in-path",
        "5000-digit-r", "nested-100k", "nested-900", "surrogate-name", "control-char-name",
        "long-name", "int-name"])
def test_former_500s_are_400s_naming_the_field_and_register_nothing(lora_server, name, path,
                                                                     param):
    before = _models(lora_server.urls["main"])
    status, raw = _load(lora_server, name, path)
    _assert_refused_and_nothing_registered(lora_server, status, raw, param, before)


def test_a_weights_file_larger_than_any_adapter_is_refused_unread(lora_server):
    before = _models(lora_server.urls["main"])
    status, raw = _load(lora_server, "x", "oversized")
    _assert_refused_and_nothing_registered(lora_server, status, raw, "lora_path", before)
    assert "a rank-4 adapter of this model is at most" in json.loads(raw)["error"]["message"]


def test_unloading_a_bad_name_is_a_400(lora_server):
    url = lora_server.urls["main"]
    for name in ("\ud800", "x" * 300, ["good"]):
        status, _, raw = post_raw(url, "/v1/unload_lora_adapter", raw_json({"lora_name": name}))
        check_error_shape(raw, 400, "lora_name")
    status, _, raw = post_raw(url, "/v1/unload_lora_adapter",
                              b'{"lora_name": "good", "lora_int_id": ' + b"9" * 5000 + b"}")
    assert status == 400, raw  # the body parser's refusal of a 5,000-digit integer
    assert "good" in _models(url)


def test_pathological_target_modules_is_refused_within_2s_while_health_answers(lora_server):
    url = lora_server.urls["main"]
    before = _models(url)
    result, answered = {}, []

    def load():
        start = time.monotonic()
        result["status"], result["raw"] = _load(lora_server, "slow", "slow_regex")
        result["seconds"] = time.monotonic() - start

    loader = threading.Thread(target=load)
    loader.start()
    while loader.is_alive():
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            answered.append(r.status)
        time.sleep(0.05)
    loader.join()
    assert result["seconds"] < 2.0, result
    assert answered and set(answered) == {200}
    error = check_error_shape(result["raw"], 400, "target_modules")
    assert "within" in error["message"]
    _assert_refused_and_nothing_registered(lora_server, result["status"], result["raw"],
                                           "target_modules", before)
    status, raw = _load(lora_server, "regex", "regex")  # a plain regex still works
    assert status == 200, raw
    assert _text(url, "regex") != _text(url, MODEL)
    post_raw(url, "/v1/unload_lora_adapter", raw_json({"lora_name": "regex"}))


def test_a_nan_slot_leaves_the_base_model_and_other_adapters_unchanged(lora_server):
    """NaN forced into a loaded adapter's slot (past every check, as a bug would): requests of the
    base model and of another adapter, in the same steps as the poisoned one and after it, give
    the greedy text they gave before."""
    st, url = lora_server, lora_server.urls["main"]
    base, good = _text(url, MODEL), _text(url, "good")
    assert _load(st, "victim", "victim")[0] == 200
    _text(url, "victim")  # now in a slot
    cfg = st.cfg
    nan = LoRAAdapter("victim", 4, 1.0, {
        key: (np.full_like(a, np.nan), np.full_like(b, np.nan))
        for key, (a, b) in random_adapter(cfg, 4, 2).weights.items()})

    def poison():
        engine = st.engine.engine
        engine._write_lora_slot(engine.lora.slot_of("victim"), nan)
    st.call(st.engine._on_engine_thread(poison))
    with ThreadPoolExecutor(3) as pool:
        mixed = list(pool.map(lambda m: _text(url, m), [MODEL, "good", "victim", MODEL]))
    assert mixed[0] == mixed[3] == base and mixed[1] == good
    assert mixed[2] != base  # the slot did hold NaN: its own rows show it
    status, _, raw = post_raw(url, "/v1/unload_lora_adapter", raw_json({"lora_name": "victim"}))
    assert status == 200, raw
    assert [_text(url, MODEL), _text(url, "good")] == [base, good]
