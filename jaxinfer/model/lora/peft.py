"""LoRA adapters in PEFT's format: `adapter_config.json` + `adapter_model.safetensors`, read and
checked against the base model into host arrays (`LoRAAdapter`).

What is read: `r`, `lora_alpha`, `use_rslora` (scaling alpha / sqrt(r) instead of alpha / r),
`target_modules` (a list of module names or a regex over module paths, as in PEFT). The seven
linear projections of a dense layer are supported (q/k/v/o_proj, gate/up/down_proj) and the
attention projections of a MoE layer; anything that would change other weights or the arithmetic
(`modules_to_save`, DoRA, LoRA biases, per-module rank/alpha patterns, ...) is refused with a
`LoRAAdapterError` naming the field, as is a rank above `max_lora_rank`, a tensor of the wrong shape
or for a module the model does not have, and a missing file.

The directory is a client's input (/v1/load_lora_adapter), so reading it is bounded: the path's
length and characters are checked before the file system sees it; adapter_config.json is at most
MAX_CONFIG_BYTES and the weights file no larger than a valid adapter of the model; nesting deeper
than json.loads recurses and integers of over MAX_INT_DIGITS digits are refused; a regex
`target_modules` is matched in a child process under a time limit (target_regex.py); the scaling
is finite and at most MAX_LORA_SCALING in magnitude, and every weight (times the scaling) is
finite: one NaN in a slot would otherwise reach every row of a step through the XLA path's expand
(delta.py selects such entries away as well).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import re
from pathlib import Path

import numpy as np
from safetensors import safe_open

from jaxinfer.errors import InvalidRequestError
from jaxinfer.model.config import ModelConfig
from jaxinfer.model.lora.target_regex import TargetRegexError, fullmatches
from jaxinfer.sampling_params import short_repr

ATTN_PROJS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_PROJS = ("gate_proj", "up_proj", "down_proj")
PROJS = ATTN_PROJS + MLP_PROJS
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
MAX_PATH_CHARS = 4096  # Linux's PATH_MAX
MAX_NAME_CHARS = 256   # lora_name: an identifier a request's `model` repeats
MAX_CONFIG_BYTES = 1 << 20  # PEFT writes about 1 KB
MAX_INT_DIGITS = 18
# |lora_alpha / r| (or / sqrt(r) with rsLoRA): trained adapters sit within ~100; the bound keeps
# the scale folded into B (and the adapter rows' activations) far from float overflow.
MAX_LORA_SCALING = 1e4
_FLOAT32_MAX = float(np.finfo(np.float32).max)

# adapter_config.json fields whose non-default value would change more than the seven projections'
# low-rank deltas: (field, the values that mean "off").
_REFUSED = (("modules_to_save", (None, [])), ("use_dora", (None, False)), ("bias", (None, "none")),
            ("rank_pattern", (None, {})), ("alpha_pattern", (None, {})),
            ("fan_in_fan_out", (None, False)), ("layers_to_transform", (None, [])),
            ("layer_replication", (None, [])), ("target_parameters", (None, [])),
            ("exclude_modules", (None, [], "")))
_TENSOR = re.compile(r"(?:base_model\.model\.)?model\.layers\.(\d{1,9})\.(self_attn|mlp|block_sparse_moe)"
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
    q_width = (2 if cfg.attn_output_gate else 1) * cfg.num_heads * d  # (+ the heads' gates)
    return {"q_proj": (h, q_width), "k_proj": (h, cfg.num_kv_heads * d),
            "v_proj": (h, cfg.num_kv_heads * d), "o_proj": (cfg.num_heads * d, h),
            "gate_proj": (h, f), "up_proj": (h, f), "down_proj": (f, h)}[proj]


def layer_projections(cfg: ModelConfig, layer: int) -> tuple[str, ...]:
    """The projections of `layer` an adapter may target (a MoE layer's experts are not, nor MLA's
    latent projections: model/mla.py, nor a state-space layer's: ModelConfig.layer_states)."""
    state = bool(cfg.layer_states) and cfg.layer_states[layer] is not None
    attn = () if cfg.mla or state else ATTN_PROJS
    return attn if cfg.layer_is_moe(layer) else attn + MLP_PROJS


def check_lora_name(name) -> str:
    """`name` as an adapter's name (a request's `model` picks it), or InvalidRequestError naming
    lora_name: a printable string (no control characters, no lone surrogates) of bounded length."""
    if not isinstance(name, str) or not name or len(name) > MAX_NAME_CHARS or not name.isprintable():
        raise InvalidRequestError(f"lora_name {short_repr(name)} must be a non-empty printable "
                                  f"string of at most {MAX_NAME_CHARS} characters", "lora_name")
    return name


def _check_path(path) -> Path:
    """`path` as a directory to look in, refused (lora_path) where the OS would raise instead."""
    if isinstance(path, Path):
        path = str(path)
    if not isinstance(path, str) or not path:
        raise LoRAAdapterError("lora_path must be a non-empty string", "lora_path")
    if len(path) > MAX_PATH_CHARS or "\0" in path:
        raise LoRAAdapterError(f"lora_path must be at most {MAX_PATH_CHARS} characters without NUL "
                               f"bytes", "lora_path")
    try:
        raw = os.fsencode(path)
    except UnicodeEncodeError:
        raise LoRAAdapterError("lora_path holds characters no file name can have (a lone "
                               "surrogate)", "lora_path") from None
    longest = max(len(part) for part in raw.split(b"/"))
    if longest > 255:
        raise LoRAAdapterError(f"lora_path has a component of {longest} bytes; file names are at "
                               f"most 255", "lora_path")
    return Path(path)


class _OversizedInt:
    """An integer literal of more than MAX_INT_DIGITS digits in adapter_config.json: no setting
    needs one, and int() refuses past 4300 digits; kept as its length so the field's own check
    names it."""

    def __init__(self, digits: int):
        self.digits = digits

    def __repr__(self) -> str:
        return f"<an integer of {self.digits} digits>"


def _json_int(text: str):
    return int(text) if len(text.lstrip("-")) <= MAX_INT_DIGITS else _OversizedInt(len(text))


def _read_config(path: Path) -> dict:
    file = path / CONFIG_FILE
    try:
        if not path.is_dir():
            raise LoRAAdapterError(f"LoRA adapter directory '{path}' does not exist", "lora_path")
        if not file.is_file():
            raise LoRAAdapterError(f"'{path}' has no {CONFIG_FILE}", "lora_path")
        with file.open("rb") as f:
            data = f.read(MAX_CONFIG_BYTES + 1)
        if len(data) > MAX_CONFIG_BYTES:
            raise LoRAAdapterError(f"'{file}' is over {MAX_CONFIG_BYTES} bytes; an adapter config "
                                   f"is about 1 KB", "lora_path")
        text = data.decode()
    except OSError as e:  # permissions, a name too long for this file system, ...
        raise LoRAAdapterError(f"'{path}' cannot be read: {e.strerror or type(e).__name__}",
                               "lora_path") from None
    except UnicodeDecodeError as e:
        raise LoRAAdapterError(f"'{file}' is not UTF-8: {e.reason}", "lora_path") from None
    try:
        config = json.loads(text, parse_int=_json_int)
    except RecursionError:
        raise LoRAAdapterError(f"'{file}' nests deeper than JSON parsing recurses", "lora_path") \
            from None
    except ValueError as e:  # JSONDecodeError among others
        raise LoRAAdapterError(f"'{file}' is not valid JSON: {str(e)[:200]}", "lora_path") from None
    if not isinstance(config, dict):
        raise LoRAAdapterError(f"'{file}' must hold a JSON object", "lora_path")
    return config


def _describe(value) -> str:
    """A config value for an error message: scalars cut short, containers by type only (a value
    may nest hundreds of levels deep: repr would recurse)."""
    if value is None or isinstance(value, (bool, int, float, str, _OversizedInt)):
        return short_repr(value)
    return f"a JSON {'object' if isinstance(value, dict) else 'array'}"


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _scaling(config: dict, max_rank: int) -> tuple[int, float]:
    r = config.get("r")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise LoRAAdapterError(f"adapter_config.json: r must be a positive integer, got "
                               f"{_describe(r)}", "r")
    if r > max_rank:
        raise LoRAAdapterError(f"adapter_config.json: r={r} exceeds --max-lora-rank {max_rank}", "r")
    alpha = config.get("lora_alpha", 8)
    if not _is_number(alpha) or not math.isfinite(alpha):
        raise LoRAAdapterError(f"adapter_config.json: lora_alpha must be a finite number, got "
                               f"{_describe(alpha)}", "lora_alpha")
    rslora = config.get("use_rslora", False)
    if not isinstance(rslora, bool):
        raise LoRAAdapterError(f"adapter_config.json: use_rslora must be true or false, got "
                               f"{_describe(rslora)}", "use_rslora")
    scaling = float(alpha) / (math.sqrt(r) if rslora else r)
    if abs(scaling) > MAX_LORA_SCALING:
        form = "lora_alpha / sqrt(r)" if rslora else "lora_alpha / r"
        raise LoRAAdapterError(f"adapter_config.json: the scaling {form} = {scaling:.4g} is over "
                               f"{MAX_LORA_SCALING:g} in magnitude", "lora_alpha")
    return r, scaling


def _check_refused(config: dict) -> None:
    for field, off in _REFUSED:
        if config.get(field) not in off:
            raise LoRAAdapterError(f"adapter_config.json: {field}={_describe(config[field])} is "
                                   f"not supported (only plain LoRA on the linear projections)",
                                   field)
    task = config.get("peft_type", "LORA")
    if not isinstance(task, str) or task.upper() != "LORA":
        raise LoRAAdapterError(f"adapter_config.json: peft_type {_describe(task)} is not LORA",
                               "peft_type")


def _targets(config: dict) -> frozenset[str] | str:
    """The projection names targeted, or a regex over module paths (matched by `_targeted`)."""
    targets = config.get("target_modules")
    if isinstance(targets, str):
        return frozenset(PROJS) if targets == "all-linear" else targets
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
        raise LoRAAdapterError("adapter_config.json: target_modules must be a non-empty list of "
                               "module names or a regex", "target_modules")
    unknown = sorted(set(targets) - set(PROJS))
    if unknown:
        raise LoRAAdapterError(f"adapter_config.json: target_modules {short_repr(unknown, 200)} are "
                               f"not supported (supported: {', '.join(PROJS)})", "target_modules")
    return frozenset(targets)


@functools.lru_cache(maxsize=64)
def _regex_targeted(pattern: str, modules: tuple[str, ...]) -> tuple[bool, ...]:
    # Cached: an adapter dropped from the host cache is read again on the engine thread at
    # admission (core/lora_slots.py), where a child process would stall every running row.
    # A refusal raises, and is not cached.
    return tuple(fullmatches(pattern, list(modules)))


def _targeted(targets: frozenset[str] | str, modules: list[str]) -> list[bool]:
    """Whether `targets` names each of `modules` (paths `model.layers.{i}.{block}.{proj}`)."""
    if not isinstance(targets, str):
        return [m.rpartition(".")[2] in targets for m in modules]
    try:
        return list(_regex_targeted(targets, tuple(modules)))
    except TargetRegexError as e:
        raise LoRAAdapterError(f"adapter_config.json: target_modules: {e}", "target_modules") \
            from None


def _max_weights_bytes(cfg: ModelConfig, rank: int) -> int:
    """The largest adapter_model.safetensors of rank `rank` for `cfg`: every projection targeted,
    in float64, plus a header of up to 1 MiB and 512 bytes per tensor."""
    pairs = [projection_shape(cfg, p) for i in range(cfg.num_layers)
             for p in layer_projections(cfg, i)]
    return 8 * rank * sum(i + o for i, o in pairs) + (1 << 20) + 1024 * len(pairs)


def load_adapter(path: str | Path, cfg: ModelConfig, max_rank: int,
                 name: str | None = None) -> LoRAAdapter:
    """Read and check a PEFT adapter directory against `cfg`. Raises LoRAAdapterError."""
    path = _check_path(path)
    config = _read_config(path)
    _check_refused(config)
    rank, scaling = _scaling(config, max_rank)
    targets = _targets(config)
    file = path / WEIGHTS_FILE
    try:
        if not file.is_file():
            raise LoRAAdapterError(f"'{path}' has no {WEIGHTS_FILE} (other formats are not read)",
                                   "lora_path")
        size, most = file.stat().st_size, _max_weights_bytes(cfg, rank)
        if size > most:  # refused before it is read into memory (on the engine thread)
            raise LoRAAdapterError(f"'{file}' is {size} bytes; a rank-{rank} adapter of this model "
                                   f"is at most {most}", "lora_path")
        with safe_open(str(file), framework="numpy") as f:
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except LoRAAdapterError:
        raise
    except Exception as e:  # any unreadable file is the adapter's fault
        raise LoRAAdapterError(f"'{file}' cannot be read: {str(e)[:200]}", "lora_path") from None
    return adapter_from_tensors(tensors, cfg, rank, scaling, name or path.name, targets)


def _as_float32(tensor: str, value) -> np.ndarray:
    try:
        out = np.asarray(value, np.float32)
    except (TypeError, ValueError) as e:
        raise LoRAAdapterError(f"{WEIGHTS_FILE}: '{tensor}' is not a float tensor: {e}",
                               "lora_path") from None
    if not np.isfinite(out).all():  # in float32: a float64 1e300 becomes inf here
        raise LoRAAdapterError(f"{WEIGHTS_FILE}: '{tensor}' holds NaN or infinite values",
                               "lora_path")
    return out


def adapter_from_tensors(tensors: dict, cfg: ModelConfig, rank: int, scaling: float, name: str,
                         targets: frozenset[str] | str = frozenset(PROJS)) -> LoRAAdapter:
    """An adapter from PEFT-named tensors (`...layers.{i}.self_attn.q_proj.lora_A.weight`
    [r, in], `lora_B.weight` [out, r]: what adapter_model.safetensors and PEFT's
    get_peft_model_state_dict hold), checked against `cfg`: shapes, finite values (B times
    `scaling` too). Raises LoRAAdapterError."""
    parts: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for tensor, value in tensors.items():
        m = _TENSOR.fullmatch(tensor)
        if m is None:
            raise LoRAAdapterError(f"{WEIGHTS_FILE}: tensor {short_repr(tensor, 200)} is not a LoRA "
                                   f"weight of a decoder layer's projection", "target_modules")
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
        parts.setdefault((layer, proj), {})[which] = _as_float32(tensor, value)
    modules = {key: f"model.layers.{key[0]}.{'self_attn' if key[1] in ATTN_PROJS else 'mlp'}."
                    f"{key[1]}" for key in sorted(parts)}
    for module, hit in zip(modules.values(), _targeted(targets, list(modules.values()))):
        if not hit:
            raise LoRAAdapterError(f"{WEIGHTS_FILE} holds weights for {module}, which "
                                   f"target_modules does not name", "target_modules")
    weights = {}
    for (layer, proj), module in modules.items():
        ab = parts[(layer, proj)]
        if set(ab) != {"A", "B"}:
            raise LoRAAdapterError(f"{WEIGHTS_FILE}: {module} has lora_{'A' if 'B' in ab else 'B'} "
                                   f"missing", "lora_path")
        fan_in, fan_out = projection_shape(cfg, proj)
        a, b = ab["A"], ab["B"]
        if a.shape != (rank, fan_in) or b.shape != (fan_out, rank):
            raise LoRAAdapterError(
                f"{WEIGHTS_FILE}: {module} has lora_A {list(a.shape)} and lora_B {list(b.shape)}; "
                f"r={rank} on this model needs [{rank}, {fan_in}] and [{fan_out}, {rank}]", "r")
        if b.size and float(np.abs(b).max()) * abs(scaling) > _FLOAT32_MAX:
            raise LoRAAdapterError(f"{WEIGHTS_FILE}: {module}'s lora_B times the scaling "
                                   f"{scaling:.4g} overflows float32", "lora_alpha")
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
