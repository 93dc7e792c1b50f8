"""Where things live: the bundled demo model and the on-disk caches."""

import os
from pathlib import Path

# The small model jaxinfer trained itself (checkpoints/README.md); used when no --model is given.
# It ships in the wheel as package data. In a checkout jaxinfer/demo_models/demo-target is a
# symlink to checkpoints/demo-target, which the wheel build copies through, so the one path serves
# a checkout and an installed wheel alike (resolved: a checkout names checkpoints/demo-target).
DEFAULT_MODEL = (Path(__file__).parent / "demo_models" / "demo-target").resolve()
# A checkout's root: the benchmark suites that read checkpoints/ beyond the default model (the draft
# and EAGLE-3 demo models, the held-out text) run from a checkout, not from an installed wheel.
REPO_ROOT = Path(__file__).resolve().parent.parent


def cache_home() -> Path:
    """$XDG_CACHE_HOME, else ~/.cache (the XDG base directories, which huggingface_hub follows too)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")


def user_cache_dir() -> Path:
    return cache_home() / "jaxinfer"
