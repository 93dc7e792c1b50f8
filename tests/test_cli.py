"""`jaxinfer generate` end to end on the bundled model, and the CLI's error messages."""

import json
from pathlib import Path

import pytest

from jaxinfer.cli.main import build_parser, main
from jaxinfer.model.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "checkpoints" / "demo-target"
FAST = ["--dtype", "float32", "--no-warmup", "--max-num-seqs", "8", "--max-num-batched-tokens", "128",
        "--compilation-cache-dir", ""]


def test_generate_streams_the_bundled_models_greedy_continuation(capsys):
    case = json.loads((ROOT / "checkpoints" / "demo_golden.json").read_text())["cases"][0]
    assert main(["generate", "--prompt", case["prompt"], "--max-tokens", "12", *FAST]) == 0
    out = capsys.readouterr()
    expected = Tokenizer.from_dir(DEMO).decode(case["target"]["ids"][:12])
    assert out.out == case["prompt"] + expected + "\n"
    assert "12 tokens" in out.err


def test_generate_prompts_file_prints_one_json_line_per_prompt(tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def add(a, b):\n\nclass Stack:\n")
    assert main(["generate", "--prompts-file", str(prompts), "--max-tokens", "4", *FAST]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["prompt"] for line in lines] == ["def add(a, b):", "class Stack:"]
    assert all(line["text"] for line in lines)


@pytest.mark.parametrize("argv, message", [
    (["generate", "--max-tokens", "3"], "give exactly one of --prompt or --prompts-file"),
    (["generate", "--prompts-file", "/nonexistent/p.txt"],
     "--prompts-file '/nonexistent/p.txt' does not exist"),
    (["generate", "--prompt", "x", "--model", "/nonexistent/model"],
     "model directory '/nonexistent/model' does not exist"),
    (["generate", "--prompt", "x", "--temperature", "-1", *FAST], "temperature=-1.0"),
    # --port 0: the default port may be in use (`make serve`), which is refused before the model
    (["serve", "--model", str(ROOT / "tests" / "fixtures" / "models" / "llama"), "--port", "0", *FAST],
     "has no tokenizer.json"),
])
def test_bad_input_is_one_clear_line(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_help_lists_every_command():
    text = build_parser().format_help()
    for command in ("generate", "serve", "convert", "memory", "warmup"):
        assert command in text


def test_serve_on_a_port_in_use_is_one_line_before_the_model_loads(capsys):
    """Issue 38: a busy --port loaded the model first, then printed a 30-line traceback. The
    server's "serving ... on" status line is an INFO record, shown at the default --log-level."""
    import logging
    import socket
    import time
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        t0 = time.perf_counter()
        assert main(["serve", "--port", str(port), *FAST]) == 2
        assert time.perf_counter() - t0 < 5  # (loading the demo model takes longer)
    err = capsys.readouterr().err
    assert f"cannot serve on 127.0.0.1:{port}" in err and len(err.strip().splitlines()) == 1
    assert logging.getLogger("serve.app").isEnabledFor(logging.INFO)
