"""KV-cache settings and their command-line flags (shared by every subcommand that runs the engine)."""

from __future__ import annotations

import argparse
import dataclasses
import math

import jax.numpy as jnp

from jaxinfer.errors import ConfigError

# --kv-cache-dtype values. "auto" means the model's dtype. 1-byte types halve the KV footprint;
# they are stored with per-layer scales (kv_scales.py, pallas_kernels/attention/kv_quant.py).
KV_CACHE_DTYPES = {
    "bfloat16": jnp.bfloat16,
    "float16": jnp.float16,
    "float32": jnp.float32,
    "fp8": jnp.float8_e4m3fn,
    "fp8_e4m3": jnp.float8_e4m3fn,
    "fp8_e5m2": jnp.float8_e5m2,
}
MAX_BLOCK_SIZE = 256
# --kv-cache-scales modes (besides a number); kv_scales.py resolves them.
SCALE_MODES = ("auto", "checkpoint", "calibrate")


def resolve_kv_cache_dtype(kv_cache_dtype: str, model_dtype: str) -> jnp.dtype:
    """The cache's element dtype for a --kv-cache-dtype value ('auto' follows the model dtype)."""
    name = model_dtype if kv_cache_dtype == "auto" else kv_cache_dtype
    if name not in KV_CACHE_DTYPES:
        flag = "the model dtype" if kv_cache_dtype == "auto" else "--kv-cache-dtype"
        raise ConfigError(f"{flag} '{name}' is not a KV-cache dtype "
                          f"(choose from auto, {', '.join(KV_CACHE_DTYPES)})")
    return jnp.dtype(KV_CACHE_DTYPES[name])


def check_scales_flag(value: str) -> None:
    """ConfigError naming the flag unless `value` is a mode or a positive number."""
    try:
        ok = value in SCALE_MODES or (float(value) > 0 and math.isfinite(float(value)))
    except ValueError:
        ok = False
    if not ok:
        raise ConfigError(f"--kv-cache-scales '{value}' must be one of {', '.join(SCALE_MODES)} "
                          f"or a positive number")


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """How the paged KV cache is sized and managed. Invalid values raise ConfigError naming the flag."""
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    num_blocks: int | None = None  # overrides the memory planner
    kv_cache_dtype: str = "auto"
    enable_prefix_caching: bool = True
    kv_cache_scales: str = "auto"  # fp8 caches: see kv_scales.py
    hybrid_kv_cache: bool = True  # KV groups per layer window (kv_groups.py)
    kv_offload: bool = False  # a host tier under the prefix cache (host_tier.py)
    kv_host_gib: float = 16.0  # its size

    def __post_init__(self):
        bs = self.block_size
        if not (1 <= bs <= MAX_BLOCK_SIZE and bs & (bs - 1) == 0):
            raise ConfigError(f"--block-size must be a power of two from 1 to {MAX_BLOCK_SIZE} "
                              f"(16 is the default, 32 the other usual choice); got {bs}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(f"--gpu-memory-utilization must be in (0, 1]; "
                              f"got {self.gpu_memory_utilization}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ConfigError(f"--num-blocks must be >= 1; got {self.num_blocks}")
        if self.kv_cache_dtype != "auto" and self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"--kv-cache-dtype '{self.kv_cache_dtype}' is not supported "
                              f"(choose from auto, {', '.join(KV_CACHE_DTYPES)})")
        check_scales_flag(self.kv_cache_scales)
        if self.kv_offload and not self.enable_prefix_caching:
            raise ConfigError("--kv-offload keeps evicted prefix-cache blocks on the host: it "
                              "needs --enable-prefix-caching")
        if not (self.kv_host_gib > 0 and math.isfinite(self.kv_host_gib)):
            raise ConfigError(f"--kv-host-gib must be a positive number of GiB; "
                              f"got {self.kv_host_gib}")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> CacheConfig:
        return cls(block_size=args.block_size, gpu_memory_utilization=args.gpu_memory_utilization,
                   num_blocks=args.num_blocks, kv_cache_dtype=args.kv_cache_dtype,
                   enable_prefix_caching=args.enable_prefix_caching,
                   kv_cache_scales=args.kv_cache_scales,
                   hybrid_kv_cache=args.hybrid_kv_cache, kv_offload=args.kv_offload,
                   kv_host_gib=args.kv_host_gib)


def add_cache_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the KV-cache flags (read back with CacheConfig.from_args)."""
    g = parser.add_argument_group("KV cache")
    g.add_argument("--block-size", type=int, default=16,
                   help="tokens per KV-cache block (default 16; 32 also common)")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="fraction of the GPU's memory the engine uses for weights, activations "
                        "and the KV cache together; JAX's allocator is given that share unless "
                        "XLA_CLIENT_MEM_FRACTION sets one (default 0.9)")
    g.add_argument("--num-blocks", type=int, default=None,
                   help="number of KV-cache blocks; overrides the memory planner")
    g.add_argument("--kv-cache-dtype", default="auto", choices=["auto", *KV_CACHE_DTYPES],
                   help="KV-cache element type (default: the model dtype); fp8 (e4m3, per-layer "
                        "scales) halves KV memory")
    g.add_argument("--kv-cache-scales", default="auto",
                   help="fp8 KV cache: per-layer K/V scales from the 'checkpoint', 'calibrate'd "
                        "on a fixed text, 'auto' (checkpoint if it has them, else calibrate), or "
                        "one number for all (default auto)")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV of shared prompt prefixes across requests (default on)")
    g.add_argument("--hybrid-kv-cache", action=argparse.BooleanOptionalAction, default=True,
                   help="models with sliding-window layers (Gemma 2/3, gpt-oss): give those "
                        "layers their own block tables and free blocks that leave the window "
                        "(default on; off: every layer keeps every block, as vLLM's "
                        "--disable-hybrid-kv-cache-manager)")
    g.add_argument("--kv-offload", action=argparse.BooleanOptionalAction, default=False,
                   help="keep prefix-cache blocks the device evicts in host memory and copy them "
                        "back on a later prefix hit instead of recomputing them (default off)")
    g.add_argument("--kv-host-gib", type=float, default=16.0,
                   help="host memory for --kv-offload, in GiB over all of a replica's devices "
                        "(default 16)")
