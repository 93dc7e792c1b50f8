"""The disaggregation flags (`--disaggregate`, device groups and tensor parallelism per role), their
checks, and the two roles' meshes and engine settings."""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxinfer.errors import ConfigError

ROLES = ("prefill", "decode")


def add_disagg_arguments(parser) -> None:
    g = parser.add_argument_group("prefill/decode disaggregation")
    g.add_argument("--disaggregate", action="store_true",
                   help="run prompts on one device group (prefill engine) and generation on "
                        "another (decode engine); each request's KV blocks move between them")
    for role in ROLES:
        g.add_argument(f"--{role}-tensor-parallel-size", type=int, default=1,
                       help=f"devices the {role} engine's model is split over (with --disaggregate)")
        g.add_argument(f"--{role}-devices", default=None, metavar="I,J,...",
                       help=f"indices of the {role} engine's devices (with --disaggregate; default: "
                            + ("the first ones" if role == "prefill" else "the next ones after "
                               "the prefill group") + ")")


def _refuse(flag: str, value, why: str):
    raise ConfigError(f"--{flag} {value!r}: {why}")


def parse_devices(flag: str, value) -> list[int] | None:
    """--prefill-devices / --decode-devices as a list of indices ("0,1", [0, 1]); None if unset."""
    if value is None:
        return None
    items = value.split(",") if isinstance(value, str) else list(value)
    try:
        ids = [int(i) for i in items]
    except (TypeError, ValueError):
        _refuse(flag, value, "must be comma-separated device indices, e.g. 0,1")
    if not ids or len(set(ids)) != len(ids) or min(ids) < 0:
        _refuse(flag, value, "must name distinct device indices >= 0")
    return ids


def check_disagg_args(args) -> None:
    """Refuse the combinations disaggregation does not take, naming the flag."""
    role_flags = {f"{r}-tensor-parallel-size": getattr(args, f"{r}_tensor_parallel_size")
                  for r in ROLES}
    role_flags.update({f"{r}-devices": getattr(args, f"{r}_devices") for r in ROLES})
    if not args.disaggregate:
        for flag, value in role_flags.items():
            if value not in (None, 1):
                _refuse(flag, value, "needs --disaggregate")
        return
    for role in ROLES:
        tp = getattr(args, f"{role}_tensor_parallel_size")
        if tp < 1:
            _refuse(f"{role}-tensor-parallel-size", tp, "must be >= 1")
        ids = parse_devices(f"{role}-devices", getattr(args, f"{role}_devices"))
        if ids is not None and len(ids) != tp:
            _refuse(f"{role}-devices", getattr(args, f"{role}_devices"),
                    f"names {len(ids)} device(s); --{role}-tensor-parallel-size is {tp}")
    if args.tensor_parallel_size != 1:
        _refuse("tensor-parallel-size", args.tensor_parallel_size,
                "with --disaggregate, set --prefill-tensor-parallel-size and "
                "--decode-tensor-parallel-size instead")
    if args.data_parallel_size != 1:
        _refuse("data-parallel-size", args.data_parallel_size,
                "is not built together with --disaggregate (one prefill and one decode group)")
    if args.coordinator_address is not None:
        _refuse("coordinator-address", args.coordinator_address,
                "multi-process runs are not built with --disaggregate (docs/disaggregation.md)")
    if getattr(args, "kv_offload", False):  # (the hand-over writes blocks the tier would read)
        _refuse("kv-offload", True, "the host KV tier is not built together with --disaggregate")
    for flag in ("speculative_method", "speculative_model", "speculative_config"):
        if getattr(args, flag, None) is not None:
            _refuse(flag.replace("_", "-"), getattr(args, flag),
                    "speculative decoding is not built together with --disaggregate")


def role_device_ids(args, num_devices: int) -> dict[str, list[int]]:
    """Each role's device indices: the flags, else prefill = the first prefill-TP devices and
    decode = the next decode-TP ones. The groups must be disjoint and exist."""
    ptp, dtp = args.prefill_tensor_parallel_size, args.decode_tensor_parallel_size
    groups = {"prefill": parse_devices("prefill-devices", args.prefill_devices),
              "decode": parse_devices("decode-devices", args.decode_devices)}
    if groups["prefill"] is None:
        taken = set(groups["decode"] or ())
        groups["prefill"] = [i for i in range(num_devices + ptp) if i not in taken][:ptp]
    if groups["decode"] is None:
        taken = set(groups["prefill"])
        groups["decode"] = [i for i in range(num_devices + dtp) if i not in taken][:dtp]
    for role, ids in groups.items():
        if max(ids) >= num_devices:
            _refuse(f"{role}-devices", ",".join(map(str, ids)),
                    f"only {num_devices} device(s) exist (prefill and decode need "
                    f"{ptp} + {dtp})")
    if set(groups["prefill"]) & set(groups["decode"]):
        _refuse("decode-devices", ",".join(map(str, groups["decode"])),
                "overlaps --prefill-devices: the two roles need disjoint device groups")
    return groups


def role_meshes(args, devices: list) -> dict:
    """The ("dp", "tp") mesh of each role (dp = 1) over its device group."""
    from jax.sharding import Mesh

    from jaxinfer.parallel.sharding import DP, TP
    groups = role_device_ids(args, len(devices))
    return {role: Mesh(np.array([devices[i] for i in ids], dtype=object).reshape(1, len(ids)),
                       (DP, TP)) for role, ids in groups.items()}


def role_args(args, role: str):
    """The EngineArgs of one role's engine: its tensor-parallel size, the role flags reset. The
    prefill engine processes each step before scheduling the next (so a finished prompt's KV is
    gathered before the next prefill step is queued behind it) and never runs decode loops."""
    extra = {"async_scheduling": False, "decode_steps_per_call": 1} if role == "prefill" else {}
    return dataclasses.replace(
        args, disaggregate=False, tensor_parallel_size=getattr(args, f"{role}_tensor_parallel_size"),
        prefill_tensor_parallel_size=1, decode_tensor_parallel_size=1, prefill_devices=None,
        decode_devices=None, **extra)
