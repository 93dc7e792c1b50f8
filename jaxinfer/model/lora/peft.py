"""LoRA adapters in PEFT's format: `adapter_config.json` + `adapter_model.safetensors`, read and
checked against the base model into host arrays (`LoRAAdapter`).

What is read: `r`, `lora_alpha`, `use_rslora` (scaling alpha / sqrt(r) instead of alpha / r),
`target_modules` (a list of module names or a regex over module paths, as in PEFT). The seven
linear projections of a dense layer are supported (q/k/v/o_proj, gate/up/down_proj) and the
attention projections of a MoE layer; anything that would change other weights or the arithmetic
(`modules_to_save`, DoRA, LoRA biases, per-module rank/alpha patterns, ...) is refused with a
`LoRAAdapterError` naming the field, as is a rank above `max_lora_rank`, a tensor of the wrong shape
or for a module the model does not have, and a missing file.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import numpy as np
from safetensors import safe_open

from jaxinfer.errors import InvalidRequestError
from jaxinfer.model.config import ModelConfig

ATTN_PROJS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_PROJS = ("gate_proj", "up_proj", "down_proj")
PROJS = ATTN_PROJS + MLP_PROJS
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

# adapter_config.json fields whose non-default value would change more than the seven projections'
# low-rank deltas: (field, the values that mean "off").
_REFUSED = (("modules_to_save", (None, [])), ("use_dora", (None, False)), ("bias", (None, "none")),
            ("rank_pattern", (None, {})), ("alpha_pattern", (None, {})),
            ("fan_in_fan_out", (None, False)), ("layers_to_transform", (None, [])),
            ("layer_replication", (None, [])), ("target_parameters", (None, [])),
            ("exclude_modules", (None, [], "")))
_TENSOR = re.compile(r"(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp|block_sparse_moe)"
                     r"\.(.+)\.lora_([AB])(?:\.default)?\.weight")


class LoRAAdapterError(InvalidRequestError):
    """An adapter the engine cannot serve; `param` names the adapter_config.json field (or
    `lora_path` for the files) at fault."""


@dataclasses.dataclass
class LoRAAdapter:
    """One adapter on the host: per (layer, projection) A [in, r] and B [r, out] float32 (PEFT's
    lora_A / lora_B, transposed to the model's [in, out] layout), and its scale."""
    name: str
    rank: int
    scaling: float
    weights: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def projection_shape(cfg: ModelConfig, proj: str) -> tuple[int, int]:
    """(in, out) features of a projection of a layer."""
    h, d, f = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    return {"q_proj": (h, cfg.num_heads * d), "k_proj": (h, cfg.num_kv_heads * d),
            "v_proj": (h, cfg.num_kv_heads * d), "o_proj": (cfg.num_heads * d, h),
            "gate_proj": (h, f), "up_proj": (h, f), "down_proj": (f, h)}[proj]


def layer_projections(cfg: ModelConfig, layer: int) -> tuple[str, ...]:
    """The projections of `layer` an adapter may target (a MoE layer's experts are not, nor MLA's
    latent projections: model/mla.py)."""
    attn = () if cfg.mla else ATTN_PROJS
    return attn if cfg.layer_is_moe(layer) else attn + MLP_PROJS


def _read_config(path: Path) -> dict:
    if not path.is_dir():
        raise LoRAAdapterError(f"LoRA adapter directory '{path}' does not exist", "lora_path")
    file = path / CONFIG_FILE
    if not file.is_file():
        raise LoRAAdapterError(f"'{path}' has no {CONFIG_FILE}", "lora_path")
    try:
        config = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise LoRAAdapterError(f"'{file}' is not valid JSON: {e}", "lora_path") from None
    if not isinstance(config, dict):
        raise LoRAAdapterError(f"'{file}' must hold a JSON object", "lora_path")
    return config


def _scaling(config: dict, max_rank: int) -> tuple[int, float]:
    r = config.get("r")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise LoRAAdapterError(f"adapter_config.json: r must be a positive integer, got {r!r}", "r")
    if r > max_rank:
        raise LoRAAdapterError(f"adapter_config.json: r={r} exceeds --max-lora-rank {max_rank}", "r")
    alpha = config.get("lora_alpha", 8)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise LoRAAdapterError(f"adapter_config.json: lora_alpha must be a number, got {alpha!r}",
                               "lora_alpha")
    rslora = config.get("use_rslora", False)
    return r, float(alpha) / (math.sqrt(r) if rslora else r)


def _check_refused(config: dict) -> None:
    for field, off in _REFUSED:
        if config.get(field) not in off:
            raise LoRAAdapterError(f"adapter_config.json: {field}={config[field]!r} is not "
                                   f"supported (only plain LoRA on the linear projections)", field)
    task = config.get("peft_type", "LORA")
    if str(task).upper() != "LORA":
        raise LoRAAdapterError(f"adapter_config.json: peft_type {task!r} is not LORA", "peft_type")


def _targets(config: dict) -> set[str] | re.Pattern:
    targets = config.get("target_modules")
    if isinstance(targets, str):
        if targets == "all-linear":
            return set(PROJS)
        try:
            return re.compile(targets)
        except re.error as e:
            raise LoRAAdapterError(f"adapter_config.json: target_modules is not a valid regex: {e}",
                                   "target_modules") from None
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
        raise LoRAAdapterError("adapter_config.json: target_modules must be a non-empty list of "
                               "module names or a regex", "target_modules")
    unknown = sorted(set(targets) - set(PROJS))
    if unknown:
        raise LoRAAdapterError(f"adapter_config.json: target_modules {unknown} are not supported "
                               f"(supported: {', '.join(PROJS)})", "target_modules")
    return set(targets)


def _module_targeted(targets, module_path: str, proj: str) -> bool:
    if isinstance(targets, re.Pattern):
        return targets.fullmatch(module_path) is not None
    return proj in targets


def load_adapter(path: str | Path, cfg: ModelConfig, max_rank: int,
                 name: str | None = None) -> LoRAAdapter:
    """Read and check a PEFT adapter directory against `cfg`. Raises LoRAAdapterError."""
    path = Path(path)
    config = _read_config(path)
    _check_refused(config)
    rank, scaling = _scaling(config, max_rank)
    targets = _targets(config)
    file = path / WEIGHTS_FILE
    if not file.is_file():
        raise LoRAAdapterError(f"'{path}' has no {WEIGHTS_FILE} (other formats are not read)",
                               "lora_path")
    try:
        with safe_open(str(file), framework="numpy") as f:
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except Exception as e:  # any unreadable file is the adapter's fault
        raise LoRAAdapterError(f"'{file}' cannot be read: {e}", "lora_path") from None
    return adapter_from_tensors(tensors, cfg, rank, scaling, name or path.name, targets)


def adapter_from_tensors(tensors: dict, cfg: ModelConfig, rank: int, scaling: float, name: str,
                         targets: set[str] | re.Pattern = frozenset(PROJS)) -> LoRAAdapter:
    """An adapter from PEFT-named tensors (`...layers.{i}.self_attn.q_proj.lora_A.weight`
    [r, in], `lora_B.weight` [out, r]: what adapter_model.safetensors and PEFT's
    get_peft_model_state_dict hold), checked against `cfg`. Raises LoRAAdapterError."""
    parts: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for tensor, value in tensors.items():
        m = _TENSOR.fullmatch(tensor)
        if m is None:
            raise LoRAAdapterError(f"{WEIGHTS_FILE}: tensor '{tensor}' is not a LoRA weight of a "
                                   f"decoder layer's projection", "target_modules")
        layer, block, proj, which = int(m[1]), m[2], m[3], m[4]
        if layer >= cfg.num_layers:
            raise LoRAAdapterError(f"{WEIGHTS_FILE}: '{tensor}' is for layer {layer}; the model "
                                   f"has {cfg.num_layers}", "target_modules")
        if proj not in layer_projections(cfg, layer) or (
                (proj in ATTN_PROJS) != (block == "self_attn")):
            what = ("MoE experts are not supported" if cfg.layer_is_moe(layer)
                    and block != "self_attn" else "the model has no such projection")
            raise LoRAAdapterError(f"{WEIGHTS_FILE}: '{tensor}' targets {block}.{proj} of layer "
                                   f"{layer}: {what}", "target_modules")
        parts.setdefault((layer, proj), {})[which] = np.asarray(value, np.float32)
    weights = {}
    for (layer, proj), ab in sorted(parts.items()):
        module = f"model.layers.{layer}.{'self_attn' if proj in ATTN_PROJS else 'mlp'}.{proj}"
        if not _module_targeted(targets, module, proj):
            raise LoRAAdapterError(f"{WEIGHTS_FILE} holds weights for {module}, which "
                                   f"target_modules does not name", "target_modules")
        if set(ab) != {"A", "B"}:
            raise LoRAAdapterError(f"{WEIGHTS_FILE}: {module} has lora_{'A' if 'B' in ab else 'B'} "
                                   f"missing", "lora_path")
        fan_in, fan_out = projection_shape(cfg, proj)
        a, b = ab["A"], ab["B"]
        if a.shape != (rank, fan_in) or b.shape != (fan_out, rank):
            raise LoRAAdapterError(
                f"{WEIGHTS_FILE}: {module} has lora_A {list(a.shape)} and lora_B {list(b.shape)}; "
                f"r={rank} on this model needs [{rank}, {fan_in}] and [{fan_out}, {rank}]", "r")
        weights[(layer, proj)] = (np.ascontiguousarray(a.T), np.ascontiguousarray(b.T))
    if not weights:
        raise LoRAAdapterError(f"{WEIGHTS_FILE} holds no LoRA weights", "target_modules")
    return LoRAAdapter(name, rank, scaling, weights)


def peft_tensors(adapter: LoRAAdapter) -> dict[str, np.ndarray]:
    """`adapter`'s weights under PEFT's tensor names and layouts (adapter_from_tensors' inverse)."""
    tensors = {}
    for (layer, proj), (a, b) in adapter.weights.items():
        block = "self_attn" if proj in ATTN_PROJS else "mlp"
        stem = f"base_model.model.model.layers.{layer}.{block}.{proj}"
        tensors[f"{stem}.lora_A.weight"] = np.ascontiguousarray(a.T)
        tensors[f"{stem}.lora_B.weight"] = np.ascontiguousarray(b.T)
    return tensors


def save_adapter(adapter: LoRAAdapter, cfg: ModelConfig, out_dir: str | Path,
                 lora_alpha: float | None = None) -> Path:
    """Write `adapter` in PEFT's format (tests, examples: what a trainer's save_pretrained writes)."""
    from safetensors.numpy import save_file
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(peft_tensors(adapter), str(out / WEIGHTS_FILE))
    alpha = adapter.scaling * adapter.rank if lora_alpha is None else lora_alpha
    config = {"peft_type": "LORA", "r": adapter.rank, "lora_alpha": alpha,
              "target_modules": sorted({p for _, p in adapter.weights}), "bias": "none",
              "modules_to_save": None, "use_rslora": False}
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2))
    return out
