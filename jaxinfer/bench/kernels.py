"""`jaxinfer bench kernels`: the attention kernels on the GPU in one call, paged decode
(kernel_decode.py) and flash prefill (kernel_prefill.py), each beside its anchors measured in the
same run. `--only` runs one benchmark instead, among them the device primitives around them:
  window-decode   sliding-window decode against full contexts (kernel_window_decode.py, into the
                  families_<gpu> record)
  kv-blocks       the disaggregated hand-over's block gather and scatter (kv_blocks.py)
  host-transfers  weight placement from host numpy, host arguments that make a dispatch wait
                  (host_transfers.py)
  ssm             the hybrid models' recurrent-layer kernels: Gated DeltaNet, Mamba-2 SSD,
                  causal conv1d (kernel_ssm.py)
  moe             routed experts: the grouped-matmul kernel beside ragged_dot and the padded
                  einsum on the Qwen3-30B-A3B and Mixtral shapes, and the fused router against
                  the unfused one (suites/moe.py's kernels and routing sections, into the
                  moe_<gpu> record; its engine sections are
                  `jaxinfer bench throughput --suite moe`)
  weight-only     Llama-3-8B's projections at batch 1-8 with FP8 / int8 weights against bf16 and
                  the HBM read ceiling (suites/weight_only.py, weight_only_<gpu>)

    jaxinfer bench kernels [--only NAME] [--quick] [--save [DIR]] [-- ITS OWN FLAGS]

--quick: decode at batch 1 and 64 x ctx 4096 / 32768 with the read ceiling only; prefill ours vs
cuDNN on the dense shapes. Flags after `--` go to the one kernel's own benchmark (with --only;
`python -m jaxinfer.bench.kernel_decode --help` lists them). --save writes both records
(paged_decode_<gpu>.json, flash_prefill_<gpu>.json).
"""

from __future__ import annotations

import argparse
import importlib

from jaxinfer.bench import common, results_io

# --only NAME -> the module whose main(argv) runs it alone.
SINGLE = {"window-decode": "kernel_window_decode", "kv-blocks": "kv_blocks",
           "host-transfers": "host_transfers", "ssm": "kernel_ssm", "moe": "suites.moe",
           "weight-only": "suites.weight_only"}
# Flags an --only benchmark runs with ahead of the ones after `--` (which win).
SINGLE_ARGS = {"moe": ["--sections", "kernels,routing"]}
QUICK_DECODE = ["--shapes", "1x4096,1x32768,64x4096,64x32768", "--variants", "mosaic"]
QUICK_PREFILL = ["--quick", "--shapes", "dense"]


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("kernels", help="GPU: the attention kernels and the KV and host transfers around them",
                       description=__doc__, formatter_class=common.HelpFormatter,
                       usage=common.USAGE)
    p.add_argument("--only", choices=sorted(["decode", "prefill", *SINGLE]), default=None,
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
    if args.only in SINGLE:
        importlib.import_module(f"jaxinfer.bench.{SINGLE[args.only]}").main(
            SINGLE_ARGS.get(args.only, []) + args.kernel_args + save)
        return 0
    if args.only in (None, "decode"):
        kernel_decode.main((QUICK_DECODE if args.quick else []) + args.kernel_args + save)
    if args.only in (None, "prefill"):
        kernel_prefill.main((QUICK_PREFILL if args.quick else []) + args.kernel_args + save)
    return 0
