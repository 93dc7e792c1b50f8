"""What an engine over fixed-state layers (FixedStateSpec: a Mamba-2 hybrid's state-space
layers, Qwen3-Next's Gated DeltaNet) does not run yet, refused at start with the flag that asks
for it (docs/feature_matrix.md). A state spans as many attention pages as it needs
(kv_specs.FixedStateSpec.state_pages), so every --block-size holds it; prefix caching keeps
snapshots of it (core/kv_cache/state_snapshots.py); in an fp8 cache its float32 words are the
pages' bytes (state_pages.py); under tensor parallelism each device keeps its heads' states in its
shard of the pages (parallel/state_heads.py)."""

from __future__ import annotations

from jaxinfer.core.kv_cache import FixedStateSpec, KVCacheGroups
from jaxinfer.errors import ConfigError


def refuse_what_fixed_state_lacks(groups: KVCacheGroups, config, kv_dtype) -> None:
    """ConfigError naming the flag when the model has fixed-state layers and `config` (EngineConfig)
    ask for what they do not support; none for a model without them."""
    cache = config.cache
    states = [spec for spec in groups.specs if isinstance(spec, FixedStateSpec)]
    if not states:
        return
    if cache.kv_offload:
        # A state-space layer's group stays apart even without --hybrid-kv-cache.
        raise ConfigError("--kv-offload: the host tier holds the blocks of one KV group, and "
                          "a model with state-space layers has a group of their states")
    spec = config.speculative
    if spec is not None:
        raise ConfigError(f"--speculative-method {spec.method}: speculative decoding over "
                          f"state-space layers is not built (a rejected token would need the "
                          f"state rolled back)")
    page = groups.page_spec.page_bytes(cache.block_size, kv_dtype)
    if any(state.state_pages(cache.block_size, kv_dtype) * page % 4 for state in states):
        # The states are float32 words laid over the pages (model/state_pages.py).
        raise ConfigError(f"--block-size {cache.block_size}: a state-space layer's pages "
                          f"({page} bytes each) do not end on a 4-byte word; use an even "
                          f"block size")
