"""`jaxinfer memory` (cli.memory.run) against figures computed by hand."""

import argparse
import json
from pathlib import Path

import pytest

from jaxinfer.cli import memory as cli_memory
from jaxinfer.errors import ConfigError

FIXTURES = Path(__file__).parent / "fixtures" / "models"
LLAMA8B_FLAGS = ["--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--heads", "32",
                 "--weight-bytes", "16.06GB"]


def memory(argv, capsys):
    parser = argparse.ArgumentParser()
    cli_memory.add_parser(parser.add_subparsers())
    args = parser.parse_args(["memory", *argv])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    return json.loads(out) if "--json" in argv else out


def test_llama_8b_on_h200_by_hand(capsys):
    r = memory([*LLAMA8B_FLAGS, "--seq-len", "4096", "--batch", "64", "--json"], capsys)
    assert r["kv_bytes_per_token"] == 2 * 32 * 8 * 128 * 2 == 131072
    assert r["kv_bytes_per_block"] == 2 * 2**20
    assert r["kv_bytes_per_sequence"] == 512 * 2**20
    assert r["kv_bytes_per_batch"] == 32 * 2**30
    # 0.9 × 141e9 − 16.06e9 = 110.84e9 bytes next to the weights
    assert r["kv_budget_bytes"] == 110_840_000_000
    assert r["tokens_fit"] == 845_642  # 110.84e9 // 131072
    assert r["blocks_fit"] == 52_852 and r["sequences_fit"] == 206 and r["batch_fits"]
    rf = r["decode_roofline"]
    # 64 × (2 × 8.03e9 weight FLOPs + 4 × 32 layers × 32 heads × 128 × 4096 attention FLOPs)
    assert rf["flops_per_step"] == 64 * (16_060_000_000 + 2_147_483_648)
    assert rf["bytes_per_step"] == 16_060_000_000 + 64 * 4096 * 131072
    assert rf["arithmetic_intensity"] == pytest.approx(23.11, abs=0.01)
    assert rf["ridge_point"] == pytest.approx(989 / 4.8)
    assert rf["bound"] == "memory"
    assert rf["min_step_seconds"] == pytest.approx(50_419_738_368 / 4.8e12)


def test_mla_latent_rows_next_to_llama(capsys):
    """DeepSeek-V2-Lite (27 layers) and V3 (61 layers) cache one 512 + 64 latent per token and
    layer: 31,104 and 70,272 B per token next to Llama-3-8B's 131,072 (docs/MLA.md's table)."""
    lite = memory(["--layers", "27", "--kv-lora-rank", "512", "--heads", "16", "--weight-bytes",
                   "31.4GB", "--seq-len", "32768", "--json"], capsys)
    assert lite["kv_bytes_per_token"] == 27 * 576 * 2 == 31104
    assert lite["model"]["num_kv_heads"] == 1 and lite["model"]["head_dim"] == 576
    # absorbed decode: scores over 576 and values over 512 per head and layer
    assert lite["decode_roofline"]["flops_per_step"] == 32 * (
        2 * (31_400_000_000 // 2) + 2 * 27 * 16 * (576 + 512) * 32768)
    v3 = memory(["--layers", "61", "--kv-lora-rank", "512", "--heads", "128", "--json"], capsys)
    assert v3["kv_bytes_per_token"] == 61 * 576 * 2 == 70272
    text = memory(["--layers", "27", "--kv-lora-rank", "512"], capsys)
    assert "31104 B = 27 × latent 576 × 2 B (MLA" in text


def test_fp8_cache_and_custom_memory(capsys):
    r = memory([*LLAMA8B_FLAGS, "--kv-cache-dtype", "fp8", "--accelerator-memory", "80",
                "--bandwidth", "2", "--tflops", "300", "--gpu-memory-utilization", "0.5", "--json"],
               capsys)
    assert r["kv_bytes_per_token"] == 65536
    assert r["kv_budget_bytes"] == 40 * 2**30 - 16_060_000_000
    assert r["decode_roofline"]["ridge_point"] == pytest.approx(150.0)


def test_model_directory_moe_counts_only_routed_experts(capsys):
    r = memory(["--model", str(FIXTURES / "mixtral"), "--seq-len", "100", "--batch", "2",
                "--json"], capsys)
    m = r["model"]
    assert r["kv_bytes_per_token"] == 2 * 2 * 2 * 16 * 4  # float32 checkpoint
    assert m["weight_bytes"] == 148_288 * 4
    assert m["active_params"] == 148_288 - 2 * (4 - 2) * 3 * 64 * 48  # 2 of 4 experts run


def test_text_report_explains_the_roofline(capsys):
    out = memory(LLAMA8B_FLAGS, capsys)
    assert "KV per token:    131072 B = 2 × 32 × 8 × 128 × 2 B" in out
    assert "memory-bound" in out and "ridge point 206 FLOP/B" in out


@pytest.mark.parametrize("argv, flag", [
    (["--kv-heads", "8", "--head-dim", "128"], "--layers"),
    ([*LLAMA8B_FLAGS, "--accelerator-memory", "tpu9000"], "--accelerator"),
    (["--layers", "2", "--kv-heads", "2", "--head-dim", "8", "--weight-bytes", "lots"],
     "--weight-bytes"),
    (["--model", "x", "--layers", "2"], "--layers"),
    ([*LLAMA8B_FLAGS, "--seq-len", "0"], "--seq-len"),
    ([*LLAMA8B_FLAGS, "--bandwidth", "-1"], "--bandwidth"),
    ([*LLAMA8B_FLAGS, "--tflops", "0"], "--tflops"),
    (["--layers", "2", "--kv-heads", "3", "--head-dim", "8", "--heads", "4"], "--heads"),
])
def test_errors_name_the_bad_flag(argv, flag, capsys):
    with pytest.raises(ConfigError, match=flag):
        memory(argv, capsys)


def test_accelerator_is_a_flag_of_its_own_and_a_long_seq_len_warns(capsys):
    """Issue 38: `--accelerator h200` worked only as an argparse abbreviation of
    `--accelerator-memory`; a --seq-len past the model's context passed silently."""
    parser = argparse.ArgumentParser(allow_abbrev=False)
    cli_memory.add_parser(parser.add_subparsers())
    model = str(FIXTURES / "llama")
    args = parser.parse_args(["memory", "--model", model, "--accelerator", "l4", "--seq-len",
                              "100000"])
    assert args.func(args) == 0
    out = capsys.readouterr()
    assert "accelerator l4" in out.out
    assert "--seq-len 100000 is longer than the model's context" in out.err
    args = parser.parse_args(["memory", "--model", model, "--seq-len", "16"])
    assert args.func(args) == 0
    assert "longer than" not in capsys.readouterr().err
