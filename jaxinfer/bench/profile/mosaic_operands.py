"""What feeds each operand of a program's Mosaic GPU kernels, read from its optimized HLO: Mosaic GPU
refuses at launch an operand that does not start on a 256-byte boundary ("Input buffer N is not
256-byte aligned"), and XLA may hand a custom call a slice of a larger buffer as a view. For each
`mosaic_gpu_v2` call: every operand's defining instruction and, for a slice along the leading
dimension (a view), its byte offset and whether that is aligned.

    XLA_FLAGS="--xla_dump_to=DIR --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*packed_forward.*" \\
        jaxinfer ...   # any run that compiles the program on a GPU
    python -m jaxinfer.bench.profile.mosaic_operands DIR/*packed_forward*after_optimizations.txt
"""

from __future__ import annotations

import argparse
import math
import re

from jaxinfer.bench.profile.hlo_text import SHAPE, Instr, dtype_bytes, parse

MOSAIC_TARGET = "mosaic_gpu_v2"
ALIGN = 256  # bytes (jaxlib's mosaic::gpu::kExpectedHbmAlignment)
_PASS_THROUGH = ("bitcast", "copy-start", "copy-done")


def slice_offset(instr: Instr, source: Instr) -> int | None:
    """Byte offset of a `slice` of `source` that only cuts its leading dimension (a view into the
    same buffer); None for any other slice (XLA copies those)."""
    starts = re.findall(r"\[(\d+):(\d+)(?::\d+)?\]", instr.attrs)
    dims = [int(x) for x in (SHAPE.search(source.type).group(2) or "0").split(",") if x]
    if not starts or len(starts) != len(dims):
        return None
    if any(int(lo) != 0 or int(hi) != d for (lo, hi), d in zip(starts[1:], dims[1:])):
        return None
    row_bytes = math.prod(dims[1:]) * dtype_bytes(source.dtype)
    return int(int(starts[0][0]) * row_bytes)


def mosaic_operands(hlo_text: str) -> list[dict]:
    """Per Mosaic GPU call (in program order): its name and, per operand, the defining
    instruction (past bitcasts), its opcode and type, and for a leading-dimension slice its byte
    offset and `aligned`."""
    module = parse(hlo_text)
    out = []
    for comp, instrs in module.comps.items():
        index = module.index[comp]
        for call in instrs:
            if call.opcode != "custom-call" or call.impl != MOSAIC_TARGET:
                continue
            operands = []
            for name in call.operands:
                src = index.get(name)
                while (src is not None and src.opcode in _PASS_THROUGH and src.operands
                       and src.operands[0] in index):
                    src = index[src.operands[0]]
                entry = {"operand": name, "from": src.name if src else name,
                         "opcode": src.opcode if src else "?", "type": src.type if src else "?"}
                if src is not None and src.opcode == "slice" and src.operands:
                    base = index.get(src.operands[0])
                    offset = None if base is None else slice_offset(src, base)
                    if offset is not None:
                        entry.update(offset_bytes=offset, aligned=offset % ALIGN == 0)
                operands.append(entry)
            out.append({"call": call.name, "computation": comp, "operands": operands})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("hlo", nargs="+", help="optimized HLO text files (XLA's dump)")
    args = p.parse_args()
    for path in args.hlo:
        with open(path) as f:
            calls = mosaic_operands(f.read())
        print(f"== {path}: {len(calls)} Mosaic GPU calls")
        for c in calls:
            bad = [o for o in c["operands"] if o.get("aligned") is False]
            print(f"  {c['call']}{'  UNALIGNED' if bad else ''}")
            for i, o in enumerate(c["operands"]):
                where = (f" at byte {o['offset_bytes']}{'' if o['aligned'] else ' (unaligned)'}"
                         if "offset_bytes" in o else "")
                print(f"    {i}: {o['from']} = {o['opcode']} {o['type']}{where}")


if __name__ == "__main__":
    main()
