"""Hugging Face hub ids (`Qwen/Qwen2.5-7B-Instruct`) resolved from the local Hugging Face cache.

jaxinfer never downloads: a model given by hub id must already be in the cache that
`huggingface-cli download` (or transformers) fills, laid out as
`<cache>/models--<org>--<name>/snapshots/<commit>/`, with `refs/<revision>` naming the commit. The
cache is `$HF_HUB_CACHE`, else `$HF_HOME/hub`, else `$XDG_CACHE_HOME/huggingface/hub`, else
`~/.cache/huggingface/hub`, as huggingface_hub finds it, so offline machines (HF_HUB_OFFLINE=1)
resolve the same ids.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from jaxinfer.errors import ConfigError
from jaxinfer.paths import cache_home

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def hub_cache_dir() -> Path:
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]) / "hub"
    return cache_home() / "huggingface" / "hub"


def is_hub_id(name: str) -> bool:
    """`org/name`, not an existing path."""
    return bool(_HUB_ID.match(name)) and not Path(name).exists()


def resolve_model(name: str, revision: str = "main") -> str:
    """An existing path as given; a hub id as its cached snapshot directory. Anything else is
    returned unchanged (the loaders then name it as a missing directory)."""
    if not is_hub_id(name):
        return name
    repo = hub_cache_dir() / f"models--{name.replace('/', '--')}"
    if not repo.is_dir():
        raise ConfigError(f"'{name}' is not a directory and not in the local Hugging Face cache "
                          f"({hub_cache_dir()}); download it first, e.g. `huggingface-cli "
                          f"download {name}`")
    ref = repo / "refs" / revision
    if ref.is_file():
        snapshot = repo / "snapshots" / ref.read_text().strip()
    else:  # no ref: accept a single snapshot
        snapshots = sorted(p for p in (repo / "snapshots").glob("*") if p.is_dir())
        if len(snapshots) != 1:
            raise ConfigError(f"'{name}' in the Hugging Face cache has no refs/{revision} and "
                              f"{len(snapshots)} snapshots; pass the snapshot directory")
        snapshot = snapshots[0]
    if not snapshot.is_dir():
        raise ConfigError(f"'{name}': the cached revision {snapshot.name} has no snapshot directory")
    return str(snapshot)
