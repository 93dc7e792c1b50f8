"""Which attention kernel stalls the engine? One device call that runs the same offline workload
(`bench_throughput.throughput`) once per variant, each in its own process with a time limit; a
variant that times out gets SIGABRT with faulthandler on, so its Python stack is printed.

    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/gpu_engine_bisect.py \\
        [--variants mosaic:layers=2,reference,mosaic:nb=16384,...] [--limit-s 150] \\
        [--deadline-s 560] [--model DIR] [bench_throughput flags ...]

A variant is an attention variant plus optional overrides, `name[:layers=N][:nb=N][:limit=S]`:
`reference` (XLA attention), `mosaic` (both Mosaic kernels), `mosaic_nopdl` (the decode kernel
without programmatic dependent launch and block-id lookahead), `decode_only` (Mosaic decode,
reference prefill), `prefill_only` (reference decode, Mosaic prefill); `layers=N` runs a
Llama-3-8B-shaped config with N layers (same per-layer shapes, faster to compile), `nb=N` sets
--num-blocks (`nb=same`: the count the memory planner chose in the last variant that planned), and
`limit=S` the variant's own time limit. Without --model the driver writes those configs itself (`gpu_engine_check.LLAMA3_8B`)
and, with no throughput flags given, uses the llama8b section's workload. Written for the
Llama-3-8B-shaped hang recorded in benchmarks/RESULTS.md ("Engine on the H200").
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import re
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

VARIANTS = ("reference", "mosaic", "mosaic_nopdl", "decode_only", "prefill_only")


def register_variant(name: str) -> str:
    """Registers `name` as an attention backend (in this process) and returns the name to pass as
    --attention-backend."""
    if name in ("reference", "mosaic"):
        return name
    from pallas_kernels import backend, reference
    from pallas_kernels.flash_prefill import flash_prefill_mosaic
    from pallas_kernels.paged_decode import MosaicDecodeConfig, paged_decode_mosaic
    decode, prefill = {
        "mosaic_nopdl": (functools.partial(paged_decode_mosaic,
                                           config=MosaicDecodeConfig(pdl=False, bt_lookahead=0)),
                         flash_prefill_mosaic),
        "decode_only": (paged_decode_mosaic, reference.ragged_prefill_reference),
        "prefill_only": (reference.paged_decode_reference, flash_prefill_mosaic),
    }[name]
    globals()[name] = backend.AttentionBackend(name, decode=decode, prefill=prefill,
                                               split_mixed_steps=True)
    backend.register(name, f"{__name__}:{name}")
    return name


def log_steps() -> None:
    """Prints one `STEP` line per dispatched step to stderr (decode rows; prefill rows as
    start+new tokens), so a stalled run shows which step the device never finished."""
    from jaxinfer.worker.runner import ModelRunner
    execute = ModelRunner.execute

    def logged(self, sched):
        prefills = " ".join(f"{p.start}+{p.num_tokens}" for p in sched.prefills)
        print(f"STEP {self.num_dispatches}: {len(sched.decodes)} decodes, prefills [{prefills}]",
              file=sys.stderr, flush=True)
        return execute(self, sched)

    ModelRunner.execute = logged


def parse_variant(spec: str) -> tuple[str, dict[str, int | str]]:
    """'mosaic:layers=2:nb=16384' -> ('mosaic', {'layers': 2, 'nb': 16384}). `nb=same`: the block
    count the memory planner chose in the last variant that ran it (so a 2-layer run gets the
    32-layer run's per-layer cache size)."""
    name, *opts = spec.split(":")
    if name not in VARIANTS:
        raise SystemExit(f"error: unknown variant {name!r} (choose from {', '.join(VARIANTS)})")
    overrides: dict[str, int | str] = {}
    for opt in opts:
        key, _, value = opt.partition("=")
        if key in ("layers", "limit") and value.isdigit():
            overrides[key] = int(value)
        elif key == "nb" and (value.isdigit() or value == "same"):
            overrides[key] = int(value) if value.isdigit() else value
        else:
            raise SystemExit(f"error: bad variant option {opt!r} in {spec!r} "
                             "(expected layers=N, nb=N, nb=same or limit=SECONDS)")
    return name, overrides


def llama8b_dir(work: Path, layers: int) -> str:
    from gpu_engine_check import LLAMA3_8B
    path = work / f"llama3-8b-shape-{layers}l"
    if not path.exists():
        path.mkdir(parents=True)
        (path / "config.json").write_text(json.dumps({**LLAMA3_8B, "num_hidden_layers": layers}))
    return str(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default="reference,mosaic,mosaic_nopdl,decode_only,prefill_only")
    ap.add_argument("--limit-s", type=float, default=150.0, help="time limit per variant")
    ap.add_argument("--deadline-s", type=float, default=560.0, help="time limit of the whole run")
    ap.add_argument("--model", default=None, help="model directory (default: Llama-3-8B-shaped)")
    ap.add_argument("--run-variant", default=None, help=argparse.SUPPRESS)
    args, rest = ap.parse_known_args()
    if args.run_variant:
        import bench_throughput
        logging.basicConfig(level=logging.INFO, format="%(message)s")  # the KV plan, warm-up
        log_steps()
        model = ["--model", args.model] if args.model else []
        sys.argv = [sys.argv[0], *model, *rest, "--attention-backend",
                    register_variant(args.run_variant)]
        return bench_throughput.main()

    from gpu_engine_check import LLAMA8B_WORKLOAD, child
    start = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="jaxinfer-bisect-"))
    flags = rest or [*LLAMA8B_WORKLOAD, "--dtype", "bfloat16", "--temperature", "0"]
    variants = [(spec, *parse_variant(spec)) for spec in args.variants.split(",")]
    summary, planned_blocks = {}, None
    for spec, name, overrides in variants:
        left = args.deadline_s - (time.perf_counter() - start)
        if left < 30:
            summary[spec] = "skipped: deadline"
            continue
        model = args.model or llama8b_dir(work, overrides.get("layers", 32))
        argv = [sys.executable, __file__, "--run-variant", name, "--model", model, *flags]
        if "nb" in overrides:
            nb = planned_blocks if overrides["nb"] == "same" else overrides["nb"]
            if nb is None:
                summary[spec] = "skipped: nb=same before any planned run"
                continue
            argv += ["--num-blocks", str(nb)]
        t0 = time.perf_counter()
        stdout, stderr, rc = child(argv, min(overrides.get("limit", args.limit_s), left))
        done = [l for l in stdout.splitlines() if l.startswith("Throughput")]
        kv = [l for l in (stdout + stderr).splitlines() if "KV cache:" in l]
        planned = [re.search(r"KV cache: (\d+) blocks", l) for l in kv]
        planned_blocks = next((int(m.group(1)) for m in planned if m), planned_blocks)
        summary[spec] = (done[0] if done else f"no result (rc {rc})") + \
            f" [{time.perf_counter() - t0:.0f} s; {kv[0] if kv else 'no KV line'}]"
        print(f"== {spec}: {summary[spec]}", flush=True)
        if not done:
            steps = [l for l in stderr.splitlines() if l.startswith("STEP ")]
            rest_err = "\n".join(l for l in stderr.splitlines() if not l.startswith("STEP "))
            print("\n".join(steps[-6:]) + "\n" + rest_err[-5000:], flush=True)
    print("\nvariant                  | outcome")
    for spec, outcome in summary.items():
        print(f"{spec:24} | {outcome}")


if __name__ == "__main__":
    main()
