"""What an engine over fixed-state layers (FixedStateSpec: a Mamba-2 hybrid's state-space
layers, Qwen3-Next's Gated DeltaNet) does not run yet, refused at start with the flag that asks
for it (docs/feature_matrix.md). A state spans as many attention pages as it needs
(kv_specs.FixedStateSpec.state_pages), so every --block-size holds it; prefix caching keeps
snapshots of it (core/kv_cache/state_snapshots.py), which the host tier (--kv-offload) carries
with their prefix (core/kv_cache/host_offload.py). In a 16-bit or fp8 cache a
float32 word is packed into several elements, laid over the pages element by element
(state_pages.py), so no page needs to end on a word (--block-size 1 with an fp8 cache).
Under tensor parallelism each device keeps its heads' states in its shard of the pages
(parallel/state_heads.py). Speculative decoding (n-gram, draft model, EAGLE-3, MTP) rolls a
state back past a rejected proposal from a copy taken before the verifying step
(core/kv_cache/state_rollback.py), between host-driven verifying steps: an EAGLE-3 / MTP head's
on-device loop (spec_decode/spec_loop.py) stays off (spec_decode/speculation.py)."""

from __future__ import annotations

from jaxinfer.core.kv_cache import FixedStateSpec, KVCacheGroups
from jaxinfer.errors import ConfigError


def refuse_what_fixed_state_lacks(groups: KVCacheGroups, config) -> None:
    """ConfigError naming the flag when the model has fixed-state layers and `config` (EngineConfig)
    ask for what they do not support; none for a model without them."""
    if not any(isinstance(spec, FixedStateSpec) for spec in groups.specs):
        return
    spec, loop = config.speculative, config.scheduler.spec_loop_iterations
    if spec is not None and spec.method in ("eagle3", "mtp") and loop is not None and loop > 1:
        raise ConfigError(f"--spec-loop-iterations {loop}: an on-device speculative loop over "
                          f"state-space layers is not built (it verifies several times per call, "
                          f"with no host step between to roll a state back past a rejected "
                          f"proposal); leave it out or pass 1: {spec.method} speculation runs "
                          f"host-driven verifying steps")
