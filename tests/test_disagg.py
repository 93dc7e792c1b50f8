"""Prefill/decode disaggregation (jaxinfer/disagg/): greedy and seeded tokens identical to the
colocated engine under prefix hits, aborts at every stage and preemption on both sides, no leaked
blocks, metrics, the server's AsyncEngine path, the flags' refusals; the block transfer against a
numpy reference.

The two-device checks run in one subprocess (tests/disagg_checks.py, 2 CPU devices), started once.
"""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.disagg.args import role_device_ids
from jaxinfer.disagg.transfer import KVTransfer, block_bucket
from jaxinfer.engine.args import EngineArgs
from jaxinfer.errors import ConfigError
from jaxinfer.model.config import load_config
from jaxinfer.parallel.sharding import ShardingPlan, build_mesh

pytestmark = pytest.mark.slow  # minutes on the CI machine: xdist starts its group first (conftest.py)

HERE = Path(__file__).resolve().parent
ABORTED = {"r6": "waiting", "r7": "transfer", "r2": "decode"}


@pytest.fixture(scope="module")
def run() -> dict:
    env = {**os.environ, "PYTHONPATH": str(HERE.parent)}
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, str(HERE / "disagg_checks.py")], env=env, text=True,
                          capture_output=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


def test_roles_run_on_their_own_devices(run):
    assert run["devices"] == [[0], [1]]


def test_tokens_identical_to_colocated(run):
    colocated, disagg = run["colocated"], run["disagg"]
    assert disagg["aborted_at"] == ABORTED
    for rid, tokens in colocated["tokens"].items():
        if rid in ABORTED:
            continue
        assert disagg["tokens"][rid] == tokens, rid
        assert disagg["finish"][rid] == colocated["finish"][rid], rid


@pytest.mark.parametrize("family", ["deepseek_v2", "gemma2"])
def test_latent_and_windowed_pages_hand_over(run, family):
    colocated, disagg = run[f"page_kind_{family}"]
    assert disagg == colocated and all(len(t) == 12 for t in disagg)


def test_aborts_at_every_stage(run):
    colocated, disagg = run["colocated"], run["disagg"]
    for rid in ABORTED:
        assert disagg["finish"][rid] == "abort"
        got = disagg["tokens"].get(rid, [])
        assert got == colocated["tokens"][rid][:len(got)]
    assert disagg["tokens"].get("r6", []) == []      # never started
    assert len(disagg["tokens"]["r7"]) == 1          # its first token, then aborted in transit
    assert len(disagg["tokens"]["r2"]) >= 4          # aborted while decoding


def test_no_blocks_leaked_on_either_side(run):
    for side in ("prefill_kv", "decode_kv"):
        assert run[side]["requests"] == [] and run[side]["used_blocks"] == 0, side
        assert run[side]["cached_blocks"] > 0, side  # the prefix caches kept what they computed
    assert run["transit"] == []
    for state in run["after_async_kv"]:  # a cancelled stream freed its blocks too
        assert state["requests"] == [] and state["used_blocks"] == 0


def test_both_sides_preempted_and_prefixes_hit(run):
    prefill, decode = run["preemptions"]
    assert prefill > 0 and decode > 0
    assert run["prefix_hits"] > 0


def _metric(run, prefix: str, key: str = "metrics") -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in run[key] if line.startswith(prefix))


def test_metrics(run):
    handed_off = [rid for rid in run["colocated"]["tokens"] if rid not in ("r3", "r6", "r7")]
    assert _metric(run, "jaxinfer:kv_transfers_total") == len(handed_off)
    assert _metric(run, "jaxinfer:kv_transfer_bytes_total") > 0
    assert _metric(run, "jaxinfer:kv_transfer_seconds_count") == len(handed_off)
    # the shared 24-token prefix was on the decode side already for the later requests
    assert _metric(run, "jaxinfer:kv_transfer_blocks_skipped_total") > 0
    assert _metric(run, 'jaxinfer:request_success_total{finished_reason="abort"') == 3
    assert _metric(run, 'jaxinfer:request_success_total{finished_reason="length"') == 10
    generated = sum(len(t) for t in run["disagg"]["tokens"].values())
    assert _metric(run, "jaxinfer:generation_tokens_total") == generated
    assert _metric(run, "jaxinfer:queue_depth") == 0
    # the driver's host-time split (the disagg suite records it): both engines were stepped
    driver = run["driver"]
    assert driver["prefill_step_count"] > 0 and driver["decode_step_count"] > 0
    assert driver["decode_step_count"] <= driver["steps"] and driver["decode_step_ms"] > 0


def test_behind_the_async_engine(run):
    assert run["async"]["tokens"] == run["colocated"]["tokens"]["r0"]
    assert run["async"]["cancelled_after"] >= 3


def test_behind_the_server(run):
    assert run["server_completion"] == [12, "length"]
    assert run["server_pools_after_disconnect"] == [[], [], []]
    assert _metric(run, "jaxinfer:kv_transfers_total", "server_metrics") == 2
    assert _metric(run, 'jaxinfer:request_success_total{finished_reason="abort"',
                   "server_metrics") == 1


def test_n_choices_hand_over_each(run):
    n2 = run["n2"]
    assert n2["disagg"] == n2["colocated"] and n2["colocated"][0] != n2["colocated"][1]
    assert all(len(t) == 6 for t in n2["disagg"])
    assert [state["requests"] for state in run["after_n2_kv"]] == [[], []]


def test_refusals_name_the_flag(run):
    r = run["refusals"]
    assert r["dp2"].startswith("--data-parallel-size 2")
    assert r["tp2"].startswith("--tensor-parallel-size 2")
    assert r["overlap"].startswith("--decode-devices '0'") and "overlaps" in r["overlap"]
    assert r["too_many"].startswith("--decode-devices '1,2'")
    assert r["prefill_tp3"].startswith("--prefill-tensor-parallel-size 3: exceeds")
    assert r["role_without"] == "--decode-devices '1': needs --disaggregate"


# ---- single-process checks ----------------------------------------------------------------------
def test_flags_parse_and_default_device_groups():
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    ns = parser.parse_args(["--disaggregate", "--prefill-tensor-parallel-size", "2",
                            "--decode-devices", "3"])
    args = EngineArgs.from_cli_args(ns)
    assert args.disaggregate and args.prefill_tensor_parallel_size == 2
    assert role_device_ids(args, 4) == {"prefill": [0, 1], "decode": [3]}
    args = EngineArgs(disaggregate=True, decode_tensor_parallel_size=2)
    assert role_device_ids(args, 4) == {"prefill": [0], "decode": [1, 2]}
    with pytest.raises(ConfigError, match="--prefill-devices '0,x'"):
        EngineArgs(disaggregate=True, prefill_devices="0,x")
    with pytest.raises(ConfigError, match="--prefill-tensor-parallel-size 2: needs --disaggregate"):
        EngineArgs(prefill_tensor_parallel_size=2)


def test_block_bucket():
    assert [block_bucket(n) for n in (0, 1, 2, 3, 4, 5, 255, 256, 257)] == \
        [1, 1, 2, 4, 4, 8, 256, 256, 512]


@pytest.mark.parametrize("counts", [(1, 5, 3), (7, 2)])
def test_transfer_moves_exactly_the_blocks(counts):
    """Gather + device_put + donated scatter against numpy: each transfer's blocks land at their
    destinations in every layer's K and V, nothing else changes (ragged block counts: padding)."""
    cfg = load_config(HERE / "fixtures" / "models" / "llama")
    plan = ShardingPlan(build_mesh(1), cfg)
    rng = np.random.default_rng(sum(counts))
    shape = (cfg.num_kv_heads, 12, 4, cfg.head_dim)

    def cache():
        return tuple((jnp.asarray(rng.standard_normal(shape), jnp.float32),
                      jnp.asarray(rng.standard_normal(shape), jnp.float32))
                     for _ in range(cfg.num_layers))

    src, dst = cache(), cache()
    expect = [[np.array(a) for a in layer] for layer in dst]
    transfer = KVTransfer(plan, plan, max_blocks=12)
    free = list(rng.permutation(12))
    for n in counts:
        s_ids = rng.choice(12, n, replace=False).tolist()
        d_ids = [int(free.pop()) for _ in range(n)]
        buffer = transfer.send(src, s_ids)
        dst = transfer.receive(dst, buffer, d_ids)
        for layer, (k, v) in enumerate(src):
            expect[layer][0][:, d_ids] = np.asarray(k)[:, s_ids]
            expect[layer][1][:, d_ids] = np.asarray(v)[:, s_ids]
    for layer, (k, v) in enumerate(jax.block_until_ready(dst)):
        np.testing.assert_array_equal(np.asarray(k), expect[layer][0])
        np.testing.assert_array_equal(np.asarray(v), expect[layer][1])
