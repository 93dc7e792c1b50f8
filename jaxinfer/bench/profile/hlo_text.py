"""A reader of optimized HLO text (what `jax.jit(f).lower(...).compile().as_text()` prints): its
computations, their instructions (name, type, opcode, operands, attributes) and which computations
each instruction runs. Shared by hlo_weight_reads.py and
hlo_collectives.py.
"""

from __future__ import annotations

import dataclasses
import math
import re

DTYPE_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2,
               "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8,
               "c128": 16}
SHAPE = re.compile(r"\b([a-z]\w*?)\[([\d,]*)\]")
COMP = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
INSTR = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s+([a-z][\w\-]*)\((.*)$")


def dtype_bytes(dtype: str) -> float:
    if dtype.startswith("f8"):
        return 1
    return DTYPE_BYTES.get(dtype, 4)


@dataclasses.dataclass
class Instr:
    name: str
    type: str
    opcode: str
    operands: list[str]
    attrs: str
    operands_text: str = ""  # a parameter's holds its number

    @property
    def arrays(self) -> list[tuple[str, int]]:
        """(dtype, elements) of every array in the instruction's type (one, or a tuple's)."""
        return [(d, math.prod(int(x) for x in dims.split(",") if x))
                for d, dims in SHAPE.findall(self.type)]

    @property
    def dtype(self) -> str:
        arrays = self.arrays
        return arrays[0][0] if arrays else "?"

    @property
    def elements(self) -> int:
        arrays = self.arrays
        return arrays[0][1] if arrays else 0

    @property
    def nbytes(self) -> float:
        return sum(n * dtype_bytes(d) for d, n in self.arrays)

    def attr(self, key: str) -> str | None:
        m = re.search(rf"\b{key}=%?([\w.\-$]+)", self.attrs)
        return m and m.group(1)

    @property
    def called(self) -> list[str]:
        """The computations this instruction runs (fusion, call, while, conditional, async
        wrapper, reduce's reducer...)."""
        names = re.findall(r"\b(?:calls|to_apply|body|condition|true_computation|false_computation)"
                           r"=%?([\w.\-]+)", self.attrs)
        for group in re.findall(r"(?:branch_computations|called_computations)=\{([^}]*)\}",
                                self.attrs):
            names += re.findall(r"%?([\w.\-]+)", group)
        return names

    @property
    def impl(self) -> str:
        """A fusion's backend kind (`__triton_gemm`, ...) or `kind=`, a custom call's target."""
        target = re.search(r'custom_call_target="([^"]+)"', self.attrs)
        if target:
            return target.group(1)
        kind = re.search(r'"kind":"(__[\w$]+)"', self.attrs)
        if kind:
            return kind.group(1)
        return self.attr("kind") or self.opcode

    @property
    def label(self) -> str:
        m = re.search(r'op_name="([^"]*)"', self.attrs)
        return m.group(1).replace("\\'", "'") if m else self.name


def _split_operands(rest: str) -> tuple[str, str]:
    """(the operand list, the attributes after it) from the text after `opcode(`."""
    depth = 1
    for i, ch in enumerate(rest):
        if ch in "({[":
            depth += 1
        elif ch in ")}]":
            depth -= 1
            if depth == 0:
                return rest[:i], rest[i + 1:]
    return rest, ""


@dataclasses.dataclass
class Module:
    comps: dict[str, list[Instr]]
    entry: str
    aliased: set[int]  # entry parameters donated to an output (a KV cache): not weights

    def __post_init__(self):
        self.index = {c: {i.name: i for i in instrs} for c, instrs in self.comps.items()}
        self.users: dict[str, dict[str, list[Instr]]] = {}
        for c, instrs in self.comps.items():
            users: dict[str, list[Instr]] = {}
            for i in instrs:
                for op in dict.fromkeys(i.operands):
                    users.setdefault(op, []).append(i)
            self.users[c] = users

    def reachable(self, comp: str) -> list[str]:
        """`comp` and the computations it calls, transitively."""
        out, todo, seen = [], [comp], set()
        while todo:
            c = todo.pop()
            if c in seen or c not in self.comps:
                continue
            seen.add(c)
            out.append(c)
            for i in self.comps[c]:
                todo += i.called
        return out

    def inner(self, comp: str) -> list[Instr]:
        """Every instruction of `comp` and of the computations it calls, transitively."""
        return [i for c in self.reachable(comp) for i in self.comps[c]]


def parse(text: str) -> Module:
    comps: dict[str, list[Instr]] = {}
    entry, current, aliased = "", None, set()
    for line in text.splitlines():
        if line.startswith("HloModule"):
            aliased = {int(n) for n in re.findall(r"\(\s*(\d+)\s*,\s*\{[^}]*\}\s*,\s*\w+-alias\s*\)",
                                                  line)}
            continue
        if current is None:
            m = COMP.match(line)
            if m:
                current = m.group(2)
                comps[current] = []
                entry = current if m.group(1) else entry
            continue
        if line.strip() == "}":
            current = None
            continue
        m = INSTR.match(line)
        if not m:
            continue
        operands, attrs = _split_operands(m.group(5))
        comps[current].append(Instr(m.group(2), m.group(3), m.group(4),
                                    re.findall(r"%([\w.\-]+)", operands), attrs, operands))
    if not entry:
        raise ValueError("no ENTRY computation: not an HLO module's text")
    return Module(comps, entry, aliased)
