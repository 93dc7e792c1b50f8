"""The wheel `pip install .` installs: its top-level packages, the demo model inside it, and the
default model path as an installed package resolves it.

The wheel is built once, without build isolation (setuptools comes with the test extra, so no
index is needed), from a copy of the checkout: setuptools writes build/ and *.egg-info beside the
sources it builds."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DEMO = "jaxinfer/demo_models/demo-target"
# What loading and serving the demo model reads (jaxinfer/model/config.py, tokenizer.py, weights.py).
DEMO_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
              "tokenizer_config.json")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("src")
    # The checkout as git has it (all of it, so that a stray top-level package would show), less
    # .gitignore's build outputs and environments
    shutil.copytree(ROOT, src, symlinks=True, dirs_exist_ok=True, ignore=shutil.ignore_patterns(
        ".git", ".venv", ".goldenvenv", "__pycache__", "*.egg-info", ".pytest_cache", ".hypothesis",
        ".ruff_cache", "build", "dist", "out", ".whl", ".gl"))
    out = tmp_path_factory.mktemp("dist")
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(out)], check=True, capture_output=True, text=True)
    [whl] = out.glob("jaxinfer-*.whl")
    return whl


def test_wheel_installs_no_generic_top_level_package(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names if ".dist-info/" not in n} == {"jaxinfer", "serve",
                                                                           "pallas_kernels"}
    entry_points = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt")))
    assert "jaxinfer = jaxinfer.cli.main:main" in entry_points.decode()


def test_wheel_carries_the_demo_model(wheel):
    infos = {i.filename: i for i in zipfile.ZipFile(wheel).infolist()}
    for name in DEMO_FILES:
        # the bytes themselves, not the checkout's symlink to them
        size = (ROOT / "checkpoints" / "demo-target" / name).stat().st_size
        assert infos[f"{DEMO}/{name}"].file_size == size


def test_installed_wheel_resolves_its_own_demo_model(wheel, tmp_path):
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    # PYTHONPATH comes before the editable install's finder: this imports the extracted jaxinfer,
    # and runs `jaxinfer memory` (which loads the default model's config.json) from it.
    probe = ("import sys; from jaxinfer import paths; print(paths.DEFAULT_MODEL); "
             "from jaxinfer.cli.main import main; sys.exit(main(['memory', '--seq-len', '1024', '--json']))")
    done = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(site), "JAX_PLATFORMS": "cpu"})
    assert done.returncode == 0, done.stderr
    path, report = done.stdout.split("\n", 1)
    assert Path(path) == (site / DEMO).resolve()
    assert json.loads(report)["model"]["num_layers"] == json.loads(
        (ROOT / "checkpoints" / "demo-target" / "config.json").read_text())["num_hidden_layers"]
