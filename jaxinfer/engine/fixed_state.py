"""What an engine over fixed-state layers (FixedStateSpec: a Mamba-2 hybrid's state-space
layers, Qwen3-Next's Gated DeltaNet) needs: the settings it decides itself (prefix caching off,
a block whose page holds the state; `with_fixed_state_decided`, logged), and what it does not
run yet, refused at start with the flag that asks for it (docs/feature_matrix.md)."""

from __future__ import annotations

import dataclasses
import logging

from jaxinfer.core.kv_cache import FixedStateSpec, KVCacheGroups
from jaxinfer.core.kv_cache.cache_config import MAX_BLOCK_SIZE
from jaxinfer.errors import ConfigError
from pallas_kernels.attention.kv_quant import is_fp8


log = logging.getLogger(__name__)


def with_fixed_state_decided(cfg, args, kv_dtype):
    """`args` (EngineArgs) as a model with fixed-state layers runs them, each change logged, as
    vLLM does for its Mamba layers: prefix caching off (a state block holds the state after the
    last token its sequence wrote there, so a hit would resume from a wrong state), and a block
    size whose attention page holds a layer's state (its smallest power of two, when smaller)."""
    states = [s for s in cfg.layer_kv_specs() if isinstance(s, FixedStateSpec)]
    if not states:
        return args
    changes = {}
    if args.enable_prefix_caching:
        changes["enable_prefix_caching"] = False
    need = max(state.smallest_block_size(kv_dtype) for state in states)
    # (A state no page up to MAX_BLOCK_SIZE holds is left to refuse_what_fixed_state_lacks.)
    if not all(state.fits(args.block_size, kv_dtype) for state in states) and (
            need <= MAX_BLOCK_SIZE):
        changes["block_size"] = max(need, args.block_size)
    if changes:
        log.info("state-space layers: %s", ", ".join(f"{k}={v}" for k, v in changes.items()))
    return dataclasses.replace(args, **changes)


def refuse_what_fixed_state_lacks(groups: KVCacheGroups, args, kv_dtype) -> None:
    """ConfigError naming the flag when the model has fixed-state layers and `args` (EngineArgs)
    ask for what they do not support; none for a model without them."""
    states = [spec for spec in groups.specs if isinstance(spec, FixedStateSpec)]
    if not states:
        return
    if args.kv_offload:
        raise ConfigError("--kv-offload: the host tier keeps prefix-cache blocks, and prefix "
                          "caching of state-space layers' states is not built")
    if args.enable_prefix_caching:
        # A state group's block holds the state after the last token its sequence wrote there,
        # not after the block's last token: a prefix hit would resume from a wrong state.
        raise ConfigError("--enable-prefix-caching: prefix caching of state-space layers' "
                          "states is not built; pass --no-enable-prefix-caching for this model")
    spec = args.spec_config()
    if spec is not None:
        raise ConfigError(f"--speculative-method {spec.method}: speculative decoding over "
                          f"state-space layers is not built (a rejected token would need the "
                          f"state rolled back)")
    if args.tensor_parallel_size > 1:
        raise ConfigError("--tensor-parallel-size > 1: state-space layers' states are not "
                          "sharded over devices yet")
    if is_fp8(kv_dtype):
        # The fp8 scales are calibrated per layer from the attention's K and V, which a
        # state-space layer has none of.
        raise ConfigError(f"--kv-cache-dtype {args.kv_cache_dtype}: an fp8 KV cache beside "
                          f"state-space layers is not built (their states would share its "
                          f"pages); use the model dtype")
    if all(state.fits(args.block_size, kv_dtype) for state in states):
        return
    biggest = max(s.state_bytes for s in states)
    if not all(state.fits(MAX_BLOCK_SIZE, kv_dtype) for state in states):
        # (Qwen3-Next-80B's 2.1 MB Gated DeltaNet state needs 2048 tokens' pages in bf16.)
        raise ConfigError(f"--block-size {args.block_size}: a state-space layer's state "
                          f"({biggest} bytes) is stored in one attention page, which does not "
                          f"hold it at any --block-size up to {MAX_BLOCK_SIZE}; states spanning "
                          f"several pages are not built")
    need = max(state.smallest_block_size(kv_dtype) for state in states)
    raise ConfigError(f"--block-size {args.block_size}: a state-space layer's state "
                      f"({biggest} bytes) is stored in one attention page, which holds it "
                      f"from --block-size {need} on")
