"""Memory planner: how many KV-cache blocks fit on the device.

    kv budget  = gpu_memory_utilization × device memory − weight bytes − activation peak
                 − compile scratch (compile_scratch.py: the GPU autotuner's buffers)
    num_blocks = floor(kv budget / bytes per block)
    bytes per block = cache arrays (KVCacheGroups.num_slots: num_layers but for windowed models)
                      × the layers' page (kv_specs.py: block_size × 2 × num_kv_heads × head_dim
                      × dtype bytes for attention, block_size × latent width × dtype bytes for MLA)

"Device memory" is the card's, as vLLM's flag means (``device_memory_bytes``): JAX's allocator
limit (``memory_stats()['bytes_limit']``) over the share of the card it was given. JAX gives its
allocator 75% of a GPU unless XLA_CLIENT_MEM_FRACTION says otherwise, so every engine entry point
first calls ``claim_allocator_share(--gpu-memory-utilization)``: while nobody set the share and JAX
has not started, the allocator takes that share of the card. Where it holds less (a share set by
the user, or JAX already started), the figure shrinks so that the budget stays within the
allocator's limit. The activation peak is measured, not guessed: compile the step for the
largest bucket and pass ``activation_peak_bytes(compiled)``; the KV cache is donated to the step,
so its size does not change that figure and a two-block cache serves for the measurement
(activation_bytes.py). The compile scratch is what XLA's GPU autotuner allocates while the
buckets compile beside the cache (compile_scratch.py). ``--num-blocks`` skips all of this.
``JAXINFER_DEVICE_MEMORY`` (a size: 80GB, 16GiB, bytes) stands in for the device's figure, e.g.
to plan on a CPU as on a GPU in tests.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from typing import Any

import jax
import jax.numpy as jnp

from jaxinfer.model.config import ModelConfig
from jaxinfer.errors import ConfigError, JaxinferError
from jaxinfer.core.kv_cache.cache_config import CacheConfig, resolve_kv_cache_dtype
from jaxinfer.core.kv_cache.kv_groups import KVCacheGroups

log = logging.getLogger(__name__)

GIB = 1 << 30
DEVICE_MEMORY_ENV = "JAXINFER_DEVICE_MEMORY"
_SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def format_bytes(n: float) -> str:
    """Bytes in the largest binary unit they reach: '16.06 GiB', '4.00 MiB', '12 B'."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


class MemoryPlanError(JaxinferError):
    """The KV cache cannot be sized: device memory unknown (CPU) or too small for one block."""


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """KV bytes one token occupies across the model: 2 (K and V) × L × H_kv × d_k × bytes."""
    return 2 * num_layers * num_kv_heads * head_dim * dtype_bytes


def latent_bytes_per_token(num_layers: int, latent_width: int, dtype_bytes: int) -> int:
    """An MLA model's cache bytes per token: one latent entry (no separate V) per layer."""
    return num_layers * latent_width * dtype_bytes


def kv_bytes_per_block(cfg: ModelConfig, block_size: int, kv_dtype: jnp.dtype,
                       num_slots: int | None = None) -> int:
    """A block's bytes: one page (the layer's KV-cache spec, kv_specs.py) of each of `num_slots`
    layers (KVCacheGroups.num_slots; all layers when None), since with KV groups a block id spans
    one page of each cache array. KVCacheGroups refuses layers whose pages differ, so the first
    layer's page is every layer's."""
    page = cfg.layer_kv_specs()[0].page_bytes(block_size, kv_dtype)
    return (num_slots or cfg.num_layers) * page


def tree_nbytes(tree: Any) -> int:
    """Bytes held by all arrays of a pytree (e.g. the model parameters)."""
    return sum(int(x.nbytes) for x in jax.tree_util.tree_leaves(tree) if hasattr(x, "nbytes"))


def activation_peak_bytes(compiled: Any) -> int:
    """Device memory a compiled step needs beyond its inputs, from ``compiled.memory_analysis()``.

    temp (scratch) + generated code + outputs that do not alias a donated input (the KV cache is
    donated and aliased, so only the sampled tokens and logprobs count)."""
    stats = compiled.memory_analysis()
    if stats is None:
        raise MemoryPlanError("this backend reports no memory analysis for compiled code; "
                              "pass --num-blocks")
    fresh_outputs = max(0, stats.output_size_in_bytes - stats.alias_size_in_bytes)
    return int(stats.temp_size_in_bytes + stats.generated_code_size_in_bytes + fresh_outputs)


def parse_size(text: str, what: str) -> int:
    """'16060522496', '16.06GB', '14.96 GiB' -> bytes; ConfigError naming ``what`` otherwise."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _SIZE_UNITS:
        raise ConfigError(f"{what} '{text}' is not a size (examples: 16060522496, 16GB, 14.9GiB)")
    return round(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])


def device_memory_override() -> int | None:
    """$JAXINFER_DEVICE_MEMORY in bytes, or None when unset."""
    text = os.environ.get(DEVICE_MEMORY_ENV)
    return parse_size(text, DEVICE_MEMORY_ENV) if text else None


# JAX's GPU allocator takes this share of the card unless one of these variables sets it (the
# second is the older name; jaxlib refuses both at once).
JAX_DEFAULT_MEM_FRACTION = 0.75
MEM_FRACTION_ENVS = ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION")


def allocator_fraction(unset: float = JAX_DEFAULT_MEM_FRACTION) -> float:
    """The share of a GPU JAX's allocator takes (or took, if it has started): the variables', else
    `unset` (JAX's default; an engine about to start claims --gpu-memory-utilization)."""
    for name in MEM_FRACTION_ENVS:
        if os.environ.get(name):
            return float(os.environ[name])
    return unset


def claim_allocator_share(utilization: float) -> bool:
    """Give JAX's GPU allocator `utilization` of the card before JAX starts, where nobody set its
    share: JAX's default (75%) would leave a sixth of what --gpu-memory-utilization 0.9 asks for
    unused. True when this call set it."""
    from jax._src import xla_bridge  # (no public way to ask whether the backends started)
    if allocator_fraction(unset=0.0) or xla_bridge.backends_are_initialized():
        return False
    os.environ[MEM_FRACTION_ENVS[0]] = f"{utilization:g}"
    log.info("JAX's GPU allocator takes %g of the card (--gpu-memory-utilization; %s overrides)",
             utilization, MEM_FRACTION_ENVS[0])
    return True


def usable_card_bytes(card_bytes: int, allocator_bytes: int, utilization: float) -> int:
    """The device figure the plans take `utilization` of: the card's memory, or less where JAX's
    allocator holds less than that share of it (the plan must stay within the allocator)."""
    if allocator_bytes >= int(utilization * card_bytes):
        return card_bytes
    return int(allocator_bytes / utilization)


def device_memory_bytes(utilization: float = 1.0, device: jax.Device | None = None) -> int:
    """The card's memory as the plans count it (usable_card_bytes: its `utilization` share stays
    within JAX's allocator), or $JAXINFER_DEVICE_MEMORY when set. CPU reports none:
    MemoryPlanError."""
    override = device_memory_override()
    if override is not None:
        return override
    device = device or jax.devices()[0]
    stats = device.memory_stats()
    if not stats or "bytes_limit" not in stats:
        raise MemoryPlanError(f"device {device} ({device.platform}) does not report its memory, so "
                              f"the KV cache cannot be sized automatically; pass --num-blocks")
    limit = int(stats["bytes_limit"])
    card = int(limit / allocator_fraction())
    usable = usable_card_bytes(card, limit, utilization)
    if usable < card - (1 << 20):  # (not a rounding difference)
        log.warning("JAX's allocator holds %s, %g of the card (set by %s, or JAX started before "
                    "the engine): less than --gpu-memory-utilization %g of it, so the plan takes "
                    "the allocator's %s", format_bytes(limit), allocator_fraction(),
                    " or ".join(MEM_FRACTION_ENVS), utilization, format_bytes(limit))
    return usable


def largest_free_block_bytes(devices) -> int | None:
    """The smallest, over `devices`, of the largest contiguous free region of JAX's allocator
    (None where a device does not report it, e.g. the CPU)."""
    sizes = [(d.memory_stats() or {}).get("largest_free_block_bytes") for d in devices]
    return None if not sizes or None in sizes else int(min(sizes))


# Room kept free of the KV cache in the largest free region (allocation rounding, small buffers).
CONTIGUOUS_SLACK = 256 << 20


@dataclasses.dataclass(frozen=True)
class KVCachePlan:
    num_blocks: int
    block_size: int
    kv_dtype: jnp.dtype
    bytes_per_block: int
    # The budget behind num_blocks; None where --num-blocks overrode the planner.
    device_bytes: int | None = None
    gpu_memory_utilization: float | None = None
    weight_bytes: int | None = None
    activation_bytes: int | None = None
    # Set when the largest contiguous free region, not the budget, bounded num_blocks.
    contiguous_bytes: int | None = None
    compile_scratch_bytes: int = 0
    compile_workers: int | None = None  # the compiles at once the scratch is kept for

    @property
    def kv_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    @property
    def max_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def as_dict(self) -> dict:
        """The plan's figures, JSON-ready (bytes), as the startup log and benchmarks record them."""
        out = {k: v for k, v in dataclasses.asdict(self).items() if k != "kv_dtype"}
        return {**out, "kv_dtype": jnp.dtype(self.kv_dtype).name, "kv_bytes": self.kv_bytes,
                "max_tokens": self.max_tokens}

    def describe(self) -> str:
        """One log line: the figures behind the number of blocks."""
        head = (f"KV cache: {self.num_blocks} blocks × {self.block_size} tokens = {self.max_tokens} "
                f"tokens, {self.kv_bytes / GIB:.2f} GiB ({jnp.dtype(self.kv_dtype).name})")
        if self.device_bytes is None:
            return head + " (--num-blocks)"
        budget = (f" = {self.gpu_memory_utilization:g} × {self.device_bytes / GIB:.2f} GiB device"
                  f" − {self.weight_bytes / GIB:.2f} GiB weights"
                  f" − {self.activation_bytes / GIB:.2f} GiB activations"
                  f" − {self.compile_scratch_bytes / GIB:.2f} GiB compile scratch"
                  f" ({self.compile_workers} compiles at once)")
        if self.contiguous_bytes is None:
            return head + budget
        return (head + f", bounded by the largest free region of device memory "
                f"({self.contiguous_bytes / GIB:.2f} GiB; the rest is fragmented, e.g. by weights "
                f"quantized on load); the budget was{budget}")


def plan_kv_cache(cfg: ModelConfig, cache: CacheConfig, *, weight_bytes: int,
                  activation_bytes: int = 0, device_bytes: int | None = None,
                  model_dtype: str | None = None, contiguous_bytes: int | None = None,
                  compile_scratch_bytes: int = 0,
                  compile_workers: int | None = None) -> KVCachePlan:
    """Number of blocks for this model and cache config (see the module docstring for the formula).

    ``device_bytes`` defaults to device_memory_bytes(--gpu-memory-utilization); ``model_dtype``
    (for --kv-cache-dtype auto) defaults to the config's dtype. ``contiguous_bytes``: the
    allocator's largest free region (largest_free_block_bytes); the cache's arrays are each one
    allocation, so free memory in smaller holes cannot hold them: the cache then stays within that
    region (less the activations, the compile scratch and CONTIGUOUS_SLACK). Raises
    MemoryPlanError naming the flags to change when not even one block fits."""
    kv_dtype = resolve_kv_cache_dtype(cache.kv_cache_dtype, model_dtype or cfg.dtype)
    groups = KVCacheGroups.for_model(cfg, cache.hybrid_kv_cache)
    block_bytes = groups.page_bytes(cache.block_size, kv_dtype)
    if cache.num_blocks is not None:
        return KVCachePlan(cache.num_blocks, cache.block_size, kv_dtype, block_bytes)
    if device_bytes is None:
        device_bytes = device_memory_bytes(cache.gpu_memory_utilization)
    reserved = activation_bytes + compile_scratch_bytes
    budget = int(cache.gpu_memory_utilization * device_bytes) - weight_bytes - reserved
    num_blocks = budget // block_bytes if budget > 0 else 0
    capped = None
    if contiguous_bytes is not None:
        room = max(contiguous_bytes - reserved - CONTIGUOUS_SLACK, 0) // block_bytes
        if room < num_blocks:
            num_blocks, capped = room, contiguous_bytes
    if num_blocks < 1:
        raise MemoryPlanError(
            f"no room for the KV cache: {cache.gpu_memory_utilization:g} × "
            f"{format_bytes(device_bytes)} (--gpu-memory-utilization × device) − "
            f"{format_bytes(weight_bytes)} weights − {format_bytes(activation_bytes)} activations "
            f"− {format_bytes(compile_scratch_bytes)} compile scratch "
            f"= {format_bytes(budget)} < one {block_bytes}-byte block; raise "
            f"--gpu-memory-utilization, shrink the largest step bucket, or set --num-blocks")
    return KVCachePlan(int(num_blocks), cache.block_size, kv_dtype, block_bytes, device_bytes,
                       cache.gpu_memory_utilization, weight_bytes, activation_bytes, capped,
                       compile_scratch_bytes, compile_workers)
