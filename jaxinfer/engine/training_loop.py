"""The engine's calls for a training loop (RL rollouts, GRPO): swap the weights in place, free and
reallocate the KV cache around a colocated trainer's step. Mixed into `LLMEngine`, whose state they
act on; see docs/engine.md."""

from __future__ import annotations

from jaxinfer.core.outputs import RequestOutput
from jaxinfer.engine.weight_update import PartialUpdateError, check_params, place_like
from jaxinfer.model.fused_projections import fuse_projections, is_fused
from jaxinfer.model.shared_experts import fuse_shared_experts, has_shared_mlp
from jaxinfer.model.lora.stacks import LORA


class TrainingLoopMixin:
    # Whether the engine's weights are its own (loaded from files, or placed by an update) rather
    # than a caller's pytree handed to the constructor: only its own may be freed by an update.
    owns_weights = False

    def update_weights(self, params) -> list[RequestOutput]:
        """Swap in new weights without recompiling: `params` has the loaded model's structure and
        shapes (any float dtype: cast to the engine's on the device), as numpy on the host or as
        arrays on any device (moved device to device). Refused with a ParamsMismatchError naming the
        parameter otherwise, changing nothing.

        In-flight rule: every request not finished when the update is called is aborted (finish
        reason "abort"); their final outputs are returned. So every output token comes from the one
        weight version its RequestOutput names; resubmit what should run on the new weights.
        The prefix cache is emptied: its KV was computed with the old weights. Like every engine
        call, not thread-safe: call it between steps on the thread that steps the engine.

        Memory: when the old weights are the engine's own, each old parameter's device buffer is
        freed as soon as its replacement is in place, so an update needs about one parameter of
        free device memory, not a second copy of the model. Should a transfer fail part way (a
        PartialUpdateError), the engine keeps the mix of new and old parameters it then holds."""
        if is_fused(self.runner.params):  # the engine serves q/k/v and gate/up fused
            params = fuse_projections(params)
        if has_shared_mlp(params) and not has_shared_mlp(self.runner.params):
            params = fuse_shared_experts(params)  # it serves shared experts in the stacks
        base = {k: v for k, v in self.runner.params.items() if k != LORA}  # (adapters stay)
        check_params(params, base)  # (a refusal before anything changes)
        outs = self._abort_all()
        self.scheduler.reset_prefix_cache()
        self._drop_host_kv()
        try:
            placed = place_like(params, base, release_old=self.owns_weights)
        except PartialUpdateError as e:
            self._install_weights(e.params)
            raise
        self._install_weights(placed)
        return outs

    def _install_weights(self, params) -> None:
        self.runner.install_params(params)
        self.owns_weights = True
        self.weight_version += 1

    def sleep(self) -> list[RequestOutput]:
        """Free the KV cache's device memory (e.g. for a colocated trainer) until `wake()`.
        Requests in flight are aborted as by `update_weights` (their outputs are returned) and the
        prefix cache is emptied; requests added while asleep wait, and `step()` refuses to run.
        With a host KV tier the cached blocks are copied to the host first and kept there: after
        `wake()` their prefixes still hit (from the host) unless new weights came meanwhile."""
        if self.asleep:
            return []
        outs = self._abort_all()
        self._offload_for_sleep()
        self.scheduler.reset_prefix_cache(keep_host=True)
        self.runner.release_kv_cache()
        self.asleep = True
        return outs

    def wake(self) -> None:
        """Reallocate the KV cache (same shapes, so the compiled steps still apply)."""
        if self.asleep:
            self.runner.restore_kv_cache()
            self.asleep = False
