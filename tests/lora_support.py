"""Shared pieces of the LoRA tests: random PEFT adapters, the base weights with one merged in, and
the LoRA server that the server-side LoRA test files share."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np

from jaxinfer.engine.args import EngineArgs
from jaxinfer.model.config import load_config
from jaxinfer.model.lora.peft import LoRAAdapter, layer_projections, projection_shape, save_adapter


def random_adapter(cfg, rank: int, seed: int, scale: float = 0.3, alpha: float | None = None,
                   projs: tuple[str, ...] | None = None) -> LoRAAdapter:
    """An adapter on every supported projection (or `projs`) of every layer, A and B random (PEFT
    starts B at zero; a trained one is not), lora_alpha = 2 r unless given."""
    rng = np.random.default_rng(seed)
    weights = {}
    for layer in range(cfg.num_layers):
        for proj in layer_projections(cfg, layer):
            if projs is not None and proj not in projs:
                continue
            fan_in, fan_out = projection_shape(cfg, proj)
            weights[(layer, proj)] = (rng.normal(0, scale, (fan_in, rank)).astype(np.float32),
                                      rng.normal(0, scale, (rank, fan_out)).astype(np.float32))
    alpha = 2.0 * rank if alpha is None else alpha
    return LoRAAdapter(f"adapter{seed}", rank, alpha / rank, weights)


def merged(params: dict, adapter: LoRAAdapter) -> dict:
    """`params` (unfused, unquantized) with W + s·A·B in every projection the adapter targets."""
    out = jax.tree.map(np.asarray, params)
    for (layer, proj), (a, b) in adapter.weights.items():
        module = "attn" if proj in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
        leaf = out[f"layers_{layer}"][module][proj]
        leaf["kernel"] = (leaf["kernel"] + adapter.scaling * (a @ b)).astype(leaf["kernel"].dtype)
    return out


# ---- the LoRA test server (conftest's `lora_server`) ---------------------------------------------
PATHOLOGICAL = "(.+)+Z"  # re.fullmatch backtracks 2^30 times on a 31-character module path


def _write_config(path, **changes) -> None:
    conf = json.loads((path / "adapter_config.json").read_text())
    conf.update(changes)
    (path / "adapter_config.json").write_text(json.dumps(conf))


def _served_adapters(cfg, root: Path) -> dict[str, Path]:
    """The adapters test_lora_server.py loads or is refused ("sql", "big", "wrong", "embed",
    "saves")."""
    paths = {"sql": save_adapter(random_adapter(cfg, 4, 1, scale=0.5), cfg, root / "sql")}
    paths["big"] = save_adapter(random_adapter(cfg, 16, 2), cfg, root / "big")  # over rank 8
    wrong = random_adapter(cfg, 4, 3)
    wrong.weights = {k: (a[:-1], b) for k, (a, b) in wrong.weights.items()}  # in features - 1
    paths["wrong"] = save_adapter(wrong, cfg, root / "wrong")
    for name, field, value in (("embed", "target_modules", ["q_proj", "embed_tokens"]),
                               ("saves", "modules_to_save", ["lm_head"])):
        paths[name] = save_adapter(random_adapter(cfg, 4, 4), cfg, root / name)
        _write_config(paths[name], **{field: value})
    return paths


def _hostile_adapters(cfg, root: Path) -> dict[str, Path]:
    """The adapters test_lora_hard_edges.py loads or is refused: non-finite weights or scaling, a
    catastrophic regex, numbers and nesting the parser chokes on, an oversized weights file."""
    paths = {name: save_adapter(random_adapter(cfg, 4, seed, scale=0.5), cfg, root / name)
             for seed, name in enumerate(("good", "victim", "regex", "rslora"), 1)}
    _write_config(paths["regex"], target_modules=r"model\.layers\.\d+\.(self_attn|mlp)\.\w+_proj")
    _write_config(paths["rslora"], use_rslora=True, lora_alpha=1e308)
    for name, poison in (("nan", np.nan), ("inf", np.inf)):
        bad = random_adapter(cfg, 4, 9)
        key = next(iter(bad.weights))
        a, b = bad.weights[key]
        bad.weights[key] = (a, b.copy())
        bad.weights[key][1][1, 2] = poison
        paths[name] = save_adapter(bad, cfg, root / name)
    huge = random_adapter(cfg, 4, 10)
    huge.weights = {k: (a, b * 1e36) for k, (a, b) in huge.weights.items()}  # x 1e4 overflows
    paths["huge_b"] = save_adapter(huge, cfg, root / "huge_b", lora_alpha=4e4)
    for name, alpha in (("alpha", 1e308), ("alpha_nan", float("nan"))):
        paths[name] = save_adapter(random_adapter(cfg, 4, 11), cfg, root / name, lora_alpha=alpha)
    paths["slow_regex"] = save_adapter(random_adapter(cfg, 4, 12), cfg, root / "slow_regex")
    _write_config(paths["slow_regex"], target_modules=PATHOLOGICAL)
    paths["digits"] = save_adapter(random_adapter(cfg, 4, 13), cfg, root / "digits")
    text = (paths["digits"] / "adapter_config.json").read_text()
    (paths["digits"] / "adapter_config.json").write_text(text.replace('"r": 4', '"r": ' + "9" * 5000))
    for name, depth in (("deep", 100_000), ("deepish", 900)):
        paths[name] = save_adapter(random_adapter(cfg, 4, 14), cfg, root / name)
        text = (paths[name] / "adapter_config.json").read_text()
        nested = "[" * depth + "]" * depth
        (paths[name] / "adapter_config.json").write_text(
            text.replace('"modules_to_save": null', f'"modules_to_save": {nested}'))
    paths["oversized"] = save_adapter(random_adapter(cfg, 4, 15), cfg, root / "oversized")
    with open(paths["oversized"] / "adapter_model.safetensors", "ab") as f:
        f.truncate(64 << 20)  # sparse: past any rank-4 adapter of this model, read or not
    return paths


def start_lora_server(root: Path):
    """The tiny model with --enable-lora, shared by test_lora_server.py and test_lora_hard_edges.py
    (one engine and compile for both): "sql" and "good" loaded at start; "main" allows runtime
    loading, "locked" does not. `paths` maps each file's adapter names to their directories, `cfg`
    is the model's config."""
    from server_harness import MAX_MODEL_LEN, MODEL, ServerThread, make_tiny_model_dir, server_args
    model_dir = make_tiny_model_dir(root / "model")
    cfg = load_config(model_dir)
    paths = {**_served_adapters(cfg, root), **_hostile_adapters(cfg, root)}
    args = EngineArgs(model=str(model_dir), served_model_name=MODEL, dtype="float32",
                      max_model_len=MAX_MODEL_LEN, block_size=16, num_blocks=64, max_num_seqs=4,
                      max_num_batched_tokens=32, compilation_cache_dir="",
                      attention_backend="reference", warmup=False, decode_steps_per_call=1,
                      enable_lora=True, max_loras=2, max_lora_rank=8,
                      lora_modules=[f"sql={paths['sql']}", f"good={paths['good']}"])
    st = ServerThread(args, {"main": server_args(allow_runtime_lora_updating=True),
                             "locked": server_args()},
                      engine_core="in-process").start()  # (a test writes a slot itself)
    st.paths, st.cfg = paths, cfg
    return st
