"""Which attention kernel stalls the engine? One device call that runs the same offline workload
(`bench_throughput.throughput`) once per attention variant, each in its own process with a time
limit; a variant that times out gets SIGABRT with faulthandler on, so its Python stack is printed.

    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/gpu_engine_bisect.py --model DIR \\
        [--variants reference,mosaic,mosaic_nopdl,decode_only,prefill_only] [--limit-s 150] \\
        [bench_throughput flags ...]

Variants: `reference` (XLA attention), `mosaic` (both Mosaic kernels), `mosaic_nopdl` (the decode
kernel without programmatic dependent launch and block-id lookahead), `decode_only` (Mosaic decode,
reference prefill), `prefill_only` (reference decode, Mosaic prefill). Written for the
Llama-3-8B-shaped hang recorded in benchmarks/RESULTS.md ("Engine on the H200").
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def register_variant(name: str) -> str:
    """Registers `name` as an attention backend (in this process) and returns the name to pass as
    --attention-backend."""
    if name in ("reference", "mosaic"):
        return name
    from pallas_kernels import backend, reference
    from pallas_kernels.flash_prefill import flash_prefill_mosaic
    from pallas_kernels.paged_decode import (MosaicDecodeConfig, paged_decode_mosaic,
                                             paged_decode_mosaic_configured)
    decode, prefill = {
        "mosaic_nopdl": (functools.partial(paged_decode_mosaic_configured,
                                           config=MosaicDecodeConfig(pdl=False, bt_lookahead=0)),
                         flash_prefill_mosaic),
        "decode_only": (paged_decode_mosaic, reference.ragged_prefill_reference),
        "prefill_only": (reference.paged_decode_reference, flash_prefill_mosaic),
    }[name]
    globals()[name] = backend.AttentionBackend(name, decode=decode, prefill=prefill,
                                               split_mixed_steps=True)
    backend.register(name, f"{__name__}:{name}")
    return name


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default="reference,mosaic,mosaic_nopdl,decode_only,prefill_only")
    ap.add_argument("--limit-s", type=float, default=150.0, help="time limit per variant")
    ap.add_argument("--run-variant", default=None, help=argparse.SUPPRESS)
    args, rest = ap.parse_known_args()
    if args.run_variant:
        import bench_throughput
        sys.argv = [sys.argv[0], *rest, "--attention-backend", register_variant(args.run_variant)]
        return bench_throughput.main()

    from gpu_engine_check import child
    summary = {}
    for name in args.variants.split(","):
        stdout, stderr, rc = child([sys.executable, __file__, "--run-variant", name, *rest],
                                   args.limit_s)
        done = [l for l in stdout.splitlines() if l.startswith("Throughput")]
        summary[name] = done[0] if done else f"no result (rc {rc})"
        print(f"== {name}: {summary[name]}", flush=True)
        if not done:
            print(stderr[-4000:], flush=True)
    print("\nvariant        | outcome")
    for name, outcome in summary.items():
        print(f"{name:14} | {outcome}")


if __name__ == "__main__":
    main()
