"""Where each parameter lives in a safetensors checkpoint, and how to read any slice of it.

`Checkpoint` reads only the files' headers; `weights._sources` maps each param path to a `Source`: its shape
in the param layout (Flax [in, out] kernels, experts stacked [E, in, out]) and `read(index)`, which
reads just that index's slice from the memory-mapped files. `jax.make_array_from_callback` calls it
once per device shard, so under tensor parallelism each device reads only its slice and the host
never holds a whole model (a 140 GB checkpoint loads onto two GPUs with a few hundred MB of host
buffers).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors import safe_open

from jaxinfer.errors import CheckpointError
from jaxinfer.model import mxfp4
from jaxinfer.model.quant import st_format

DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16}
# Packed bytes: MXFP4 blocks and scales (jaxinfer/model/mxfp4.py), never a param as stored.
PACKED = "U8"
# Quantized weights (jaxinfer/model/quant), read from the file directly: the numpy binding of
# safetensors has no float8 type.
QUANTIZED_DTYPES = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "I8": np.int8}

# Per-expert names: group 1 layer, group 2 expert, group 3 projection, group 4 the tensor (the
# weight, or a quantized weight's scales).
EXPERT = re.compile(r"model\.layers\.(\d+)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\."
                    r"(w1|w2|w3|gate_proj|up_proj|down_proj)\.(weight|weight_scale(?:_inv)?)")
EXPERT_PARAM = {"w1": "w_gate", "gate_proj": "w_gate", "w3": "w_up", "up_proj": "w_up",
                "w2": "w_down", "down_proj": "w_down"}
# Fused expert tensors (transformers >= 5): gate_up_proj [E, 2F, H], down_proj [E, H, F].
FUSED = re.compile(r"model\.layers\.(\d+)\.(?:block_sparse_moe|mlp)\.experts\.(gate_up_proj|down_proj)")
# gpt-oss experts: gate_up_proj [E, H, 2F] (gate and up interleaved: even columns gate),
# down_proj [E, F, H], their biases, or MXFP4 `_blocks` + `_scales` of the [E, out, in] matrices.
GPT_OSS_EXPERTS = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)"
                             r"(_bias|_blocks|_scales)?")
# Not params: KV-cache scales are read by worker/kv/kv_scales.py; FP8 checkpoints' static
# activation scales are unused (activations are scaled per token at run time).
IGNORED = re.compile(r".*(rotary_emb\.inv_freq|\.input_scale(_ub)?|self_attn\.(k_scale|v_scale|kv_scale))$")

Index = tuple[slice, ...]


@dataclasses.dataclass
class Source:
    shape: tuple[int, ...]     # in the param layout
    read: Callable[[Index], np.ndarray]
    dtype: str = ""            # the checkpoint's dtype code ("BF16", "F8_E4M3", ...)

    def read_all(self) -> np.ndarray:
        return self.read(tuple(slice(None) for _ in self.shape))


def _bounds(sl: slice, n: int) -> range:
    return range(*sl.indices(n))


def _sl(r: range) -> slice:
    return slice(r.start, r.stop)


class Checkpoint:
    """Open safetensors files (memory-mapped) and their tensors' headers."""

    def __init__(self, files: list[Path]):
        self.handles: dict[str, tuple[Path, object]] = {}
        self.dtypes: dict[str, str] = {}
        self.raw: dict[str, np.ndarray] = {}  # memory-mapped 8-bit tensors
        for path in files:
            try:
                handle = safe_open(str(path), framework="np")
            except Exception as e:  # safetensors raises its own error types for corrupt headers
                raise CheckpointError(f"cannot read '{path}': {e}") from None
            for name in handle.keys():
                st_dtype = handle.get_slice(name).get_dtype()
                if st_dtype not in DTYPES and st_dtype not in QUANTIZED_DTYPES and st_dtype != PACKED:
                    raise CheckpointError(f"'{path.name}': tensor '{name}' has dtype {st_dtype}; "
                                          f"supported: {', '.join([*DTYPES, *QUANTIZED_DTYPES])}")
                self.handles[name] = (path, handle)
                self.dtypes[name] = st_dtype
            if any(self.dtypes[n] in QUANTIZED_DTYPES for n in handle.keys()):
                header, start = st_format.read_header(path)
                for name, entry in header.items():
                    if entry["dtype"] in QUANTIZED_DTYPES:
                        self.raw[name] = st_format.tensor_view(path, entry, start)

    def names(self) -> list[str]:
        return list(self.handles)

    def file_of(self, name: str) -> Path:
        return self.handles[name][0]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.handles[name][1].get_slice(name).get_shape())

    def read(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        if name in self.raw:
            return np.array(self.raw[name][index])
        return self.handles[name][1].get_slice(name)[index]


def plain(ckpt: Checkpoint, name: str, transpose: bool) -> Source:
    """A tensor stored as is, or an HF linear [out, in] read as a Flax kernel [in, out]."""
    shape = ckpt.shape(name)
    if not transpose:
        return Source(shape, lambda idx: ckpt.read(name, tuple(idx)), ckpt.dtypes[name])
    return Source(shape[::-1], lambda idx: ckpt.read(name, (idx[1], idx[0])).T, ckpt.dtypes[name])


def row_block(ckpt: Checkpoint, name: str, start: int, size: int, kernel: bool) -> Source:
    """Rows start .. start + size of a tensor stored [out, ...] (a fused linear's part): as a
    Flax kernel [in, size] (`kernel`), else as stored [size, ...] (a quantized linear's weight,
    its scales, a bias)."""
    shape = ckpt.shape(name)

    def read(idx: Index) -> np.ndarray:
        out_idx = idx[-1] if kernel else idx[0]
        r = _bounds(out_idx, size)
        rows = slice(start + r.start, start + r.stop)
        if kernel:
            return ckpt.read(name, (rows, idx[0])).T
        return ckpt.read(name, (rows, *idx[1:]))
    return Source((shape[1], size) if kernel else (size, *shape[1:]), read, ckpt.dtypes[name])


def scale_rows(ckpt: Checkpoint, name: str, start: int, size: int, out_rows: int) -> Source:
    """The scales of rows start .. start + size of a quantized linear of `out_rows` outputs whose
    scales `name` are per tensor (every part takes them whole), per channel ([out] or [out, 1]),
    or per block of rows ([out / b, in / b']: the part's blocks; its rows must start on a block)."""
    shape = ckpt.shape(name)
    if math.prod(shape) == 1:
        return plain(ckpt, name, False)
    block = 1 << max(0, math.ceil(math.log2(out_rows / shape[0])))
    if start % block or (size % block and start + size != out_rows):
        raise CheckpointError(f"'{name}' {list(shape)}: its {block}-row scale blocks do not "
                              f"split at rows {start} .. {start + size} of {out_rows}")
    return row_block(ckpt, name, start // block, -(-size // block), False)


def stacked_experts(ckpt: Checkpoint, names: list[str]) -> Source:
    """Per-expert [out, in] tensors stacked into [E, in, out]."""
    out_dim, in_dim = ckpt.shape(names[0])

    def read(idx: Index) -> np.ndarray:
        es = _bounds(idx[0], len(names))
        return np.stack([ckpt.read(names[e], (idx[2], idx[1])).T for e in es])
    return Source((len(names), in_dim, out_dim), read, ckpt.dtypes[names[0]])


def stacked_as_stored(ckpt: Checkpoint, names: list[str]) -> Source:
    """Per-expert tensors stacked as stored (quantized experts' scales, whatever their layout)."""
    def read(idx: Index) -> np.ndarray:
        return np.stack([ckpt.read(names[e], tuple(idx[1:])) for e in _bounds(idx[0], len(names))])
    return Source((len(names), *ckpt.shape(names[0])), read, ckpt.dtypes[names[0]])


def fused_gate_up(ckpt: Checkpoint, name: str, half: int) -> Source:
    """Gate (half 0) or up (half 1) of a fused [E, 2F, H] tensor, as [E, H, F]."""
    e, two_f, h = ckpt.shape(name)
    f = two_f // 2

    def read(idx: Index) -> np.ndarray:
        fs = _bounds(idx[2], f)
        rows = slice(half * f + fs.start, half * f + fs.stop)
        return ckpt.read(name, (idx[0], rows, idx[1])).transpose(0, 2, 1)
    return Source((e, h, f), read)


def fused_down(ckpt: Checkpoint, name: str) -> Source:
    """A fused down_proj [E, H, F] as [E, F, H]."""
    e, h, f = ckpt.shape(name)
    return Source((e, f, h), lambda idx: ckpt.read(name, (idx[0], idx[2], idx[1])).transpose(0, 2, 1))


def mxfp4_experts(ckpt: Checkpoint, blocks: str, scales: str) -> Source:
    """An MXFP4 expert stack (`blocks` [E, out, in/32, 16], `scales` [E, out, in/32]) dequantized
    and read as [E, in, out]; each read decodes only the blocks its slice covers."""
    e, out_dim, groups, _ = ckpt.shape(blocks)
    if ckpt.shape(scales) != (e, out_dim, groups):
        raise CheckpointError(f"'{scales}' has shape {list(ckpt.shape(scales))}, its blocks "
                              f"'{blocks}' imply {[e, out_dim, groups]}")
    in_dim = groups * mxfp4.BLOCK

    def read(idx: Index) -> np.ndarray:
        ins = _bounds(idx[1], in_dim)
        g = slice(ins.start // mxfp4.BLOCK, -(-ins.stop // mxfp4.BLOCK))
        part = mxfp4.dequantize(ckpt.read(blocks, (idx[0], idx[2], g, slice(None))),
                                ckpt.read(scales, (idx[0], idx[2], g)))
        first = g.start * mxfp4.BLOCK
        return part[..., ins.start - first:ins.stop - first].transpose(0, 2, 1)
    return Source((e, in_dim, out_dim), read, "MXFP4")


def stored(ckpt: Checkpoint, name: str) -> Source:
    """A tensor read as stored ([E, in, out] expert stacks of gpt-oss, biases)."""
    return plain(ckpt, name, transpose=False)


def interleaved(src: Source, half: int) -> Source:
    """Every other column of `src`'s last axis, from `half` (0: even, 1: odd): gpt-oss's gate and
    up, interleaved in gate_up_proj and its bias."""
    *lead, two_f = src.shape

    def read(idx: Index) -> np.ndarray:
        cols = _bounds(idx[-1], two_f // 2)
        both = src.read((*idx[:-1], slice(2 * cols.start, 2 * cols.stop)))
        return both[..., half::2]
    return Source((*lead, two_f // 2), read, src.dtype)


def depthwise_conv_weight(ckpt: Checkpoint, name: str) -> Source:
    """HF's depthwise Conv1d weight [C, 1, W] as the mixer's [W, C]."""
    c, _, w = ckpt.shape(name)
    return Source((w, c), lambda idx: ckpt.read(name, (idx[1], slice(None), idx[0]))[:, 0].T,
                  ckpt.dtypes[name])
