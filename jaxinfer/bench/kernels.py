"""`jaxinfer bench kernels`: the attention kernels on the GPU in one call, paged decode
(kernel_decode.py) and flash prefill (kernel_prefill.py), each beside its anchors measured in the
same run; `--only window-decode` times sliding-window decode against full contexts instead
(kernel_window_decode.py, into the families_<gpu> record).

    jaxinfer bench kernels [--only decode|prefill|window-decode] [--quick] [--save [DIR]]
        [-- KERNEL FLAGS]

--quick: decode at batch 1 and 64 x ctx 4096 / 32768 with the read ceiling only; prefill ours vs
cuDNN on the dense shapes. Flags after `--` go to the one kernel's own benchmark (with --only;
`python -m jaxinfer.bench.kernel_decode --help` lists them). --save writes both records
(paged_decode_<gpu>.json, flash_prefill_<gpu>.json).
"""

from __future__ import annotations

import argparse

from jaxinfer.bench import common, results_io

QUICK_DECODE = ["--shapes", "1x4096,1x32768,64x4096,64x32768", "--variants", "mosaic"]
QUICK_PREFILL = ["--quick", "--shapes", "dense"]


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("kernels", help="GPU: the paged-decode and flash-prefill attention kernels",
                       description=__doc__, formatter_class=common.HelpFormatter,
                       usage=common.USAGE)
    p.add_argument("--only", choices=["decode", "prefill", "window-decode"], default=None,
                   help="one benchmark (default: decode, then prefill)")
    p.add_argument("--quick", action="store_true", help="the headline shapes only")
    results_io.add_save_arg(p)
    p.add_argument("kernel_args", nargs="*", help="the kernel benchmark's own flags (after --)")
    p.set_defaults(func=run, _parser=p)
    return p


def run(args: argparse.Namespace) -> int:
    from jaxinfer.bench import kernel_decode, kernel_prefill
    if args.kernel_args and args.only is None:
        args._parser.error("flags after -- need --only decode or --only prefill")
    save = ["--save", args.save] if args.save else []
    if args.only == "window-decode":
        from jaxinfer.bench import kernel_window_decode
        kernel_window_decode.main(args.kernel_args + save)
        return 0
    if args.only in (None, "decode"):
        kernel_decode.main((QUICK_DECODE if args.quick else []) + args.kernel_args + save)
    if args.only in (None, "prefill"):
        kernel_prefill.main((QUICK_PREFILL if args.quick else []) + args.kernel_args + save)
    return 0
