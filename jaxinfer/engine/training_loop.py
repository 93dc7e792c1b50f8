"""The engine's calls for a training loop (RL rollouts, GRPO): swap the weights in place, free and
reallocate the KV cache around a colocated trainer's step. Mixed into `LLMEngine`, whose state they
act on; see docs/engine.md."""

from __future__ import annotations

from jaxinfer.engine.outputs import RequestOutput
from jaxinfer.engine.weight_update import place_like
from jaxinfer.model.fused_projections import fuse_projections, is_fused


class TrainingLoopMixin:
    def update_weights(self, params) -> list[RequestOutput]:
        """Swap in new weights without recompiling: `params` has the loaded model's structure and
        shapes (any float dtype: cast to the engine's on the device), as numpy on the host or as
        arrays on any device (moved device to device). Refused with a ParamsMismatchError naming the
        parameter otherwise, changing nothing.

        In-flight rule: every request not finished when the update is called is aborted (finish
        reason "abort"); their final outputs are returned. So every output token comes from the one
        weight version its RequestOutput names; resubmit what should run on the new weights.
        The prefix cache is emptied: its KV was computed with the old weights. Like every engine
        call, not thread-safe: call it between steps on the thread that steps the engine."""
        placed = self._place_params(params)
        outs = self._abort_all()
        self.runner.params = placed
        self.scheduler.reset_prefix_cache()
        self.weight_version += 1
        return outs

    def _place_params(self, params):
        """`params` laid out like the running weights (same sharding and dtype per leaf): the one
        place that decides where new weights live."""
        if is_fused(self.runner.params):
            params = fuse_projections(params)
        return place_like(params, self.runner.params)

    def sleep(self) -> list[RequestOutput]:
        """Free the KV cache's device memory (e.g. for a colocated trainer) until `wake()`.
        Requests in flight are aborted as by `update_weights` (their outputs are returned) and the
        prefix cache is emptied; requests added while asleep wait, and `step()` refuses to run."""
        if self.asleep:
            return []
        outs = self._abort_all()
        self.scheduler.reset_prefix_cache()
        self.runner.release_kv_cache()
        self.asleep = True
        return outs

    def wake(self) -> None:
        """Reallocate the KV cache (same shapes, so the compiled steps still apply)."""
        if self.asleep:
            self.runner.restore_kv_cache()
            self.asleep = False
