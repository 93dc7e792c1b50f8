"""A demo training run's full state between device jobs: float32 weights, AdamW moments and the
best (bf16) weights as one orbax checkpoint, the step, schedule and log as JSON beside it. A
resumed run restores them onto arrays like its fresh ones and reads the same batches
(`demo_data.PackedBatches` is a function of the step), so two jobs train as one.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp


def save_state(directory: Path, params, opt_state, best, meta: dict) -> None:
    directory = directory.resolve()
    if directory.exists():
        shutil.rmtree(directory)
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(directory / "arrays", {"params": params, "opt_state": opt_state, "best": best})
    (directory / "meta.json").write_text(json.dumps(meta) + "\n")


def restore_state(directory: Path, params, opt_state):
    directory = directory.resolve()
    meta = json.loads((directory / "meta.json").read_text())
    like = {"params": params, "opt_state": opt_state,
            "best": jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)}
    with ocp.StandardCheckpointer() as ckpt:
        state = ckpt.restore(directory / "arrays", like)
    return state["params"], state["opt_state"], state["best"], meta
