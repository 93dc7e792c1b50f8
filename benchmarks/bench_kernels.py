"""Both attention kernels on the GPU in one call: paged decode (bench_decode) and flash prefill
(bench_prefill), each beside its anchors measured in the same run.

    python -m benchmarks.bench_kernels [--only decode|prefill] [--quick] [--save [DIR]]

--quick: decode at batch 1 and 64 x ctx 4096 / 32768 with the read ceiling only; prefill ours vs
cuDNN on the dense shapes. --save writes both records (paged_decode_<gpu>.json,
flash_prefill_<gpu>.json).
"""

import argparse

from benchmarks import bench_decode, bench_prefill, results_io


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=["decode", "prefill"])
    ap.add_argument("--quick", action="store_true")
    results_io.add_save_arg(ap)
    args = ap.parse_args(argv)
    save = ["--save", args.save] if args.save else []
    if args.only in (None, "decode"):
        quick = ["--shapes", "1x4096,1x32768,64x4096,64x32768", "--variants", "mosaic"]
        bench_decode.main((quick if args.quick else []) + save)
    if args.only in (None, "prefill"):
        bench_prefill.main((["--quick", "--shapes", "dense"] if args.quick else []) + save)


if __name__ == "__main__":
    main()
