"""All attention kernels on the GPU in one call: paged decode (bench_decode) and flash prefill
(bench_prefill), each beside its anchors measured in the same run.

    PYTHONPATH=. python3 benchmarks/bench_kernels.py [--only decode|prefill] [--quick]

Writes $OUT/bench_decode.json and $OUT/bench_prefill.json (or /tmp without $OUT) and prints both
tables last.
"""

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_decode  # noqa: E402
import bench_prefill  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=["decode", "prefill"])
    ap.add_argument("--quick", action="store_true",
                    help="decode: batch 1 and 64 at ctx 4096/32768; prefill: ours vs cuDNN only")
    args = ap.parse_args()
    out = Path(os.environ.get("OUT", "/tmp"))
    decode = prefill = None
    if args.only in (None, "decode"):
        batches, contexts = ((1, 64), (4096, 32768)) if args.quick else ((1, 8, 64, 256), (512, 4096, 32768))
        save = lambda result: (out / "bench_decode.json").write_text(json.dumps(result, indent=1))
        decode = bench_decode.run_grid(batches, contexts, on_row=save)  # saved after every shape
        save(decode)
    if args.only in (None, "prefill"):
        prefill = bench_prefill.run(str(out), skip_model=True, quick=args.quick)
    if decode:
        print("\n== paged decode ==\n" + bench_decode.table(decode))
    if prefill:
        bench_prefill.print_table(prefill)


if __name__ == "__main__":
    main()
