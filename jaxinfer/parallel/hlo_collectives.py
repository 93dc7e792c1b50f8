"""Which collectives of a compiled step sit inside control flow (a conditional's branches, a while
loop's body or condition), read from its HLO text (`jax.stages.Compiled.as_text()`).

Why it matters: with XLA's command buffers taking collectives (XLA_FLAGS
--xla_gpu_enable_command_buffer=+COLLECTIVES), a step becomes CUDA graphs whose conditionals are
graph conditional nodes; a collective inside one made the TP = 2 sampler's graph fail to
instantiate (CUDA_ERROR_INVALID_VALUE on H200, jax 0.11.2). The sampler is therefore laid out so
that its conditionals are collective-free (jaxinfer/parallel/sampling_logits.py), and the tests
check the compiled HLO with `collectives_in_control_flow`.

The HLO text format: computations `[ENTRY ]%name (params) -> shape {` ... `}`, one instruction a
line, `%x = shape opcode(operands), attr=..., calls=%c, ...`. A computation is inside control flow
when a conditional or while instruction names it, or when it is reached from one through any
other reference (fusions' `calls=`, `to_apply=`, async wrappers, nested control flow).
"""

from __future__ import annotations

import dataclasses
import re

# Collective opcodes, with their async -start forms (the -done halves only wait for them).
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "ragged-all-to-all",
               "collective-permute", "collective-broadcast")
_COLLECTIVE_OP = re.compile(r"\s(" + "|".join(map(re.escape, COLLECTIVES)) + r")(-start)?\(")
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=")
_CONTROL_OP = re.compile(r"\s(conditional|while)\(")
# Attributes naming called computations: one (`calls=%c`) or a list (`branch_computations={%a, %b}`).
_CALL_ATTR = re.compile(r"\b(calls|to_apply|condition|body|true_computation|false_computation|"
                        r"branch_computations|called_computations)=(\{[^}]*\}|%?[\w.\-]+)")
_NAME = re.compile(r"%?([\w.\-]+)")


@dataclasses.dataclass(frozen=True)
class CollectiveSite:
    op: str             # e.g. "all-gather" (an async "-start" is named by its collective)
    instruction: str    # the instruction's name in the HLO text
    computation: str    # the computation holding it
    inside: tuple[str, ...]  # the control-flow instructions it runs under, e.g. ("conditional.3",)

    def __str__(self) -> str:
        return f"{self.op} {self.instruction} in {self.computation} under {', '.join(self.inside)}"


def _parse(hlo_text: str):
    """-> (computation -> its instruction lines, computation -> the computations it calls,
    [(control-flow instruction, kind, the computations it runs)])."""
    lines: dict[str, list[str]] = {}
    calls: dict[str, set[str]] = {}
    control: list[tuple[str, str, list[str]]] = []
    current = None
    for line in hlo_text.splitlines():
        if current is None:
            m = _COMPUTATION.match(line)
            if m and "=" not in line.split("(", 1)[0]:
                current = m.group(1)
                lines[current], calls[current] = [], set()
            continue
        if line.startswith("}"):
            current = None
            continue
        lines[current].append(line)
        called = [n for _, ref in _CALL_ATTR.findall(line) for n in _NAME.findall(ref)]
        calls[current].update(called)
        m = _CONTROL_OP.search(line)
        inst = _INSTRUCTION.match(line)
        if m and inst:
            runs = [n for attr, ref in _CALL_ATTR.findall(line)
                    if attr not in ("calls", "to_apply") for n in _NAME.findall(ref)]
            control.append((inst.group(1), m.group(1), runs))
    return lines, calls, control


def collectives_in_control_flow(hlo_text: str, kinds: tuple[str, ...] = ("conditional", "while")
                                ) -> list[CollectiveSite]:
    """Every collective that runs inside a conditional or while instruction of one of `kinds`."""
    lines, calls, control = _parse(hlo_text)
    under: dict[str, set[str]] = {}
    for inst, kind, runs in control:
        if kind not in kinds:
            continue
        stack, seen = list(runs), set()
        while stack:
            comp = stack.pop()
            if comp in seen or comp not in calls:
                continue
            seen.add(comp)
            under.setdefault(comp, set()).add(inst)
            stack.extend(calls[comp])
    sites = []
    for comp, insts in under.items():
        for line in lines[comp]:
            m = _COLLECTIVE_OP.search(line)
            name = _INSTRUCTION.match(line)
            if m and name:
                sites.append(CollectiveSite(m.group(1), name.group(1), comp, tuple(sorted(insts))))
    return sites


def count_collectives(hlo_text: str) -> int:
    """Collective instructions anywhere in the module (async pairs counted once)."""
    return sum(1 for line in hlo_text.splitlines()
               if _INSTRUCTION.match(line) and _COLLECTIVE_OP.search(line))
