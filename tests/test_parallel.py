"""Tensor and data parallelism (jaxinfer/parallel/): greedy tokens identical across mesh sizes for
every family, weights loaded into their shards, DP replicas, the two-process TP = 2 run, and the
flags' refusals.

The multi-device checks run in subprocesses: tests/parallel_checks.py with 8 CPU devices, and two
tests/multihost_worker.py processes (one CPU device each) joined through jax.distributed on
localhost. They run in parts (PARTS), one subprocess each, whose tests are marked `part`: under
`make test` each part is an xdist group of its own, so the two workers share the minutes they take.
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from jaxinfer.errors import ConfigError
from jaxinfer.model.config import config_from_dict, load_config
from jaxinfer.parallel.distributed import distributed_settings
from jaxinfer.parallel.sharding import validate_parallel_sizes

pytestmark = pytest.mark.slow  # minutes on the CI machine: xdist starts its groups first (conftest.py)

HERE = Path(__file__).resolve().parent
FIXTURES = HERE / "fixtures" / "models"
FAMILIES = ["llama", "qwen2", "mixtral", "qwen3_moe"]  # (parallel_checks.py: why not mistral, qwen3)
TIMEOUT_S = 600
# The checks of tests/parallel_checks.py each part runs, split so the parts take similar times
# (20-60 s each on one core). Each TP = 2 run on the llama fixture is compared with the same
# engine on one device in its own part (llama_tp1_checks; engine_checks runs it). The sampler
# and speculation checks share a part: the speculating engines reuse the TP = 2 forwards the
# sampler's engines compiled.
PARTS = {"models": ["model_checks", "hybrid_checks"],
         "engine": ["shard_checks", "engine_checks"],
         "sampler_spec": ["llama_tp1_checks", "sampler_layout_checks", "spec_decode_checks",
                          "mtp_checks"],
         "cache_lora": ["executable_cache_checks", "lora_checks", "quant_shard_checks"]}
models, engine, sampler_spec, cache_lora = (pytest.mark.part(name) for name in PARTS)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _result(proc: subprocess.Popen, marker: str = "") -> dict:
    out, err = proc.communicate(timeout=TIMEOUT_S)
    assert proc.returncode == 0, err[-4000:]
    line = [line for line in out.splitlines() if line.startswith(marker + "{")][-1]
    return json.loads(line[len(marker):])


def _env(persistent_cache: bool = True) -> dict:
    env = {**os.environ, "PYTHONPATH": str(HERE.parent)}
    env.pop("XLA_FLAGS", None)
    if not persistent_cache:  # (conftest.py turns jax's on for the run)
        env.pop("JAX_COMPILATION_CACHE_DIR", None)
    return env


def _start(script: str, *args: str, persistent_cache: bool = True) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(HERE / script), *args], env=_env(persistent_cache),
                            text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _run_part(part: str, with_hosts: bool = False) -> dict:
    # The executable cache's checks store executables, which it refuses to do while jax's
    # persistent cache is on; the two processes of one TP run stay out of it too (each would
    # read what the other wrote mid-run).
    procs = [_start("parallel_checks.py", *PARTS[part],
                    persistent_cache=part != "cache_lora")]
    if with_hosts:
        port = str(_free_port())
        procs += [_start("multihost_worker.py", port, str(i), persistent_cache=False)
                  for i in range(2)]
    try:
        checks = _result(procs[0], "RESULT ")
        if with_hosts:
            checks["hosts"] = [_result(w) for w in procs[1:]]
        return checks
    finally:
        for p in procs:
            p.kill()


@pytest.fixture(scope="module")
def models_run() -> dict:
    return _run_part("models")


@pytest.fixture(scope="module")
def engine_run() -> dict:
    return _run_part("engine", with_hosts=True)


@pytest.fixture(scope="module")
def sampler_spec_run() -> dict:
    return _run_part("sampler_spec")


@pytest.fixture(scope="module")
def cache_lora_run() -> dict:
    return _run_part("cache_lora")


@cache_lora
def test_lora_tp2_and_dp2_equal_single_device(cache_lora_run):
    """An adapter row and a base row in one batch, under TP = 2 and over two data-parallel
    replicas (lora_parallel_checks.py)."""
    checks = cache_lora_run
    assert checks["lora/tp2"] == checks["lora/dp2"] == checks["lora/tp1"]
    assert checks["lora/tp2_impl"] == "xla"  # --lora-impl pallas under TP runs the XLA path
    assert checks["lora/tp1"][2] == checks["lora/base"]
    assert checks["lora/dp2_replicas"] == [True, True]  # each replica served the adapter
    *loaded, new_id = checks["lora/dp2_loaded"]
    assert loaded[0] == loaded[1] and ["b", new_id] in loaded[0]
    assert checks["lora/dp2_removed"] == [["a"], ["a"]]
    assert checks["lora/tp1"][0] != checks["lora/base"]  # the adapter row is not the base model's


@cache_lora
def test_fp8_sharded_loading_equals_single_device_and_scales_follow_their_weights(cache_lora_run):
    """TP = 2: FP8 params quantized on load (safetensors and dummy) equal the single-device ones
    (the row-parallel channel maximum is reduced across the shards), and each device holds its
    slice of every weight and scale (parallel_checks.py, quant_shard_checks)."""
    res = {k.removeprefix("quant/"): v for k, v in cache_lora_run.items() if k.startswith("quant/")}
    assert len(res) == 3
    for name, r in res.items():
        assert r["equal"], name
    s = res["llama/safetensors"]["shards"]  # hidden 64, q 4 x 16, kv 2 x 16, intermediate 128
    assert s["layers_0/attn/q_proj/weight"] == [32, 64] and s["layers_0/attn/q_proj/weight_scale"] == [32]
    assert s["layers_0/attn/o_proj/weight"] == [64, 32] and s["layers_0/attn/o_proj/weight_scale"] == [64]
    assert s["layers_0/mlp/down_proj/weight"] == [64, 64]
    m = res["qwen3_moe/safetensors"]["shards"]
    assert m["layers_0/moe/w_gate"][2] * 2 == 24 and m["layers_0/moe/w_gate_scale"] == [8, 12]
    assert m["layers_0/moe/w_down_scale"] == [8, 64]


@models
@pytest.mark.parametrize("family", FAMILIES)
def test_tp_greedy_tokens_equal_single_device(models_run, family):
    """Every family at TP = 2 (mistral and qwen3: their layers are llama's and qwen3_moe's); KV
    heads replicated over more devices than there are: test_tp8_on_eight_heads_equals_tp1
    (tests/parallel_checks.py, model_checks)."""
    golden = np.load(FIXTURES / family / "golden.npz")["greedy_tokens"]
    got = models_run[f"{family}/tp2"]["tokens"]
    assert got == golden[:len(got)].tolist()  # TP = 1 gives the golden tokens (test_hf_parity)


@models
@pytest.mark.parametrize("family", ["granitemoehybrid", "qwen3_next"])
def test_hybrid_families_at_tp2_equal_single_device(models_run, family):
    """Granite 4.0-H (Mamba-2) and Qwen3-Next (Gated DeltaNet) at TP = 2, each device keeping its
    state-space heads' states in its shard of the pages (tests/hybrid_parallel_checks.py): HF's
    token and logprob, which one device gives (test_hybrid_prefix_cache.py), after a prompt
    prefilled in chunks and again from the prefix cache; HF's greedy tokens decoding. No collective
    of the forwards moves more than a [rows, hidden] activation, and the only gathers are
    Mamba-2's B and C ([rows, groups x state]), so no state page is gathered. Disaggregated pairs
    handing the states' pages over from TP = 1 to TP = 2 (and on Granite from TP = 2 to TP = 1)
    give one device's tokens and logprobs (a page's layout does not depend on the TP size)."""
    golden = np.load(FIXTURES / family / "golden.npz")
    run = models_run[f"hybrid/{family}"]
    logits = golden["logits_2"][-1].astype(np.float64)
    logprobs = logits - logits.max() - np.log(np.exp(logits - logits.max()).sum())
    for name in ("chunked", "hit"):
        assert run[name]["tokens"] == [int(logprobs.argmax())], name
        assert run[name]["logprobs"] == pytest.approx([logprobs.max()], abs=1e-4), name
    assert run["hit"]["cached"] == 28
    assert run["decoded"]["tokens"] == golden["greedy_tokens"][:4].tolist()
    cfg = load_config(FIXTURES / family)
    rows = 16  # hybrid_parallel_checks.MAX_ROWS
    mamba = getattr(cfg.family_options, "mamba", None)
    gathered = rows * mamba.groups * mamba.state_dim if mamba else 0
    collectives = run["collectives"]
    assert set(collectives) <= {"all-reduce", "all-gather"}, collectives
    assert collectives["all-reduce"] <= rows * cfg.hidden_size
    assert collectives.get("all-gather", 0) <= gathered
    pairs = {k: v for k, v in run["handed_over"].items() if k != "one_device"}
    one_device = run["handed_over"]["one_device"]
    assert one_device[1]["tokens"] == golden["greedy_tokens"][:4].tolist()
    assert "tp1_to_tp2" in pairs
    for pair, got in pairs.items():
        for want, row in zip(one_device, got, strict=True):
            assert row["tokens"] == want["tokens"], pair
            assert row["logprobs"] == pytest.approx(want["logprobs"], abs=1e-5), pair


@pytest.mark.parametrize("family, layout", [("gemma2", "tp"), ("gemma3", "tp"), ("gpt_oss", "tp"),
                                            ("gpt_oss", "ep")])
@models
def test_windowed_families_at_tp2_equal_single_device(models_run, family, layout):
    golden = np.load(FIXTURES / family / "golden.npz")["greedy_tokens"]
    got = models_run[f"{family}/tp2" + ("-ep" if layout == "ep" else "")]["tokens"]
    assert got == golden[:len(got)].tolist()


@models
@pytest.mark.parametrize("family, layout", [("deepseek_v3", "tp"), ("deepseek_v2", "ep")])
def test_mla_families_at_tp2_equal_single_device(models_run, family, layout):
    """Query heads (q_b_proj / kv_b_proj columns) split over the devices; the one latent KV head
    is replicated, each device keeping the whole latent cache."""
    golden = np.load(FIXTURES / family / "golden.npz")["greedy_tokens"]
    got = models_run[f"{family}/tp2" + ("-ep" if layout == "ep" else "")]["tokens"]
    assert got == golden[:len(got)].tolist()


@models
@pytest.mark.parametrize("family, tp", [("qwen3_moe", 2), ("mixtral", 4)])
def test_expert_parallel_greedy_tokens_equal_single_device(models_run, family, tp):
    """Whole experts split over the devices (--expert-layout ep), the other MoE layout beside the
    default's test above: two experts per device, then mixtral's four over four."""
    golden = np.load(FIXTURES / family / "golden.npz")["greedy_tokens"]
    got = models_run[f"{family}/tp{tp}-ep"]["tokens"]
    assert got == golden[:len(got)].tolist()


@models
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3_moe"])
def test_tp8_on_eight_heads_equals_tp1(models_run, family):
    """Eight query heads over eight devices, the fixtures' 2 KV heads replicated 4 times (each
    device storing the one its query head reads)."""
    one, eight = models_run[f"{family}-wide/tp1"], models_run[f"{family}-wide/tp8"]
    assert eight["tokens"] == one["tokens"]
    np.testing.assert_allclose(eight["logits"], one["logits"], atol=2e-5, rtol=0)


@engine
def test_each_device_holds_exactly_its_slice(engine_run):
    shards = engine_run["shards"]
    assert shards["mismatches"] == []
    assert shards["split_leaves"] > 0
    # TP = 4 over 2 KV heads: K/V projections replicated, one KV head stored per device.
    assert shards["k_proj"] == "P()" and shards["stored_kv_heads"] == 4
    assert shards["w_down"] == "P(None, 'tp', None)"
    assert shards["w_down_ep"] == "P('tp', None, None)"


@engine
def test_memory_planner_inputs_are_per_device(engine_run):
    (w1, act1), (w2, act2) = engine_run["planner"]["1"], engine_run["planner"]["2"]
    assert w1 * 0.5 <= w2 < w1 * 0.6  # norms and K/V biases replicated: a little over half
    assert 0 < act2 < act1


@engine
def test_engine_tokens_equal_across_meshes(engine_run):
    ref = engine_run["engine/tp1dp1"]["tokens"]
    got = engine_run["engine/tp2dp2"]
    assert got["tokens"] == ref
    # both replicas served requests, on disjoint devices
    assert all(n > 0 for n in got["per_replica"])
    flat = [d for devs in got["devices"] for d in devs]
    assert len(flat) == len(set(flat)) == 4
    # /metrics sums the replicas; the server's AsyncEngine drives the DP engine unchanged
    assert got["merged_metrics"] == [
        f'jaxinfer:generation_tokens_total{{model_name="mixtral"}} {sum(got["per_replica"])}']
    assert got["async_tokens"] == ref[3]
    assert got["after_update"] == [ref[:2], [1, 1], [1, 1]]


@engine
def test_fp8_kv_cache_under_tp2_equals_single_device(engine_run):
    fp8 = engine_run["llama/fp8"]
    assert fp8["2"] == fp8["1"] and all(len(t) == 10 for t in fp8["1"])


@engine
def test_two_processes_tp2_equal_single_device(engine_run):
    hosts = engine_run["hosts"]
    assert [h["process"] for h in hosts] == [0, 1]
    assert all(h["devices"] == 2 and h["local_devices"] == 1 for h in hosts)
    assert hosts[0]["tokens"] == hosts[1]["tokens"] == engine_run["llama/engine_tp1"]


@pytest.mark.parametrize("case, flag", [
    ("tp3", "--tensor-parallel-size 3: does not divide the model's 4 attention heads"),
    ("tp16", "--tensor-parallel-size 16: exceeds the 8 device"),
    ("dp3tp4", "--data-parallel-size 3: x --tensor-parallel-size 4 = 12 exceeds the 8 device"),
    ("tp0", "--tensor-parallel-size 0: must be >= 1"),
])
@engine
def test_engine_refuses_bad_sizes_by_flag(engine_run, case, flag):
    assert flag in engine_run["refusals"][case]


@sampler_spec
@pytest.mark.parametrize("layout", ["replicated", "rows"])
def test_tp2_sampler_has_no_collective_inside_control_flow(sampler_spec_run, layout):
    """No collective inside a conditional of the TP = 2 samplers, decode forwards and decode loops
    (with one, the sampler's CUDA graph failed to instantiate when XLA's command buffers take
    collectives), nor inside a while loop of a sampler; the decode loop's while body holds the
    forward's all-reduces by design. Greedy tokens as on one device, in either layout."""
    got = sampler_spec_run[f"sampler_layout/{layout}"]
    sites = got["sites"]
    assert {k.split()[0] for k in sites} == {"sample", "loop", "forward"}
    assert sum(k.startswith("sample") for k in sites) == 3  # base, full, masked
    for step, found in sites.items():
        assert found["conditional"] == [], step
        if not step.startswith("loop"):
            assert found["while"] == [], step
    assert got["tokens"] == sampler_spec_run["llama/engine_tp1"]


@sampler_spec
@pytest.mark.parametrize("layout", ["replicated", "rows"])
@pytest.mark.parametrize("method", ["ngram", "draft", "eagle3"])
def test_tp2_speculation_has_no_collective_inside_a_conditional(sampler_spec_run, method, layout):
    """Speculative decoding at TP = 2 (n-gram; a draft model split over the target's devices;
    an EAGLE-3 head replicated over them): no collective inside a conditional of the
    verification steps, draft loops, catch-ups and speculative loops (a loop's while body holds
    its forwards' all-reduces, as the decode loop's does), and greedy tokens as on one device
    without speculation, in either layout; the head's KV as the same head's on one device."""
    got = sampler_spec_run[f"spec/{method}/{layout}"]
    sites = got["sites"]
    names = {k.split()[0] for k in sites}
    assert names == {"draft": {"verify", "draft_loop", "catch_up"}, "ngram": {"verify"},
                     "eagle3": {"spec_loop", "catch_up"}}[method]
    assert any(k.endswith(" full") for k in sites)  # the variant with the conditionals ran
    for step, found in sites.items():
        assert found["conditional"] == [], step
        if not step.startswith(("draft_loop", "spec_loop")):
            assert found["while"] == [], step
    assert got["tokens"] == sampler_spec_run["llama/engine_tp1"]
    assert got["drafts"] > 0
    if method == "draft":  # the target proposing for itself: every proposal accepted
        assert got["accepted"] == got["draft_tokens"] > 0
    if method == "eagle3":
        assert got["head_kv_diff"] < 1e-4


@sampler_spec
def test_tp2_mtp_speculation_equals_one_device(sampler_spec_run):
    """DeepSeek-V3's MTP module replicated over a TP = 2 mesh: the greedy tokens of the run on
    one device (HF's), the module's KV as on one device."""
    got = sampler_spec_run["spec/mtp"]
    assert got["tokens"] == [got["golden"], got["golden"]]
    assert min(got["drafts"]) > 0
    assert got["head_kv_diff"] < 1e-4


BASE = {"architectures": ["LlamaForCausalLM"], "vocab_size": 96, "hidden_size": 48,
        "intermediate_size": 96, "num_hidden_layers": 1, "num_attention_heads": 6,
        "num_key_value_heads": 2, "max_position_embeddings": 64}
MOE = {"architectures": ["Qwen3MoeForCausalLM"], "num_attention_heads": 12, "num_experts": 8,
       "num_experts_per_tok": 2, "moe_intermediate_size": 32}


@cache_lora
def test_executable_cache_warm_start_on_sub_meshes(cache_lora_run):
    """Each data-parallel replica stores its own steps (their shardings name its devices) and a
    second start loads all of them, with the same greedy tokens."""
    cold, warm = cache_lora_run["exe_cache/cold"], cache_lora_run["exe_cache/warm"]
    assert cold["hits"] == [0, 0] and min(cold["misses"]) > 0
    assert warm["hits"] == cold["misses"] and warm["misses"] == [0, 0]
    assert warm["tokens"] == cold["tokens"]


@pytest.mark.parametrize("change, tp, layout, message", [
    ({}, 4, "tp", "--tensor-parallel-size 4: does not divide the model's 6 attention heads"),
    ({"num_key_value_heads": 4, "num_attention_heads": 12}, 3, "tp",
     "--tensor-parallel-size 3: neither divides nor is a multiple of the model's 4 KV heads"),
    ({"intermediate_size": 99}, 2, "tp", "does not divide the model's MLP intermediate size 99"),
    (MOE | {"moe_intermediate_size": 33}, 2, "tp",
     r"does not divide the model's expert intermediate size 33 \(--expert-layout ep"),
    (MOE | {"num_experts": 6}, 4, "ep", "--tensor-parallel-size 4: does not divide the model's 6 "
                                        "experts"),
    ({}, 2, "xx", "--expert-layout xx: expected one of ep, tp"),
])
def test_sizes_the_model_cannot_split_are_refused(change, tp, layout, message):
    cfg = config_from_dict({**BASE, **change})
    with pytest.raises(ConfigError, match=message):
        validate_parallel_sizes(cfg, tp, 1, 8, layout)
    validate_parallel_sizes(config_from_dict(BASE), 2, 4, 8)  # 6 heads / 2, KV 2 / 2: fine
    validate_parallel_sizes(config_from_dict({**BASE, **MOE}), 4, 1, 8, "ep")  # 8 experts / 4


QWEN3_NEXT = {"architectures": ["Qwen3NextForCausalLM"], "vocab_size": 64, "hidden_size": 64,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
              "num_hidden_layers": 4, "intermediate_size": 64, "linear_num_key_heads": 2,
              "linear_num_value_heads": 4, "linear_key_head_dim": 16,
              "linear_value_head_dim": 16, "num_experts": 0}
GRANITE_H = {"architectures": ["GraniteMoeHybridForCausalLM"], "vocab_size": 64,
             "hidden_size": 48, "num_attention_heads": 4, "num_key_value_heads": 2,
             "num_hidden_layers": 2, "layer_types": ["mamba", "attention"],
             "shared_intermediate_size": 64, "num_local_experts": 0, "mamba_expand": 1,
             "mamba_n_heads": 6, "mamba_d_head": 8, "mamba_n_groups": 1, "mamba_d_state": 4}


@pytest.mark.parametrize("raw, tp, message", [
    (QWEN3_NEXT, 4, "--tensor-parallel-size 4: does not divide the model's 2 Gated DeltaNet key "
                    "heads"),
    (GRANITE_H, 4, "--tensor-parallel-size 4: does not divide the model's 6 Mamba-2 heads"),
    (GRANITE_H | {"mamba_d_state": 3}, 2, "does not divide the Mamba-2 B and C channels"),
    (GRANITE_H | {"mamba_n_groups": 3}, 2, "neither divides nor is a multiple of the model's 3 "
                                          "Mamba-2 groups"),
])
def test_state_heads_the_devices_cannot_split_are_refused(raw, tp, message):
    """A hybrid's state-space heads split over tp devices like attention heads (whole key heads,
    Mamba-2 heads, equal shares of B and C); sizes that do not divide are refused by flag."""
    with pytest.raises(ConfigError, match=message):
        validate_parallel_sizes(config_from_dict(raw), tp, 1, 8)
    validate_parallel_sizes(config_from_dict(QWEN3_NEXT), 2, 1, 8)
    # Two devices share Granite's one group of B and C.
    validate_parallel_sizes(config_from_dict(GRANITE_H), 2, 1, 8)


class _Flags:
    coordinator_address = num_processes = process_id = None


@pytest.mark.parametrize("values, message", [
    ({"coordinator_address": "h:1", "num_processes": 2}, "--process-id is required"),
    ({"coordinator_address": "h:1", "num_processes": 2, "process_id": 2},
     r"--process-id 2: must be in \[0, 2\)"),
    ({"coordinator_address": "h:1", "num_processes": 0, "process_id": 0}, "--num-processes 0"),
])
def test_distributed_flags_are_checked(values, message, monkeypatch):
    flags = _Flags()
    for k, v in values.items():
        setattr(flags, k, v)
    with pytest.raises(ConfigError, match=message):
        distributed_settings(flags)
    assert distributed_settings(_Flags()) is None
    monkeypatch.setenv("JAXINFER_COORDINATOR_ADDRESS", "h:2")
    monkeypatch.setenv("JAXINFER_NUM_PROCESSES", "2")
    monkeypatch.setenv("JAXINFER_PROCESS_ID", "1")
    assert distributed_settings(_Flags()) == {"coordinator_address": "h:2", "num_processes": 2,
                                              "process_id": 1}


@pytest.mark.parametrize("flags, message", [
    (["--tensor-parallel-size", "2"], "--tensor-parallel-size 2: exceeds the 1 device(s) available"),
    (["--data-parallel-size", "2"], "--data-parallel-size 2: x --tensor-parallel-size 1 = 2 exceeds"),
    (["--coordinator-address", "127.0.0.1:1"], "--num-processes is required"),
])
def test_cli_refuses_more_devices_than_there_are(flags, message, capsys):
    from jaxinfer.cli.main import main
    argv = ["generate", "--prompt", "x", "--model", str(FIXTURES / "llama"), "--no-warmup",
            "--compilation-cache-dir", "", *flags]
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_engine_args_refuse_an_unknown_expert_layout():
    from jaxinfer.engine.args import EngineArgs
    with pytest.raises(ConfigError, match="--expert-layout 'xx': choose from ep, tp"):
        EngineArgs(model=str(FIXTURES / "qwen3_moe"), expert_layout="xx")
    assert EngineArgs(model=str(FIXTURES / "qwen3_moe"), expert_layout="ep").expert_layout == "ep"
