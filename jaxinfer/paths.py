"""Where things live: the bundled demo model and the on-disk compilation cache."""

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
# The small model jaxinfer trained itself (checkpoints/README.md); used when no --model is given.
DEFAULT_MODEL = REPO_ROOT / "checkpoints" / "demo-target"


def user_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "jaxinfer"
