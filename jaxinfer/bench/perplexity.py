"""A model's held-out perplexity and top-1 agreement, through jaxinfer's own loader and model code:
what the quantization suites check their numbers with (weights quantized on load, the KV cache in
FP8) and checkpoints/measure_demo.py measures the demo models with."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.model.config import load_config
from jaxinfer.model.tokenizer import Tokenizer
from jaxinfer.model.transformer import train_forward
from jaxinfer.model.weights import load_params
from jaxinfer.paths import REPO_ROOT


def make_logits_fn(cfg):
    return jax.jit(lambda params, tokens: train_forward(params, cfg, tokens))


def perplexity(logits_fn, params, windows: np.ndarray, batch: int = 8) -> float:
    total, count = 0.0, 0
    for i in range(0, len(windows), batch):
        chunk = jnp.asarray(windows[i:i + batch])
        logits = logits_fn(params, chunk[:, :-1])
        logp = jax.nn.log_softmax(logits, axis=-1)
        nll = -jnp.take_along_axis(logp, chunk[:, 1:, None], axis=-1)
        total += float(nll.sum())
        count += nll.size
    return math.exp(total / count)


def perplexity_and_top1(logits_fn, params, windows: np.ndarray) -> tuple[float, np.ndarray]:
    """`perplexity` and the argmax of every position it scores, from the same forwards."""
    tops = []

    def recording(params, tokens):
        logits = logits_fn(params, tokens)
        tops.append(np.asarray(logits.argmax(-1)))
        return logits
    return perplexity(recording, params, windows), np.concatenate(tops)


def quantized_accuracy(model_dir: Path, mode: str, dtype=jnp.bfloat16) -> dict:
    """The model's held-out perplexity with unquantized and `mode`-quantized weights (quantized on
    load; activations in `dtype`), and how often the quantized model's top-1 token equals the
    unquantized one's, over the first max_position_embeddings tokens of
    checkpoints/heldout_sample.txt (one window: 1,024 predicted positions for the demo model)."""
    cfg = load_config(model_dir)
    ids = Tokenizer.from_dir(model_dir).encode((REPO_ROOT / "checkpoints" / "heldout_sample.txt").read_text())
    window = np.asarray(ids[:cfg.max_position_embeddings + 1], np.int32)[None]
    out: dict = {"positions": int(window.shape[1] - 1)}
    argmax = {}
    for label, c in (("", cfg), ("_quantized", dataclasses.replace(cfg, quantization=mode))):
        params = load_params(model_dir, c, dtype, progress=False)
        out[f"ppl{label}"], argmax[label] = perplexity_and_top1(make_logits_fn(c), params, window)
    out["top1_agreement"] = float((argmax[""] == argmax["_quantized"]).mean())
    return out
