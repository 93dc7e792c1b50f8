"""How an embedding model pools and post-processes its final hidden states.

A sentence-transformers checkpoint says it in `modules.json` (a `Pooling` module, and `Normalize`
when embeddings are unit vectors) and `1_Pooling/config.json` (`pooling_mode_lasttoken`,
`pooling_mode_mean_tokens`, `pooling_mode_cls_token`); without them a decoder model pools its last
token and normalizes (Qwen3-Embedding's recipe, vLLM's default for decoder embedders). Matryoshka
truncation (`dimensions`) is allowed only where config.json says the model was trained for it
(`matryoshka_dimensions`: the sizes, or `is_matryoshka: true`: any size).

The engine returns the raw pooled vector (SamplingParams.pooling); `finish_embedding` truncates
and normalizes it, as sentence-transformers does (truncate first, then normalize)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from jaxinfer.errors import InvalidRequestError

_MODES = (("pooling_mode_lasttoken", "last"), ("pooling_mode_mean_tokens", "mean"),
          ("pooling_mode_cls_token", "cls"))


@dataclasses.dataclass(frozen=True)
class PoolingConfig:
    method: str = "last"
    normalize: bool = True
    detected: bool = False  # read from a sentence-transformers config (not the default)
    # Matryoshka: None = no truncation; () = any size; else the trained sizes.
    matryoshka: tuple[int, ...] | None = None


def _read(path: Path) -> object:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def pooling_config(model_dir: str | Path | None) -> PoolingConfig:
    """The model directory's pooling, or the decoder default when it has no sentence-transformers
    configuration (or is not a local directory)."""
    root = Path(model_dir) if model_dir else None
    if root is None or not root.is_dir():
        return PoolingConfig()
    cfg = _read(root / "config.json")
    matryoshka = None
    if isinstance(cfg, dict):
        dims = cfg.get("matryoshka_dimensions")
        if isinstance(dims, list) and all(isinstance(d, int) and d > 0 for d in dims):
            matryoshka = tuple(dims)
        elif cfg.get("is_matryoshka") is True:
            matryoshka = ()
    modules = _read(root / "modules.json")
    if not isinstance(modules, list):
        return PoolingConfig(matryoshka=matryoshka)
    types = {m.get("type", ""): m.get("path", "") for m in modules if isinstance(m, dict)}
    pooling_path = next((p for t, p in types.items() if t.endswith("models.Pooling")), None)
    method = "last"
    if pooling_path is not None:
        pooling = _read(root / pooling_path / "config.json")
        if isinstance(pooling, dict):
            method = next((m for key, m in _MODES if pooling.get(key)), "last")
    normalize = any(t.endswith("models.Normalize") for t in types)
    return PoolingConfig(method, normalize, pooling_path is not None, matryoshka)


def check_embedding_engine(config) -> None:
    """Embedding requests need every prefill step to read its hidden states; a speculative step
    (target verification, jaxinfer/spec_decode/) does not, so an engine that speculates embeds
    nothing (an error rather than an embedding silently missing)."""
    if config.speculative is not None:
        raise InvalidRequestError("embeddings are not served by an engine with speculative decoding "
                                  "(--speculative-*)", param="model")


def check_dimensions(cfg: PoolingConfig, dimensions, hidden_size: int, field: str = "dimensions") -> None:
    """A 400-style error unless the model can give `dimensions`-long embeddings."""
    if dimensions is None:
        return
    if isinstance(dimensions, bool) or not isinstance(dimensions, int) or not 1 <= dimensions <= hidden_size:
        raise InvalidRequestError(f"{field}={dimensions!r}: must be an integer from 1 to {hidden_size}",
                                  param=field)
    if dimensions == hidden_size:
        return
    if cfg.matryoshka is None:
        raise InvalidRequestError(f"{field}={dimensions}: this model does not support Matryoshka "
                                  f"truncation (its embeddings have {hidden_size} dimensions)", param=field)
    if cfg.matryoshka and dimensions not in cfg.matryoshka:
        raise InvalidRequestError(f"{field}={dimensions}: this model was trained for "
                                  f"{list(cfg.matryoshka)} dimensions", param=field)


def finish_embedding(pooled: list[float] | np.ndarray, normalize: bool,
                     dimensions: int | None = None) -> np.ndarray:
    """The raw pooled vector -> the embedding (float32): truncated, then L2-normalized."""
    v = np.asarray(pooled, np.float32)
    if dimensions is not None:
        v = v[:dimensions]
    if normalize:
        v = v / max(float(np.linalg.norm(v)), 1e-12)
    return v
