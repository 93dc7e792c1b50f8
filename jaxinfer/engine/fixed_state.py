"""What an engine over fixed-state layers (FixedStateSpec: a Mamba-2 hybrid's state-space
layers, Qwen3-Next's Gated DeltaNet) needs: the setting it decides itself (prefix caching off;
`with_fixed_state_decided`, logged), and what it does not run yet, refused at start with the
flag that asks for it (docs/feature_matrix.md). A state spans as many attention pages as it
needs (kv_specs.FixedStateSpec.state_pages), so every --block-size holds it."""

from __future__ import annotations

import dataclasses
import logging

from jaxinfer.core.kv_cache import FixedStateSpec, KVCacheGroups
from jaxinfer.errors import ConfigError
from pallas_kernels.attention.kv_quant import is_fp8


log = logging.getLogger(__name__)


def with_fixed_state_decided(cfg, args):
    """`args` (EngineArgs) as a model with fixed-state layers runs them, the change logged, as
    vLLM does for its Mamba layers: prefix caching off (a state's pages hold the state after
    its sequence's last token, not one per block, so a hit would have no state to resume
    from)."""
    if not args.enable_prefix_caching or not any(
            isinstance(s, FixedStateSpec) for s in cfg.layer_kv_specs()):
        return args
    log.info("state-space layers: enable_prefix_caching=False")
    return dataclasses.replace(args, enable_prefix_caching=False)


def refuse_what_fixed_state_lacks(groups: KVCacheGroups, config, kv_dtype) -> None:
    """ConfigError naming the flag when the model has fixed-state layers and `config` (EngineConfig)
    ask for what they do not support; none for a model without them."""
    cache = config.cache
    states = [spec for spec in groups.specs if isinstance(spec, FixedStateSpec)]
    if not states:
        return
    if cache.kv_offload:
        raise ConfigError("--kv-offload: the host tier keeps prefix-cache blocks, and prefix "
                          "caching of state-space layers' states is not built")
    if cache.enable_prefix_caching:
        # A state's pages hold its sequence's latest state, none for a block's last token: a
        # prefix hit would have no state to resume from.
        raise ConfigError("--enable-prefix-caching: prefix caching of state-space layers' "
                          "states is not built; pass --no-enable-prefix-caching for this model")
    spec = config.speculative
    if spec is not None:
        raise ConfigError(f"--speculative-method {spec.method}: speculative decoding over "
                          f"state-space layers is not built (a rejected token would need the "
                          f"state rolled back)")
    if config.parallel.tensor_parallel_size > 1:
        raise ConfigError("--tensor-parallel-size > 1: state-space layers' states are not "
                          "sharded over devices yet")
    if is_fp8(kv_dtype):
        # The fp8 scales are calibrated per layer from the attention's K and V, which a
        # state-space layer has none of.
        raise ConfigError(f"--kv-cache-dtype {cache.kv_cache_dtype}: an fp8 KV cache beside "
                          f"state-space layers is not built (their states would share its "
                          f"pages); use the model dtype")
    page = groups.page_spec.page_bytes(cache.block_size, kv_dtype)
    if any(state.state_pages(cache.block_size, kv_dtype) * page % 4 for state in states):
        # The states are float32 words laid over the pages (model/state_pages.py).
        raise ConfigError(f"--block-size {cache.block_size}: a state-space layer's pages "
                          f"({page} bytes each) do not end on a 4-byte word; use an even "
                          f"block size")
