"""The safetensors file format read and written directly, for the 8-bit dtypes (F8_E4M3, I8) the
`safetensors` numpy binding cannot hand out or store: an 8-byte little-endian header length, a JSON
header {name: {dtype, shape, data_offsets}}, then the tensors' bytes."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

NP_DTYPES = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "I8": np.int8, "BF16": ml_dtypes.bfloat16,
             "F16": np.float16, "F32": np.float32}
_CODES = {np.dtype(v): k for k, v in NP_DTYPES.items()}


def read_header(path: Path) -> tuple[dict, int]:
    """(header without __metadata__, byte offset of the data section)."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header, 8 + n


def tensor_view(path: Path, entry: dict, data_start: int) -> np.ndarray:
    """One tensor of the file, memory-mapped (nothing is read until it is indexed)."""
    start, end = entry["data_offsets"]
    dtype = np.dtype(NP_DTYPES[entry["dtype"]])
    raw = np.memmap(path, dtype=np.uint8, mode="r", offset=data_start + start, shape=(end - start,))
    return raw.view(dtype).reshape(entry["shape"])


def write(tensors: dict[str, np.ndarray], path: Path, metadata: dict[str, str] | None = None) -> None:
    header: dict = {"__metadata__": metadata} if metadata else {}
    offset = 0
    arrays = {name: np.ascontiguousarray(a) for name, a in sorted(tensors.items())}
    for name, a in arrays.items():
        header[name] = {"dtype": _CODES[a.dtype], "shape": list(a.shape),
                        "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the format aligns the data section to 8 bytes
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for a in arrays.values():
            f.write(a.tobytes())
