"""Routed experts' SwiGLU MLP over rows sorted by expert: the model's one MoE dispatch point.

`moe_experts(x_sorted, weights, group_sizes)` returns down(silu(x @ gate) * (x @ up)) per row, with
each row's expert given by the group it falls in. It is the only place the model touches expert
weights, so expert parallelism can wrap this one function (shard_map over the expert axis of
`weights` and `group_sizes`). `impl` (the engine's `--moe-impl`, bound in the kernel table's
routed-experts slot) is one of CHOICES: "auto" picks per call shape and device (`choose_impl`: the
kernel table passes the device's kind; direct callers may leave it to the probe here), "xla" the
same without the Mosaic kernel, or one of the implementations:

  - "mosaic": the Hopper kernels: gate/up fused with SwiGLU in one call, then down; the
    warp-specialised kernel (`grouped_matmul_ws`) with tilings picked by rows per step
    (`mosaic_configs`), the one-warpgroup kernel (`grouped_matmul_mosaic`) where N does not fit
    those tilings. gpt-oss's experts (biases, a clamped activation the epilogue lacks) run gate
    and up as one plain call on their fused stack [E, H, 2F], the activation in XLA, then down.
  - "padded": a dense einsum over groups padded to a static capacity. The capacity bound is exact:
    a token routes to k *distinct* experts, so no group holds more rows than there are tokens, and
    with few tokens (decode) the padded compute is cheaper than the weight read it rides on.
    The portable GPU path at decode; with many tokens it would multiply the work, so it is used only
    while the padded rows stay within `PADDED_MAX_FACTOR` x the real ones. On Hopper it also takes
    decode steps of models with few experts (`PADDED_OVER_KERNEL`), where it measured faster.
  - "ragged": `jax.lax.ragged_dot` (XLA): exact everywhere, what CPUs run.
  - `moe_experts_reference` / `grouped_matmul_reference`: pure jnp (every expert on every row,
    then a select), for tests.

Quantized experts (8-bit stacks with float32 scales [E, out], jaxinfer/model/quant): "padded" and
"ragged" convert the stack to the activation dtype inside the matmul and multiply each row's output
by its expert's channel scales (exact: the scale is per output column). "mosaic" takes e4m3 stacks
(`--quantization fp8`) into the warp-specialised kernel, which widens them after the TMA load and
applies the scales in its epilogue (grouped_matmul_ws's docstring says why weight-only); x goes in
as float16, the SwiGLU's output stays float16 between the two calls. On Hopper "auto" gives e4m3
stacks the kernel (timed by `jaxinfer bench kernels --only moe -- --fp8`, moe_h200.json); int8
stacks never take it.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp

from pallas_kernels.moe.grouped_matmul_mosaic import (GmmConfig, grouped_matmul_mosaic, padded_rows,
                                                      tile_table)
from pallas_kernels.common.device_info import SMEM_LIMIT
from pallas_kernels.moe.grouped_matmul_ws import FP8, FP8_COMPUTE, WsConfig, grouped_matmul_ws

IMPLS = ("mosaic", "padded", "ragged")
CHOICES = ("auto", "xla", *IMPLS)  # --moe-impl
# Without the kernel, "padded" runs while E * capacity <= PADDED_MAX_FACTOR * rows (few tokens per
# step). With it, "padded" runs only at decode with few experts (E * capacity <= PADDED_OVER_KERNEL
# * rows): measured on the H200, XLA's batched matmul streamed Mixtral's 8 experts at 3.84 TB/s
# against the kernel's 3.55, while at Qwen3-MoE's 128 experts (16x padding) the kernel won 329 us
# to 407.
PADDED_MAX_FACTOR = 16
PADDED_OVER_KERNEL = 4
Config = GmmConfig | WsConfig


def mosaic_configs(rows: int, num_groups: int, fp8: bool = False) -> tuple[Config, Config]:
    """(gate/up config, down config) for `rows` routed rows over `num_groups` experts: the
    warp-specialised kernel (`WsConfig`), tilings from jaxinfer/bench/suites/moe.py on the H200. Few
    rows per expert (decode) is a weight stream: 64-row windows whose two consumers split N.
    Many (prefill) is compute: 128-row windows whose consumers take 64 rows each (a consumer with
    none of the tile's rows idles, so a group's short last tile costs half a window). `fp8`
    (e4m3 stacks): half the bytes per panel, so a 6-deep ring at decode, and at prefill consumers
    that split N, each widening only its half of the panel (Qwen3-30B-A3B shape: 270 us against
    280 at decode, 616 against 675 at prefill; moe_h200.json)."""
    if rows / num_groups <= 16:
        if fp8:
            return WsConfig(64, 128, 64, 6, "n"), WsConfig(64, 256, 64, 6, "n")
        return WsConfig(64, 128, 64, 4, "n"), WsConfig(64, 256, 64, 4, "n")
    if fp8:
        return WsConfig(64, 256, 64, 3, "n"), WsConfig(64, 256, 64, 4, "n")
    return WsConfig(128, 128, 64, 3, "m"), WsConfig(128, 128, 64, 4, "m")


def config_from_fields(fields: tuple) -> Config:
    """A tiling written as a tuple (the benchmarks' sweeps): 4 fields make a GmmConfig (the
    one-warpgroup kernel), 5 (the consumers' split last) a WsConfig."""
    return WsConfig(*fields) if len(fields) > 4 else GmmConfig(*fields)


def _fit(config: Config, n: int, stacks: int = 1) -> Config:
    """The config for N where its block_n does not divide N (`stacks`: the call's weight stacks).
    A decode tiling (consumers splitting N) takes 128 columns where they divide N; else, for a
    plain call where 192 do (gpt-oss: N = 2880), the warp-specialised kernel with the consumers
    splitting 128-row windows: on the H100 it streamed gpt-oss's expert calls in 43.7 us at
    batch 1 and 197 at 64 tokens, against 58.7 and 219 for the one-warpgroup kernel's 64-column
    blocks (gmm_decode_h100.json), which remain for every other case (N is a multiple of 64:
    `mosaic_supports`)."""
    if n % config.block_n == 0:
        return config
    if isinstance(config, WsConfig) and config.split == "n":
        if n % 128 == 0:
            return dataclasses.replace(config, block_n=128)
        wide = WsConfig(128, 192, config.block_k, config.stages, "m")
        if n % 192 == 0 and stacks == 1 and wide.smem_bytes(1) <= SMEM_LIMIT:
            return wide
    return GmmConfig(config.block_m, 64, config.block_k, config.stages)


def gmm(x, weights, group_sizes, config: Config, interpret: bool = False, table=None,
        scales=None, out_dtype=None):
    """The grouped matmul (plain, or SwiGLU with two stacks) on the kernel `config` is for; with
    `scales`, e4m3 stacks on the warp-specialised kernel (x float16)."""
    if scales is not None:
        return grouped_matmul_ws(x, weights, group_sizes, config=config, interpret=interpret,
                                 table=table, scales=scales, out_dtype=out_dtype)
    kernel = grouped_matmul_ws if isinstance(config, WsConfig) else grouped_matmul_mosaic
    return kernel(x, weights, group_sizes, config=config, interpret=interpret, table=table)


def mosaic_supports(hidden: int, inter: int, dtype, weight_dtype=None) -> bool:
    """The kernel's shape and dtype limits: 16-bit activations and K and N multiples of 64 both
    ways with weights of their dtype; e4m3 weights (`weight_dtype`) take the warp-specialised
    kernel only, so multiples of 128 (what its tilings narrow to: `_fit`)."""
    if jnp.dtype(dtype).itemsize != 2:
        return False
    if weight_dtype is None or jnp.dtype(weight_dtype) == jnp.dtype(dtype):
        return hidden % 64 == 0 and inter % 64 == 0
    return jnp.dtype(weight_dtype) == jnp.dtype(FP8) and hidden % 128 == 0 and inter % 128 == 0


def _silu_glu(gate, up, dtype):
    return (jax.nn.silu(gate.astype(jnp.float32)) * up.astype(jnp.float32)).astype(dtype)


@dataclasses.dataclass(frozen=True)
class ClampedSwiGLU:
    """gpt-oss's expert activation (HF's GptOssExperts): the gate clamped above at `limit`, up to
    [-limit, limit], then (up + 1) * gate * sigmoid(alpha * gate). In the activations' dtype, as HF
    computes it."""
    alpha: float = 1.702
    limit: float = 7.0

    def __call__(self, gate, up, dtype):
        gate = jnp.minimum(gate.astype(dtype), self.limit)
        up = jnp.clip(up.astype(dtype), -self.limit, self.limit)
        return ((up + 1) * (gate * jax.nn.sigmoid(gate * self.alpha))).astype(dtype)


def _with_bias(y, bias, gid, dtype):
    """y [M, N] plus each row's group's bias [E, N] (rows past the groups: the last group's; their
    output is undefined anyway), in `dtype`."""
    if bias is None:
        return y.astype(dtype)
    return (y.astype(dtype) + bias[jnp.minimum(gid, bias.shape[0] - 1)].astype(dtype)).astype(dtype)


def _row_groups(group_sizes, m: int):
    """Each row's group (E for rows past the groups) and its first row's index."""
    ends = jnp.cumsum(group_sizes)
    gid = jnp.sum(jnp.arange(m)[:, None] >= ends[None, :], axis=1)
    return gid, ends - group_sizes


def grouped_matmul_reference(x, w, group_sizes):
    """out[r] = x[r] @ w[group of r] in float32 (every group on every row, then a select); rows
    past the groups are 0."""
    gid, _ = _row_groups(group_sizes, x.shape[0])
    y = jnp.einsum("mk,ekn->emn", x.astype(jnp.float32), w.astype(jnp.float32))
    mine = jnp.arange(w.shape[0])[:, None] == gid[None, :]
    return jnp.sum(jnp.where(mine[..., None], y, 0.0), axis=0)


def gmm_reference(x, stacks, group_sizes):
    """One kernel call's result in float32: x @ w for one weight stack, silu(x @ w_gate) *
    (x @ w_up) for two (the fused SwiGLU call)."""
    out = grouped_matmul_reference(x, stacks[0], group_sizes)
    if len(stacks) == 2:
        out = jax.nn.silu(out) * grouped_matmul_reference(x, stacks[1], group_sizes)
    return out


def moe_experts_reference(x, weights, group_sizes):
    """The expert MLP in float32 through `grouped_matmul_reference` (either layout of
    `moe_experts`' weights)."""
    def mm(a, i):
        return grouped_matmul_reference(a, weights[i], group_sizes)

    return _glu_mlp(x, mm, weights, _silu_glu, None, lambda y, b: y, jnp.float32).astype(x.dtype)


def _glu_mlp(x, mm, weights, glu, biases, add_bias, dtype):
    """down(glu(x @ gate + b_gate, x @ up + b_up)) through `mm(a, i)`, stack i's grouped matmul:
    gate and up from one call where `weights` hold them as one stack (`moe_experts`), else one
    call each; `add_bias(y, b)` adds a bias (None: none) to a stack's output; `dtype`: glu's."""
    b = biases or (None, None)
    if len(weights) == 2:
        gate, up = jnp.split(add_bias(mm(x, 0), b[0]), 2, axis=-1)
    else:
        gate, up = add_bias(mm(x, 0), b[0]), add_bias(mm(x, 1), b[1])
    return mm(glu(gate, up, dtype), len(weights) - 1)


def _ragged(x, weights, group_sizes, scales=None, glu=_silu_glu, biases=None):
    """`jax.lax.ragged_dot` per stack; with `scales`, each row's output times its group's; with
    `biases` (gate, up [E, F]), each row's group's added before `glu`."""
    gid = (None if scales is None and biases is None
           else jnp.minimum(_row_groups(group_sizes, x.shape[0])[0], weights[0].shape[0] - 1))

    def mm(a, i):
        if scales is None:
            return jax.lax.ragged_dot(a, weights[i], group_sizes)
        y = jax.lax.ragged_dot(a, weights[i].astype(a.dtype), group_sizes,
                               preferred_element_type=jnp.float32)
        return (y * scales[i][gid]).astype(a.dtype)

    return _glu_mlp(x, mm, weights, glu, biases, lambda y, b: _with_bias(y, b, gid, x.dtype),
                    x.dtype)


def _padded(x, weights, group_sizes, capacity: int, scales=None, glu=_silu_glu, biases=None):
    """Rows scattered into [E, capacity, K] (slot = row's place in its group), three batched
    einsums, rows gathered back. Rows past sum(group_sizes) come back as zeros."""
    e = weights[0].shape[0]
    m = x.shape[0]
    gid, starts = _row_groups(group_sizes, m)
    slot = jnp.arange(m) - starts[jnp.minimum(gid, e - 1)]
    xp = jnp.zeros((e, capacity, x.shape[1]), x.dtype).at[gid, slot].set(x, mode="drop")

    def mm(a, i):
        if scales is None:
            return jnp.einsum("eck,ekn->ecn", a, weights[i])
        y = jnp.einsum("eck,ekn->ecn", a, weights[i].astype(a.dtype),
                       preferred_element_type=jnp.float32)
        return (y * scales[i][:, None, :]).astype(a.dtype)

    def add_bias(y, b):  # [E, N] per group: broadcast over the capacity slots
        return y if b is None else (y + b[:, None, :].astype(y.dtype)).astype(x.dtype)

    yp = _glu_mlp(xp, mm, weights, glu, biases, add_bias, x.dtype)
    return yp.at[gid, slot].get(mode="fill", fill_value=0)


def _plain_gate_up(weights, glu, biases) -> bool:
    """Whether the kernel's SwiGLU epilogue does not apply: another activation or biases
    (gpt-oss), or gate and up in one stack. Gate and up then run as plain grouped matmuls (one on
    a fused stack) and the activation in XLA between them and down."""
    return glu is not None or biases is not None or len(weights) == 2


def _mosaic(x, weights, group_sizes, interpret: bool = False, scales=None, glu=None,
            biases=None):
    e, n_up, h = weights[0].shape[0], weights[0].shape[2], weights[-1].shape[2]
    up_cfg, down_cfg = mosaic_configs(x.shape[0], e, fp8=scales is not None)
    plain = _plain_gate_up(weights, glu, biases)
    up_cfg, down_cfg = _fit(up_cfg, n_up, 1 if plain else 2), _fit(down_cfg, h)
    table = None
    if up_cfg.block_m == down_cfg.block_m:  # both calls cut the rows alike: one table for both
        table = tile_table(group_sizes, padded_rows(x.shape[0], up_cfg.block_m), up_cfg.block_m)
    if plain:
        gid = jnp.minimum(_row_groups(group_sizes, x.shape[0])[0], e - 1)

        def mm(a, i):
            last = i == len(weights) - 1
            return gmm(a, (weights[i],), group_sizes, down_cfg if last else up_cfg, interpret,
                       table)

        return _glu_mlp(x, mm, weights, glu or _silu_glu, biases,
                        lambda y, b: _with_bias(y, b, gid, x.dtype), x.dtype)
    w_gate, w_up, w_down = weights
    if scales is None:
        y = gmm(x, (w_gate, w_up), group_sizes, up_cfg, interpret, table)
        return gmm(y, (w_down,), group_sizes, down_cfg, interpret, table)
    # e4m3 stacks: float16 x (exact for bf16 values in float16's range; the clip keeps an outlier
    # past it finite), float16 SwiGLU output, the result in x's dtype.
    x16 = jnp.clip(x, -65504.0, 65504.0).astype(FP8_COMPUTE)
    y = gmm(x16, (w_gate, w_up), group_sizes, up_cfg, interpret, table, scales[:2])
    return gmm(y, (w_down,), group_sizes, down_cfg, interpret, table, scales[2:], x.dtype)


@functools.cache
def _hopper() -> bool:
    dev = jax.devices()[0]
    return dev.platform == "gpu" and str(getattr(dev, "compute_capability", "")).startswith("9.")


def choose_impl(rows: int, weight_shape: tuple[int, int, int], capacity: int, dtype,
                weight_dtype=None, impl: str = "auto", *, gpu: bool | None = None,
                hopper: bool | None = None) -> str:
    """The implementation `moe_experts` runs for this call shape on a device that is a `gpu`
    (`hopper`; None: the default device's) with weights of `weight_dtype` (default `dtype`):
    `impl` (one of CHOICES) where it names one, else `pick_impl`'s rule, with the Mosaic kernel
    where it applies unless `impl` is "xla"."""
    if impl not in CHOICES:
        raise ValueError(f"moe_impl {impl!r}: expected one of {', '.join(CHOICES)}")
    if impl in IMPLS:
        return impl
    num_groups, hidden, inter = weight_shape
    gpu = jax.devices()[0].platform == "gpu" if gpu is None else gpu
    hopper = _hopper() if hopper is None else hopper
    return pick_impl(rows, num_groups, capacity, gpu=gpu,
                     kernel=(impl == "auto" and gpu and hopper
                             and mosaic_supports(hidden, inter, dtype, weight_dtype)))


def pick_impl(rows: int, num_groups: int, capacity: int, *, gpu: bool, kernel: bool) -> str:
    """`choose_impl`'s rule for a device with (`gpu`) and without the Mosaic kernel (`kernel`)."""
    if not gpu:
        return "ragged"
    padding = num_groups * capacity
    if kernel:
        decode_like = rows <= 16 * num_groups
        return "padded" if decode_like and padding <= PADDED_OVER_KERNEL * rows else "mosaic"
    return "padded" if padding <= PADDED_MAX_FACTOR * rows else "ragged"


def moe_experts(x_sorted: jax.Array, weights: tuple[jax.Array, ...], group_sizes: jax.Array, *,
                max_group_size: int | None = None, impl: str = "auto", interpret: bool = False,
                scales: tuple[jax.Array, ...] | None = None, glu: Callable | None = None,
                biases: tuple[jax.Array, ...] | None = None, gpu: bool | None = None,
                hopper: bool | None = None) -> jax.Array:
    """x_sorted [M, H] rows sorted by expert; weights (w_gate [E, H, F], w_up [E, H, F], w_down
    [E, F, H]), or (w_gate_up [E, H, 2F], w_down) with gate and up as one stack (the layout one
    GPU serves gpt-oss's experts in: jaxinfer/model/fused_projections.py); group_sizes int32[E]
    (sum <= M). max_group_size: a static bound on any group's rows (the step's token count;
    default M). impl: one of CHOICES (`choose_impl`). interpret: run the Mosaic kernel in its
    interpreter (CPU tests). scales: float32 [E, out] per stack when the weights are 8-bit
    (w = q * scale). glu: the gated activation `glu(gate, up, dtype)` (default SwiGLU;
    `ClampedSwiGLU` for gpt-oss); biases: (gate, up) [E, F] added before it ((gate_up,) [E, 2F]
    with a fused stack). gpu, hopper: the device's kind (`choose_impl`). Returns [M, H] in x's
    dtype; rows past sum(group_sizes) are undefined."""
    m = x_sorted.shape[0]
    capacity = min(m, max_group_size or m)
    impl = choose_impl(m, weights[0].shape, capacity, x_sorted.dtype, weights[0].dtype, impl,
                       gpu=gpu, hopper=hopper)
    if impl == "mosaic" and scales is not None and _plain_gate_up(weights, glu, biases):
        # The kernel's plain calls take 16-bit stacks only: 8-bit gpt-oss experts take the XLA
        # paths.
        impl = pick_impl(m, weights[0].shape[0], capacity, gpu=True, kernel=False)
    if impl == "mosaic":
        if scales is not None and jnp.dtype(weights[0].dtype) != jnp.dtype(FP8):
            raise ValueError(f"impl='mosaic' takes 16-bit or e4m3 expert weights, not "
                             f"{weights[0].dtype}; run 'padded' or 'ragged'")
        return _mosaic(x_sorted, weights, group_sizes, interpret=interpret, scales=scales,
                       glu=glu, biases=biases)
    if impl == "padded":
        return _padded(x_sorted, weights, group_sizes, capacity, scales, glu or _silu_glu, biases)
    return _ragged(x_sorted, weights, group_sizes, scales, glu or _silu_glu, biases)
