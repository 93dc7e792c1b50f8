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
    (["generate", "--prompt", "x", "--model", str(DEMO / "config.json")],
     f"'{DEMO / 'config.json'}' is a file; a model directory is expected"),
    (["memory", "--model", str(DEMO / "config.json")],
     f"'{DEMO / 'config.json'}' is a file; a model directory is expected"),
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


@pytest.mark.parametrize("argv, level", [
    (["serve", "--log-level", "INFO"], "info"),  # after the command too, in any case
    (["--log-level", "Debug", "serve"], "debug"),
    (["--log-level", "error", "memory", "--log-level", "info"], "info"),  # the later one
    (["serve"], "warning"),
])
def test_log_level_goes_before_or_after_the_command(argv, level):
    assert build_parser().parse_args(argv).log_level == level


def test_memory_defaults_to_the_demo_model(capsys):
    assert main(["memory", "--seq-len", "1024", "--json"]) == 0
    model = json.loads(capsys.readouterr().out)["model"]
    config = json.loads((DEMO / "config.json").read_text())
    assert (model["num_layers"], model["num_kv_heads"]) == (config["num_hidden_layers"],
                                                            config["num_key_value_heads"])
    assert main(["memory", "--layers", "2", "--kv-heads", "1", "--head-dim", "8", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["model"]["num_layers"] == 2  # shape flags: no model


# Ctrl-C while `jaxinfer serve` imports jax: a finder that sends the process SIGINT when `jax` is
# first looked up, in the child only. The child takes SIGINT as a terminal's process does: under
# pytest-xdist the worker ignores SIGINT and its children inherit that, and an ignored SIGINT
# would leave `jaxinfer serve` serving.
INTERRUPT_AT_JAX_IMPORT = """
import os, signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)

class InterruptAtJax:
    def find_spec(self, name, path=None, target=None):
        if name == "jax":
            os.kill(os.getpid(), signal.SIGINT)
        return None

sys.meta_path.insert(0, InterruptAtJax())
from jaxinfer.cli.main import main
sys.exit(main(["serve", "--port", "0"]))
"""


def test_ctrl_c_while_starting_is_one_line_and_status_130(tmp_path):
    import os
    import subprocess
    import sys
    done = subprocess.run([sys.executable, "-c", INTERRUPT_AT_JAX_IMPORT], capture_output=True, text=True,
                          cwd=tmp_path, env={**os.environ, "JAX_PLATFORMS": "cpu"}, timeout=120)
    assert (done.returncode, done.stderr) == (130, "jaxinfer: interrupted\n")


def test_ctrl_c_while_running_is_one_line_and_status_130(monkeypatch, capsys):
    from jaxinfer.cli import serve as cli_serve

    def interrupted(args):
        raise KeyboardInterrupt
    monkeypatch.setattr(cli_serve, "run", interrupted)
    assert main(["serve", "--port", "0"]) == 130
    assert capsys.readouterr().err == "jaxinfer serve: interrupted\n"


@pytest.mark.parametrize("argv", [["memory"], ["memory", "--json"]])
def test_a_reader_that_left_is_no_traceback(argv, tmp_path):
    """`jaxinfer memory | head`: the reader closes the pipe before the report is written."""
    import os
    import subprocess
    import sys
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        done = subprocess.run([sys.executable, "-m", "jaxinfer.cli.main", *argv], stdout=write_end,
                              stderr=subprocess.PIPE, text=True, cwd=ROOT,
                              env={**os.environ, "JAX_PLATFORMS": "cpu"}, timeout=300)
    finally:
        os.close(write_end)
    assert "Traceback" not in done.stderr and "BrokenPipeError" not in done.stderr, done.stderr
    assert done.returncode == 141
