"""The LoRA flags (vLLM's names and meanings): --enable-lora, --lora-modules name=path ...,
--max-loras, --max-lora-rank, --max-cpu-loras."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging

from jaxinfer.errors import ConfigError
from jaxinfer.lora_request import LoRARequest
from jaxinfer.model.kernel_table import current_platform, lora_impl
from jaxinfer.model.lora.delta import LORA_IMPLS

log = logging.getLogger(__name__)


def add_lora_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("LoRA adapters")
    g.add_argument("--enable-lora", action="store_true",
                   help="serve LoRA adapters over the base model (docs/lora.md)")
    g.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                   help="adapters to serve from the start, as name=path or a JSON object "
                        '{"name": ..., "path": ...}; a request picks one by its `model` field')
    g.add_argument("--max-loras", type=int, default=1,
                   help="adapters one step can serve at once (device slots; default: 1)")
    g.add_argument("--max-lora-rank", type=int, default=16,
                   help="largest adapter rank (r) accepted; every slot is this wide (default: 16)")
    g.add_argument("--max-cpu-loras", type=int, default=None,
                   help="adapters kept in host memory (default: --max-loras); others are read "
                        "from their files again when needed")
    # The LoRA matmuls: xla (every slot's weights) or pallas (the slot-grouped Triton kernels);
    # auto picks pallas on a GPU without tensor parallelism (docs/lora.md). A benchmark's and
    # bisection's override, kept out of --help like --moe-impl.
    g.add_argument("--lora-impl", default="auto", choices=("auto", *LORA_IMPLS),
                   help=argparse.SUPPRESS)


def lora_modules(specs) -> list[LoRARequest]:
    """--lora-modules' entries as LoRARequests, ids 1, 2, ... in order."""
    out = []
    for spec in specs or ():
        if isinstance(spec, dict):
            entry = spec
        elif spec.lstrip().startswith("{"):
            try:
                entry = json.loads(spec)
            except json.JSONDecodeError as e:
                raise ConfigError(f"--lora-modules {spec!r}: not valid JSON: {e}") from None
        else:
            name, sep, path = spec.partition("=")
            if not sep or not name or not path:
                raise ConfigError(f"--lora-modules {spec!r}: expected name=path")
            entry = {"name": name, "path": path}
        if not isinstance(entry, dict) or not {"name", "path"} <= set(entry):
            raise ConfigError(f"--lora-modules {spec!r}: needs a name and a path")
        out.append(LoRARequest(str(entry["name"]), len(out) + 1, str(entry["path"])))
    return out


def check_lora_args(args) -> None:
    if not args.enable_lora:
        if args.lora_modules:
            raise ConfigError("--lora-modules needs --enable-lora")
        return
    for flag, value in (("max-loras", args.max_loras), ("max-lora-rank", args.max_lora_rank)):
        if value < 1:
            raise ConfigError(f"--{flag} {value}: must be >= 1")
    if args.max_cpu_loras is not None and args.max_cpu_loras < args.max_loras:
        raise ConfigError(f"--max-cpu-loras {args.max_cpu_loras}: must be >= --max-loras "
                          f"({args.max_loras})")
    if args.lora_impl not in ("auto", *LORA_IMPLS):
        raise ConfigError(f"--lora-impl {args.lora_impl!r}: choose from auto, "
                          f"{', '.join(LORA_IMPLS)}")
    names = [r.lora_name for r in lora_modules(args.lora_modules)]
    if len(set(names)) != len(names):
        raise ConfigError(f"--lora-modules names {names} are not unique")


def resolved_lora_impl(config) -> str:
    """--lora-impl with "auto" decided as the engine's kernel table decides it
    (kernel_table.lora_impl), for an EngineConfig."""
    return lora_impl(current_platform(), config.lora.lora_impl,
                     config.parallel.tensor_parallel_size)


def with_lora_impl_decided(args):
    """`args` (EngineArgs) with --lora-impl as the kernel table runs it where that differs from
    the flag (--lora-impl pallas under tensor parallelism runs the XLA path: the Pallas kernels
    are not partitioned), logged once at start."""
    impl = lora_impl(current_platform(), args.lora_impl, args.tensor_parallel_size)
    if not args.enable_lora or args.lora_impl in ("auto", impl):
        return args
    log.info("--lora-impl %s runs as %s: the Pallas LoRA kernels are not partitioned "
             "(--tensor-parallel-size %d)", args.lora_impl, impl, args.tensor_parallel_size)
    return dataclasses.replace(args, lora_impl=impl)
