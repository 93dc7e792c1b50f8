"""`jaxinfer bench DRIVER --suite NAME [-- ITS FLAGS]`: every suite is reachable from its driver with
its own flags, the driver's --save/--name reach it, a suite at a CPU's size writes the key set of its
GPU record, and every record in benchmarks/results/ names a `jaxinfer bench` command that exists."""

from __future__ import annotations

import argparse
import json
import re
import shlex

import pytest

from jaxinfer.bench import cli, kernels, results_io
from jaxinfer.bench.suites import SUITES, suite_argv

# Records no `jaxinfer bench` command regenerates: what measured them is gone from the tree (the
# kernels were reverted, the script deleted, one-off probes) or is not a benchmark (examples/,
# checkpoints/ training runs). Each still carries the command that wrote it.
HISTORICAL = {"fp8_gemv_h200", "fp8_matmul_h200", "fp8_matmul_h200_xquant_in_kernel",
              "startup_demo-target_h200", "research_loop_probes_h200", "grpo_demo_cpu",
              "train_demo_h200", "step_paths_h100", "command_buffers_h100", "gmm_decode_h100"}


def driver_argv(name: str) -> list[str]:
    suite = SUITES[name]
    return [suite.driver, "--suite", name]


@pytest.mark.parametrize("name", sorted(SUITES))
def test_each_suite_takes_its_own_flags_after_the_separator(name, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main([*driver_argv(name), "--", "--help"])
    assert exit_.value.code == 0
    assert "--save" in capsys.readouterr().out  # the suite's own parser answered, its record flags


@pytest.mark.parametrize("only", ["moe", "weight-only"])
def test_kernels_only_runs_a_suite_by_name(only, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["kernels", "--only", only, "--", "--help"])
    assert exit_.value.code == 0 and "--deadline-s" in capsys.readouterr().out


@pytest.mark.parametrize("driver", ["throughput", "latency", "serve"])
def test_flags_after_the_separator_need_a_suite(driver, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main([driver, "--", "--sections", "x"])
    assert exit_.value.code == 2 and "need --suite NAME" in capsys.readouterr().err


def test_a_suite_is_listed_only_under_its_own_driver(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["throughput", "--suite", "soak"])  # soak is `bench serve`'s
    assert exit_.value.code == 2 and "invalid choice: 'soak'" in capsys.readouterr().err


def test_the_drivers_save_and_name_go_after_the_suites_own_flags():
    args = argparse.Namespace(suite_args=["--parts", "kernel"], save="/tmp/out", name="mla_x")
    assert suite_argv(args) == ["--parts", "kernel", "--save", "/tmp/out", "--name", "mla_x"]
    args = argparse.Namespace(suite_args=["--tiny"], save=None, name=None)
    assert suite_argv(args) == ["--tiny"]


def test_embeddings_suite_at_a_cpus_size_writes_its_gpu_records_keys(tmp_path, monkeypatch):
    """The whole path a GPU run takes, at tiny shapes: driver, suite, engine, record."""
    monkeypatch.setenv("BENCH_TINY_SHAPES", "1")
    assert cli.main(["throughput", "--suite", "embeddings", "--save", str(tmp_path),
                     "--name", "emb"]) == 0
    record = json.loads((tmp_path / "emb.json").read_text())
    stored = results_io.load("embeddings_h200")
    assert set(record["metrics"]) == set(stored["metrics"])
    assert record["metrics"]["embed_512_tokens_s"] > 0 and record["metrics"]["steps"] >= 1


def record_commands():
    for path in sorted(results_io.RESULTS_DIR.glob("*.json")):
        yield path.stem, json.loads(path.read_text())


def test_every_record_names_a_jaxinfer_bench_command_that_exists():
    kernel_benchmarks = {"decode", "prefill", *kernels.SINGLE}
    for name, record in record_commands():
        command = record["command"]
        if name in HISTORICAL:
            assert not command.startswith("jaxinfer bench"), name  # then it is not historical
            continue
        assert command.startswith("jaxinfer bench "), (name, command)
        words = shlex.split(re.split(r" (?:--|\(|;|<)(?: |$)", command)[0])
        driver = words[2]
        assert driver in {"serve", "throughput", "latency", "startup", "kernels", "memory-plan",
                          "host-path"}, (name, driver)
        if "--suite" in words:
            suite = words[words.index("--suite") + 1]
            assert SUITES[suite].driver == driver, (name, suite)
        if "--only" in words:
            assert words[words.index("--only") + 1] in kernel_benchmarks, name
        if record["config"].get("command_before"):
            assert record["config"]["command_before"] != command
