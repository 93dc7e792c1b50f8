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
on-device loop (spec_decode/spec_loop.py) stays off (spec_decode/speculation.py). On a GPU the
automatic decode loop stays off too (`automatic_decode_loop`)."""

from __future__ import annotations

import logging

from jaxinfer.core.kv_cache import KVCacheGroups
from jaxinfer.errors import ConfigError

log = logging.getLogger(__name__)


def refuse_what_fixed_state_lacks(groups: KVCacheGroups, config) -> None:
    """ConfigError naming the flag when the model has fixed-state layers and `config` (EngineConfig)
    ask for what they do not support; none for a model without them."""
    if not groups.has_fixed_state:
        return
    spec, loop = config.speculative, config.scheduler.spec_loop_iterations
    if spec is not None and spec.method in ("eagle3", "mtp") and loop is not None and loop > 1:
        raise ConfigError(f"--spec-loop-iterations {loop}: an on-device speculative loop over "
                          f"state-space layers is not built (it verifies several times per call, "
                          f"with no host step between to roll a state back past a rejected "
                          f"proposal); leave it out or pass 1: {spec.method} speculation runs "
                          f"host-driven verifying steps")


def automatic_decode_loop(groups: KVCacheGroups, config, gpu: bool) -> bool:
    """Whether the automatic on-device decode loop may run (EngineConfig.decode_loop's `auto`):
    not over fixed-state layers on a GPU. On an H100 (afe97a5), XLA compiled Granite-4.0-H-Tiny's
    8-step loop over a 36 GB pool with ~29 GB of temporaries, proportional to the pool, not the
    batch, as if it copied the pool in the loop, and the process aborted; the single steps'
    programs at 40,000 blocks take 0.05-0.5 GB. (A CPU's loop takes none: its attention writes
    are XLA scatters, not aliased kernels.) An explicit --decode-steps-per-call keeps its loop."""
    if not gpu or not groups.has_fixed_state:
        return True
    steps = config.scheduler.decode_steps_per_call
    if steps is None:
        log.info("the on-device decode loop stays off over state-space layers on a GPU (its "
                 "compile asked for about the KV pool's size again); --decode-steps-per-call N "
                 "turns it on")
    elif steps > 1:
        log.warning("--decode-steps-per-call %d over state-space layers: on an H100 the loop's "
                    "compile asked for about the KV pool's size again; lower "
                    "--gpu-memory-utilization if it runs out of memory", steps)
    return False
