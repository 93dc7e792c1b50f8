"""Which collectives of a compiled step sit inside control flow (a conditional's branches, a while
loop's body or condition), read from its HLO text (`jax.stages.Compiled.as_text()`).

Why it matters: with XLA's command buffers taking collectives (XLA_FLAGS
--xla_gpu_enable_command_buffer=+COLLECTIVES), a step becomes CUDA graphs whose conditionals are
graph conditional nodes; a collective inside one made the TP = 2 sampler's graph fail to
instantiate (CUDA_ERROR_INVALID_VALUE on H200, jax 0.11.2). The sampler is therefore laid out so
that its conditionals are collective-free (jaxinfer/parallel/sampling_logits.py), and the tests
check the compiled HLO with `collectives_in_control_flow`. A computation is inside control flow
when a conditional or while instruction runs it, or when it is reached from one through any other
call (fusions, reducers, async wrappers, nested control flow).
"""

from __future__ import annotations

import dataclasses

from jaxinfer.bench.profile.hlo_text import Instr, parse

# Collective opcodes; their async "-start" forms count as them (the "-done" halves only wait).
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "ragged-all-to-all",
               "collective-permute", "collective-broadcast")


@dataclasses.dataclass(frozen=True)
class CollectiveSite:
    op: str             # e.g. "all-gather" (an async "-start" is named by its collective)
    instruction: str    # the instruction's name in the HLO text
    computation: str    # the computation holding it
    inside: tuple[str, ...]  # the control-flow instructions it runs under, e.g. ("conditional.3",)

    def __str__(self) -> str:
        return f"{self.op} {self.instruction} in {self.computation} under {', '.join(self.inside)}"


def _collective(instr: Instr) -> str | None:
    op = instr.opcode.removesuffix("-start")
    return op if op in COLLECTIVES else None


def collectives_in_control_flow(hlo_text: str, kinds: tuple[str, ...] = ("conditional", "while")
                                ) -> list[CollectiveSite]:
    """Every collective that runs inside a conditional or while instruction of one of `kinds`."""
    module = parse(hlo_text)
    under: dict[str, set[str]] = {}
    for instrs in module.comps.values():
        for control in instrs:
            if control.opcode in kinds:
                for called in control.called:
                    for comp in module.reachable(called):
                        under.setdefault(comp, set()).add(control.name)
    return [CollectiveSite(op, i.name, comp, tuple(sorted(insts)))
            for comp, insts in under.items() for i in module.comps[comp]
            if (op := _collective(i))]


def count_collectives(hlo_text: str) -> int:
    """Collective instructions anywhere in the module (async pairs counted once)."""
    return sum(1 for instrs in parse(hlo_text).comps.values() for i in instrs if _collective(i))
