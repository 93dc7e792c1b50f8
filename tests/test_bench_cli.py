"""`jaxinfer bench`: the subcommands are listed, `bench serve` against the shared test server writes
vLLM's result file and the project's record, and `bench throughput` / `bench latency` run the demo
model at tiny sizes and write vLLM's JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from jaxinfer.bench import cli, common, presets

pytestmark = pytest.mark.slow  # minutes on the CI machine: xdist starts its group first (conftest.py)

DEMO = Path(__file__).parents[1] / "checkpoints" / "demo-target"
# The demo model at a CPU's size: tiny buckets, compiled when first used.
TINY_ENGINE = ["--model", str(DEMO), "--dtype", "float32", "--max-model-len", "64", "--block-size", "16",
               "--num-blocks", "64", "--max-num-seqs", "4", "--max-num-batched-tokens", "64",
               "--compilation-cache-dir", "", "--no-warmup", "--attention-backend", "reference"]


def test_jaxinfer_bench_help_lists_the_drivers():
    """Through the installed command's own module: `bench` is registered on `jaxinfer`."""
    out = subprocess.run([sys.executable, "-m", common.cli_module(), "bench", "--help"],
                         capture_output=True, text=True, check=True).stdout
    for driver in ("serve", "throughput", "latency", "startup", "kernels"):
        assert f"\n    {driver}" in out, out


def test_bench_serve_help_groups_vllms_flags(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["serve", "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    for group in ("server:", "dataset:", "traffic:", "results (vLLM's result file):", "project record"):
        assert f"\n{group}" in out, group
    for flag in ("--save-result", "--result-dir", "--result-filename", "--dataset-name", "--random-input-len",
                 "--random-output-len", "--num-prompts", "--max-concurrency", "--request-rate",
                 "--percentile-metrics", "--metric-percentiles", "--record"):
        assert flag in out, flag


@pytest.mark.parametrize("argv, message", [
    (["--request-rate", "0"], "--request-rate must be > 0"),
    (["--max-concurrency", "0"], "--max-concurrency must be > 0"),
    (["--percentile-metrics", "ttft,bogus"], "--percentile-metrics 'bogus'"),
    (["--goodput", "ttft"], "--goodput 'ttft'"),
    (["--dataset-name", "sharegpt"], "needs --dataset-path"),
])
def test_bench_serve_rejects_bad_flags_before_sending(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:  # no server at this port: the flags fail first
        cli.main(["serve", "--port", "9", *argv])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_bench_serve_writes_vllms_result_file_and_the_record(server, tmp_path):
    argv = ["serve", "--base-url", server.urls["main"], "--tokenizer", server.engine_args.model,
            "--num-prompts", "3", "--random-input-len", "8", "--random-output-len", "4",
            "--max-concurrency", "2", "--goodput", "ttft:600000", "e2el:600000",
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
            "--save-result", "--save-detailed", "--result-dir", str(tmp_path),
            "--result-filename", "vllm.json", "--save", str(tmp_path), "--record", "serving_test"]
    assert cli.main(argv) == 0
    result = json.loads((tmp_path / "vllm.json").read_text(), parse_constant=pytest.fail)
    for key in ("date", "endpoint_type", "backend", "label", "model_id", "tokenizer_id", "num_prompts",
                "request_rate", "burstiness", "max_concurrency", "duration", "completed", "failed",
                "total_input_tokens", "total_output_tokens", "request_throughput", "request_goodput",
                "output_throughput", "total_token_throughput", "max_output_tokens_per_s",
                "max_concurrent_requests", "input_lens", "output_lens", "ttfts", "itls", "latencies",
                "start_times", "generated_texts", "errors",
                *(f"{s}_{m}_ms" for s in ("mean", "median", "std", "p50", "p99")
                  for m in ("ttft", "tpot", "itl", "e2el"))):
        assert key in result, key
    assert result["request_rate"] == "inf" and result["endpoint_type"] == "openai"
    assert result["max_concurrency"] == 2 and 1 <= result["max_concurrent_requests"] <= 2
    assert result["completed"] == 3 and result["failed"] == 0
    assert result["request_goodput"] == pytest.approx(3 / result["duration"])
    # --dataset-name random ignores EOS by default (as vLLM): every reply has its full length.
    assert result["output_lens"] == [4, 4, 4] and result["total_output_tokens"] == 12
    assert len(result["ttfts"]) == len(result["itls"]) == len(result["input_lens"]) == 3
    # A request's latency is its first token plus the gaps after it (a chunk may carry several).
    for ttft, itl, latency in zip(result["ttfts"], result["itls"], result["latencies"]):
        assert len(itl) <= 3 and latency == pytest.approx(ttft + sum(itl))
    assert 0 < result["median_ttft_ms"] <= result["mean_e2el_ms"] * 3
    assert result["total_token_throughput"] == pytest.approx(
        (result["total_input_tokens"] + 12) / result["duration"])
    assert result["p50_itl_ms"] <= result["p99_itl_ms"]
    record = json.loads((tmp_path / "serving_test.json").read_text(), parse_constant=pytest.fail)
    assert tuple(record) == ("name", "date", "commit", "machine", "command", "config", "metrics")
    assert record["config"]["ignore_eos"] is True and record["metrics"]["c2_completed"] == 3
    # The run's own prefix-cache hit rate and the buckets still compiling, from /metrics (issue 38).
    assert 0.0 <= record["metrics"]["c2_prefix_hit_rate"] <= 1.0
    assert record["metrics"]["c2_buckets_compiling"] >= 0


def test_bench_serve_without_save_detailed_leaves_the_arrays_out(server, tmp_path):
    """As vLLM: the per-request arrays only with --save-detailed; EOS honoured with --no-ignore-eos."""
    argv = ["serve", "--base-url", server.urls["main"], "--tokenizer", server.engine_args.model,
            "--endpoint", "/v1/chat/completions", "--num-prompts", "2", "--random-input-len", "6",
            "--random-output-len", "3", "--no-ignore-eos", "--save-result", "--result-dir", str(tmp_path),
            "--label", "jx"]
    assert cli.main(argv) == 0
    (path,) = tmp_path.glob("jx-infqps-*.json")
    result = json.loads(path.read_text())
    assert result["endpoint_type"] == "openai-chat" and result["completed"] == 2
    assert not {"ttfts", "itls", "input_lens", "output_lens", "errors"} & set(result)
    assert "mean_e2el_ms" not in result and "p99_tpot_ms" in result  # vLLM's default metrics
    assert 1 <= result["total_output_tokens"] <= 6


def test_bench_throughput_on_the_demo_model(tmp_path, capsys):
    out = tmp_path / "throughput.json"
    tiny_engine = TINY_ENGINE[2:]  # --model left at its default (a Path): the demo model
    assert cli.main(["throughput", *tiny_engine, "--input-len", "8", "--output-len", "4",
                     "--num-prompts", "3", "--output-json", str(out), "--save", str(tmp_path),
                     "--name", "tp"]) == 0
    result = json.loads(out.read_text())
    assert result["num_requests"] == 3 and result["num_output_tokens"] == 12
    assert result["total_num_tokens"] == 3 * 8 + 12 and result["elapsed_time"] > 0
    assert result["tokens_per_second"] == pytest.approx(result["total_num_tokens"] / result["elapsed_time"])
    assert result["requests_per_second"] == pytest.approx(3 / result["elapsed_time"])
    assert result["prefix_hit_rate"] == 0.0  # the timed prompts are new to the cache
    assert "Throughput: " in capsys.readouterr().out
    record = json.loads((tmp_path / "tp.json").read_text())
    assert record["metrics"]["num_output_tokens"] == 12 and record["config"]["input_len"] == 8
    assert record["config"]["model"] == str(DEMO)


def test_bench_latency_on_the_demo_model(tmp_path):
    out = tmp_path / "latency.json"
    assert cli.main(["latency", *TINY_ENGINE, "--input-len", "8", "--output-len", "3", "--batch-size", "2",
                     "--num-iters-warmup", "1", "--num-iters", "3", "--output-json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert set(result) == {"avg_latency", "std_latency", "latencies", "percentiles"}
    assert len(result["latencies"]) == 3 and all(t > 0 for t in result["latencies"])
    assert result["avg_latency"] == pytest.approx(sum(result["latencies"]) / 3)
    assert list(result["percentiles"]) == ["10", "25", "50", "75", "90", "99"]
    assert min(result["latencies"]) <= result["percentiles"]["50"] <= max(result["latencies"])


def test_preset_fills_only_the_flags_left_at_their_defaults(tmp_path):
    """--preset writes the shape's model directory once and keeps what the command line set."""
    import argparse

    sub = argparse.ArgumentParser().add_subparsers()
    from jaxinfer.bench import throughput
    parser = throughput.add_parser(sub)
    args = parser.parse_args(["--preset", "llama8b", "--num-prompts", "8"])
    presets.apply(args, parser, root=tmp_path)
    assert args.num_prompts == 8 and args.input_len == 512 and args.load_format == "dummy"
    config = json.loads((Path(args.model) / "config.json").read_text())
    assert config["hidden_size"] == 4096 and (Path(args.model) / "tokenizer.json").is_file()


def test_bench_latency_profiles_the_steady_decode_step(tmp_path):
    """--profile host probe device: the host's phase split and hot functions, the probe's verdict,
    and (on the CPU) the device trace's refusal, in the output JSON beside vLLM's keys."""
    out = tmp_path / "latency.json"
    assert cli.main(["latency", *TINY_ENGINE, "--input-len", "8", "--output-len", "2", "--batch-size", "2",
                     "--num-iters-warmup", "0", "--num-iters", "1", "--output-json", str(out),
                     "--profile", "host", "probe", "device", "--profile-decode-steps", "4"]) == 0
    profile = json.loads(out.read_text())["profile"]
    host = profile["host"]
    assert host["num_seqs"] == 2 and host["steps"] == 4 and host["ms_per_step"] > 0
    assert host["profiled_top_own_ms"] and all(v >= 0 for v in host["profiled_top_own_ms"].values())
    assert profile["probe"]["compiles"] == 0  # the steady steps reuse the run's executables
    assert "needs a GPU" in profile["device"]["error"]


def test_bench_startup_times_a_checkpoint_load(tmp_path, monkeypatch):
    """--checkpoint-load: both formats loaded and timed, the record under load_<shape>_<device>."""
    from jaxinfer.bench import checkpoint_load
    monkeypatch.setitem(checkpoint_load.SHAPES, "tiny", dict(
        architectures=["LlamaForCausalLM"], vocab_size=256, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128))
    out = tmp_path / "load.json"
    assert cli.main(["startup", "--checkpoint-load", "--shape", "tiny", "--repeats", "1",
                     "--output-json", str(out), "--save", str(tmp_path)]) == 0
    result = json.loads(out.read_text())
    assert set(result["seconds"]) == {"safetensors", "orbax"} and all(result["seconds"].values())
    assert result["bytes"] > 0
    (record,) = tmp_path.glob("load_tiny_*.json")
    assert json.loads(record.read_text())["metrics"]["safetensors_s"] >= 0


def test_bench_serve_names_an_unreachable_server(capsys):
    from server_harness import free_port
    with pytest.raises(SystemExit) as exit_:
        cli.main(["serve", "--port", str(free_port()), "--num-prompts", "1"])
    assert exit_.value.code == 2 and "no server answers at http://127.0.0.1:" in capsys.readouterr().err


def test_bench_serve_appends_vllm_lines_with_metadata(server, tmp_path):
    """--backend openai-chat calls the chat API; --append-result adds one JSON line per run, with
    --metadata's keys; --num-warmups' requests are not counted."""
    argv = ["serve", "--base-url", server.urls["main"], "--tokenizer", server.engine_args.model,
            "--backend", "openai-chat", "--num-prompts", "2", "--random-input-len", "6",
            "--random-output-len", "2", "--num-warmups", "1", "--top-p", "0.9", "--save-result",
            "--append-result", "--result-dir", str(tmp_path), "--result-filename", "runs.jsonl",
            "--metadata", "gpu=cpu", "tp=1"]
    assert cli.main(argv) == 0 and cli.main(argv) == 0
    lines = (tmp_path / "runs.jsonl").read_text().splitlines()
    assert len(lines) == 2
    for line in lines:
        result = json.loads(line)
        assert result["backend"] == result["endpoint_type"] == "openai-chat"
        assert result["completed"] == 2 and result["total_output_tokens"] == 4
        assert (result["gpu"], result["tp"]) == ("cpu", "1")


def test_bench_throughput_times_the_kv_manager_step(tmp_path):
    """--kv-manager: the KV-cache manager's step alone, its record named by the block size."""
    out = tmp_path / "kv.json"
    assert cli.main(["throughput", "--kv-manager", "--num-seqs", "16", "--steps", "20", "--block-size", "32",
                     "--output-json", str(out), "--save", str(tmp_path)]) == 0
    result = json.loads(out.read_text())
    assert result["running"] == 16 and result["steps"] == 20 and result["block_size"] == 32
    assert 0 < result["median_us"] <= result["p99_us"] and 0 < result["prefix_hit_rate"] <= 1
    record = json.loads((tmp_path / "kv_manager_block32.json").read_text())
    assert record["config"]["running"] == 16 and record["metrics"]["median_us"] == result["median_us"]


def test_bench_throughput_prices_structured_output(tmp_path):
    """--structured-output: the batch unconstrained, constrained and mixed, each row exactly
    --output-len tokens, and the ratios to unconstrained."""
    out = tmp_path / "structured.json"
    assert cli.main(["throughput", "--structured-output", *TINY_ENGINE, "--num-prompts", "2",
                     "--input-len", "4", "--output-len", "3", "--repeats", "1",
                     "--output-json", str(out)]) == 0
    result = json.loads(out.read_text())
    for mode in ("unconstrained", "constrained", "mixed"):
        assert result[mode]["output_tokens"] == 6 and result[mode]["prefix_hit_rate"] == 0.0
    assert result["constrained"]["masked_steps"] > 0 == result["unconstrained"]["masked_steps"]
    assert result["constrained_vs_unconstrained"] > 0 and result["mixed_vs_unconstrained_cpu_time"] > 0
