"""jaxinfer/bench/results_io.py: the record every benchmark's --save writes, and the kernel benchmarks'
metric names that RESULTS.md and the issue's checks read."""

import json
import subprocess

import pytest

from jaxinfer.bench import kernel_decode as bench_decode, kernel_prefill as bench_prefill
from jaxinfer.bench import results_io


def test_save_writes_the_record_with_every_key(tmp_path, monkeypatch):
    monkeypatch.setattr("sys.argv", ["benchmarks/bench_x.py", "--n", "3", "--save"])
    path = results_io.save(tmp_path, "x_cpu", config={"n": 3}, metrics={"tok_s": 1.5})
    rec = json.loads(path.read_text())
    assert path.name == "x_cpu.json" and tuple(rec) == results_io.KEYS
    assert rec["command"] == "benchmarks/bench_x.py --n 3 --save"
    assert rec["metrics"] == {"tok_s": 1.5} and rec["config"] == {"n": 3}
    assert rec["machine"]["cpu_count"] >= 1 and rec["date"].endswith("Z")
    assert results_io.load("x_cpu", tmp_path) == rec


def test_a_module_run_records_its_python_m_command(monkeypatch):
    import jaxinfer.bench.kernel_decode as module
    monkeypatch.setattr("sys.argv", [module.__file__, "--tiny"])
    monkeypatch.setitem(__import__("sys").modules, "__main__", module)
    assert results_io.record("x", config={}, metrics={})["command"] == (
        "python -m jaxinfer.bench.kernel_decode --tiny")


def test_historical_record_keeps_its_origin():
    rec = results_io.record("old", config={}, metrics={}, command="python3 b.py", date="2026-11-29",
                            commit="abc1234", machine_info={"device": "NVIDIA H200"})
    assert (rec["command"], rec["date"], rec["commit"], rec["machine"]) == (
        "python3 b.py", "2026-11-29", "abc1234", {"device": "NVIDIA H200"})


def test_commit_is_marked_dirty_and_env_wins(tmp_path, monkeypatch):
    monkeypatch.delenv("BENCH_COMMIT", raising=False)
    git = lambda *a: subprocess.run(["git", *a], cwd=tmp_path, check=True, capture_output=True)
    git("init", "-q")
    (tmp_path / "f").write_text("a")
    git("add", "f")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "m")
    clean = results_io.git_commit(tmp_path)
    assert len(clean) == 12 and "+" not in clean
    (tmp_path / "f").write_text("b")
    assert results_io.git_commit(tmp_path) == clean + "+dirty"
    monkeypatch.setenv("BENCH_COMMIT", "feedbeef")
    assert results_io.git_commit(tmp_path) == "feedbeef"


def test_decode_metrics_carry_the_figure_and_its_share_of_the_ceiling():
    result = {"read_ceiling_TBps": 4.5, "rows": [{"batch": 64, "ctx": 4096, "kernels": {
        "mosaic": {"us": 250.0, "TBps": 4.3, "pct_ceiling": 95.56},
        "bundled_p8_k16": {"error": "boom"}}}]}
    m = bench_decode.metrics(result)
    assert m["decode_b64x4096_tbps"] == 4.3 and m["hbm_read_tbps"] == 4.5
    assert m["decode_b64x4096_frac_of_hbm"] == pytest.approx(0.9556)
    assert m["decode_b64x4096_bundled_p8_k16_error"] == "boom"


def test_prefill_metrics_carry_the_ratio_to_cudnn():
    timing = {"prefill_causal_b1s8192": {"ours_mosaic_bf16": {"ms": 0.9, "TFLOPs": 600.0},
                                         "cudnn_bf16": {"ms": 1.05, "TFLOPs": 500.0},
                                         "xla_bf16": {"ms": 9.0, "TFLOPs": 50.0}}}
    m = bench_prefill.metrics(timing)
    assert m["prefill_causal_b1s8192_over_cudnn"] == 1.2
    assert m["prefill_causal_b1s8192_cudnn_tflops"] == 500.0
    assert m["prefill_causal_b1s8192_xla_bf16_tflops"] == 50.0


def test_the_installed_command_records_itself(monkeypatch):
    """`jaxinfer bench ...` (the console script) is the record's command, not the script's path."""
    monkeypatch.setattr("sys.argv", ["/venv/bin/jaxinfer", "bench", "latency", "--save"])
    assert results_io.record("x", config={}, metrics={})["command"] == "jaxinfer bench latency --save"


def test_fold_keeps_the_stored_figures_and_names_each_run():
    stored = {"name": "q", "date": "d0", "commit": "c0", "command": "old", "config": {"a": 1},
              "metrics": {"x": 1, "y": 2}}
    new = {"name": "q", "date": "d1", "commit": "c1", "command": "new", "config": {}, "metrics": {"y": 3}}
    out = results_io.fold(new, stored, prefix="v_")
    assert out["metrics"] == {"x": 1, "y": 2, "v_y": 3} and (out["date"], out["commit"]) == ("d1", "c1")
    assert out["config"]["a"] == 1 and out["config"]["merged_from"] == [
        {"commit": "c1", "date": "d1", "command": "new", "keys": ["v_y"]}]


def test_record_slug_names_the_card_not_its_memory():
    from jaxinfer.bench.results_io import kind_slug
    assert kind_slug("NVIDIA H200") == "h200"
    assert kind_slug("NVIDIA H100 80GB HBM3") == "h100"  # was "hbm3": the last word
    assert kind_slug("gpu") == "gpu"
