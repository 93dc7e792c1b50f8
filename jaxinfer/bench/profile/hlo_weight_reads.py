"""Which ops of an optimized HLO module read its large weight tensors, in which dtype, and whether
an 8-bit weight reaches its matmul directly (converted inside the matmul's own kernel) or through a
separate fusion that writes a wider copy of it every call.

    python -m jaxinfer.bench.profile.hlo_weight_reads STEP.txt.gz [--min-bytes 1048576] [--json] [--rows 40]

A decode step at batch 1 streams its weights, so its time is the bytes it moves: an e4m3 weight
read by the matmul costs 1 byte per value, one upcast to bf16 first costs 1 + 2 (the copy written)
+ 2 (the copy read by the matmul) = 5, more than the bf16 weight it replaces. The input is what
`jax.jit(f).lower(...).compile().as_text()` prints (`jaxinfer bench latency --suite bs1-step --
--hlo-out` writes it gzipped), from any backend: the GPU's Triton gemm fusions (`__triton_gemm`,
nested gemm fusions), cuBLAS custom calls behind a separate convert fusion, a dot rewritten as
multiply + reduce, command buffers (`call`); the CPU's convert fusions and plain `dot`s.

Weights are the entry computation's parameters of at least --min-bytes. Each is followed through
bitcasts, reshapes and calls to the ops that read it, which are classed:
  matmul  a dot, a gemm custom call, or a fusion holding one (`impl`: the fusion or call kind);
          `converts_to`: the dtype the weight is converted to inside that kernel, if any;
  reduce  a fusion with a reduce and no dot, smaller than the weight (a dot XLA rewrote);
  copy    anything else that writes an output at least the weight's size (a convert, transpose or
          copy fusion): its bytes are counted, and its readers followed in turn;
  other   the rest (a gather, a dynamic slice, a while loop's tuple: not followed).
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import re
import sys
from pathlib import Path

from jaxinfer.bench.profile.hlo_text import Instr, Module, parse

VIEWS = {"bitcast", "reshape"}  # no bytes move (XLA's GPU layouts make reshapes bitcasts)
MATMULS = {"dot", "scaled-dot", "convolution", "ragged-dot"}
GEMM_TARGET = re.compile(r"gemm|matmul|cublas|cudnn", re.I)


def _parameter_number(instr: Instr) -> int:
    return int(re.search(r"\d+", instr.operands_text).group())


def _params(module: Module, comp: str) -> dict[int, Instr]:
    return {_parameter_number(i): i for i in module.comps.get(comp, []) if i.opcode == "parameter"}


def _converts_inside(module: Module, fusion: Instr, operand: str) -> str | None:
    """The dtype a fusion's operand is converted to inside it (following nested fusions), if any."""
    todo = [(c, _params(module, c).get(k)) for c in fusion.called[:1]
            for k, op in enumerate(fusion.operands) if op == operand]
    while todo:
        comp, param = todo.pop()
        if param is None:
            continue
        for user in module.users[comp].get(param.name, []):
            if user.opcode == "convert":
                return user.dtype
            if user.opcode in VIEWS:
                todo.append((comp, user))
            elif user.opcode == "fusion" and user.called:
                inner = _params(module, user.called[0])
                todo += [(user.called[0], inner.get(k)) for k, op in enumerate(user.operands)
                         if op == param.name]
    return None


def classify(module: Module, user: Instr, weight_elements: int) -> str:
    if user.opcode in MATMULS:
        return "matmul"
    if user.opcode == "custom-call":
        return "matmul" if GEMM_TARGET.search(user.impl) else "other"
    if user.opcode == "fusion":
        inner = module.inner(user.called[0]) if user.called else []
        ops = {i.opcode for i in inner}
        if ops & MATMULS or "gemm" in user.impl or any(
                i.opcode == "custom-call" and GEMM_TARGET.search(i.impl) for i in inner):
            return "matmul"
        if "reduce" in ops and user.elements < weight_elements:
            return "reduce"
    if user.opcode in ("fusion", "convert", "copy", "transpose") and \
            user.elements >= weight_elements:
        return "copy"
    return "other"


@dataclasses.dataclass
class Read:
    weight: str
    kind: str
    op: str
    impl: str
    reads: str  # the dtype the op reads the weight (or its copy) in
    via: list[str]  # the copies between the weight and this op: "name (impl) -> dtype[...]"
    converts_to: str | None = None
    copy_bytes: float = 0.0  # bytes the copies on the way write


def weight_reads(module: Module, min_bytes: float = 1 << 20) -> tuple[list[dict], list[Read]]:
    """(the weights: the entry's matrices of >= min_bytes not donated to an output, the reads of
    each)."""
    weights, reads = [], []
    for p in sorted(_params(module, module.entry).items()):
        w = p[1]
        if w.nbytes < min_bytes or p[0] in module.aliased or len(w.type.split("[")[1].split(",")) < 2:
            continue
        weights.append(dict(name=w.label, param=p[0], dtype=w.dtype, shape=w.type.split("{")[0],
                            bytes=w.nbytes))
        todo = [(module.entry, w.name, w.dtype, [], 0.0)]
        seen = set()
        while todo:
            comp, name, dtype, via, copied = todo.pop()
            for user in module.users[comp].get(name, []):
                if (comp, user.name) in seen:
                    continue
                seen.add((comp, user.name))
                if user.opcode in VIEWS:
                    todo.append((comp, user.name, dtype, via, copied))
                    continue
                if user.opcode == "call" and user.called:
                    inner = _params(module, user.called[0])
                    todo += [(user.called[0], inner[k].name, dtype, via, copied)
                             for k, op in enumerate(user.operands) if op == name and k in inner]
                    continue
                kind = classify(module, user, w.elements)
                if kind == "copy":
                    step = f"{user.name} ({user.impl}) -> {user.type.split('{')[0]}"
                    todo.append((comp, user.name, user.dtype, via + [step],
                                 copied + user.nbytes))
                    continue
                converts = (_converts_inside(module, user, name) if user.opcode == "fusion"
                            else None)
                reads.append(Read(w.label, kind, user.name, user.impl, dtype, via, converts,
                                  copied))
    return weights, reads


def summarize(weights: list[dict], reads: list[Read]) -> dict:
    """Totals per weight dtype, and one line each that says whether those weights reach their
    readers directly or through a copy."""
    by_weight: dict[str, list[Read]] = {}
    for r in reads:
        by_weight.setdefault(r.weight, []).append(r)
    dtypes: dict[str, dict] = {}
    for w in weights:
        mine = by_weight.get(w["name"], [])
        d = dtypes.setdefault(w["dtype"], dict(weights=0, bytes=0, read_directly=0,
                                               through_a_copy=0, unread=0, copy_bytes=0))
        d["weights"] += 1
        d["bytes"] += w["bytes"]
        if not mine:
            d["unread"] += 1
        elif any(r.via for r in mine):
            d["through_a_copy"] += 1
            d["copy_bytes"] += max(r.copy_bytes for r in mine)
        else:
            d["read_directly"] += 1
    readers: dict[str, int] = {}
    for r in reads:
        key = f"{r.kind}:{r.impl}" + (f" (converts {r.reads}->{r.converts_to} inside)"
                                       if r.converts_to else f" (reads {r.reads})")
        readers[key] = readers.get(key, 0) + 1
    weight_bytes = sum(d["bytes"] for d in dtypes.values())
    copy_bytes = sum(d["copy_bytes"] for d in dtypes.values())
    lines = [f"{dt}: {d['weights']} weights, {_gb(d['bytes'])}: {d['read_directly']} read "
             f"directly, {d['through_a_copy']} through a copy ({_gb(d['copy_bytes'])} written, "
             f"then read again)" for dt, d in dtypes.items()]
    # Each copy is written once and read once more by its matmul.
    moved = weight_bytes + 2 * copy_bytes
    lines.append(f"~{_gb(moved)} moved per call for {_gb(weight_bytes)} of weights")
    return dict(by_dtype=dtypes, weight_bytes=weight_bytes, copy_bytes_written=copy_bytes,
                bytes_moved_estimate=moved, readers=readers, verdict=lines)


def _gb(n: float) -> str:
    return f"{n / 1e9:.3f} GB" if n >= 1e8 else f"{n / 1e6:.3f} MB"


def read_text(path: str | Path) -> str:
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return f.read()


def report(text: str, min_bytes: float = 1 << 20) -> dict:
    weights, reads = weight_reads(parse(text), min_bytes)
    return dict(summary=summarize(weights, reads), weights=weights,
                reads=[dataclasses.asdict(r) for r in reads])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("hlo", help="optimized HLO text (.txt or .txt.gz)")
    ap.add_argument("--min-bytes", type=float, default=1 << 20)
    ap.add_argument("--json", action="store_true", help="the whole report as JSON")
    ap.add_argument("--rows", type=int, default=40, help="reads listed (text output)")
    args = ap.parse_args(argv)
    out = report(read_text(args.hlo), args.min_bytes)
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    s = out["summary"]
    print("\n".join(s["verdict"]))
    for key, n in sorted(s["readers"].items(), key=lambda kv: -kv[1]):
        print(f"  {n:4d} x {key}")
    for r in out["reads"][:args.rows]:
        via = " => ".join(r["via"])
        conv = f", converted to {r['converts_to']} inside" if r["converts_to"] else ""
        print(f"{r['weight'][:60]:60} {r['kind']:6} {r['op']} [{r['impl']}] reads {r['reads']}"
              f"{conv}" + (f"  via {via}" if via else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
