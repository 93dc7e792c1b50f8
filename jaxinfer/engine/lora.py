"""The engine's LoRA calls: adapters registered by LoRARequest (or --lora-modules), served from
device slots (core/lora_slots.py) in mixed batches, removed, and updated in place for a training
loop. Mixed into `LLMEngine`, whose state they act on; see docs/lora.md."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxinfer.core.lora_slots import LoRASlots
from jaxinfer.engine.config import EngineConfig
from jaxinfer.engine.lora_args import lora_modules, resolved_lora_impl
from jaxinfer.errors import InvalidRequestError
from jaxinfer.lora_request import LoRARequest
from jaxinfer.model.lora.peft import LoRAAdapter, adapter_from_tensors, check_lora_name
from jaxinfer.model.lora.stacks import LORA, empty_stacks, slot_arrays


def zeroed_lora_stacks(cfg, params: dict, config: EngineConfig, plan=None) -> dict:
    """The LoRA stacks of --max-loras slots up to --max-lora-rank for `params`, zeroed and
    replicated over the replica's devices."""
    dtype = params["embed"]["embedding"].dtype
    lora = config.lora
    return empty_stacks(cfg, params, lora.max_loras, lora.max_lora_rank, jnp.dtype(dtype),
                        plan and plan.replicated, pow2=resolved_lora_impl(config) == "pallas")


def with_lora_stacks(cfg, params: dict, config: EngineConfig, plan=None) -> dict:
    """`params` plus zeroed LoRA stacks when LoRA is enabled (unchanged if it has them or is off)."""
    if not config.lora.enable_lora or LORA in params:
        return params
    return {**params, LORA: zeroed_lora_stacks(cfg, params, config, plan)}


class LoRAMixin:
    lora: LoRASlots | None = None

    def _init_lora(self, plan=None) -> None:
        lora = self.config.lora
        if not lora.enable_lora:
            return
        runner = self.runner
        if not runner.has_lora:
            runner.attach_lora_stacks(zeroed_lora_stacks(self.cfg, runner.params, self.config, plan))
        self.lora = LoRASlots(self.cfg, max_loras=lora.max_loras, max_rank=lora.max_lora_rank,
                              max_cpu_loras=lora.max_cpu_loras or lora.max_loras,
                              write=self._write_lora_slot)
        self.scheduler.enable_lora(self.lora)
        for request in lora_modules(lora.lora_modules):
            self.lora.register(request)

    def _fail_lora_admissions(self) -> None:
        """Fail the requests whose adapter could not be loaded at admission (its file gone)."""
        for rid, error in self.scheduler.take_failed():
            self._fail(rid, error)

    def _write_lora_slot(self, slot: int, adapter: LoRAAdapter | None) -> None:
        runner = self.runner
        runner.write_lora_slot(slot, slot_arrays(adapter, self.cfg, runner.params[LORA]))

    def _lora_id(self, lora_request: LoRARequest | None) -> int:
        """The lora_int_id a new request runs with (0: the base model), registering the adapter
        if it is new. Raises InvalidRequestError / LoRAAdapterError."""
        if lora_request is None:
            return 0
        if self.lora is None:
            raise InvalidRequestError("this engine serves no LoRA adapters (enable_lora=False)",
                                      "model")
        self.lora.register(lora_request)
        return lora_request.lora_int_id

    # ---- public ------------------------------------------------------------------------------
    def add_lora(self, lora_request: LoRARequest) -> None:
        """Register an adapter (read and checked now; loaded into a slot when a request needs it).
        Raises LoRAAdapterError naming the field at fault, changing nothing."""
        self._lora_id(lora_request)

    def load_lora_adapter(self, name: str, path: str) -> LoRARequest:
        """Register the adapter at `path` as `name` under a new lora_int_id (the server's
        /v1/load_lora_adapter). Raises InvalidRequestError / LoRAAdapterError, changing nothing."""
        if self.lora is None:
            raise InvalidRequestError("LoRA is not enabled: start with --enable-lora", "lora_name")
        if check_lora_name(name) in self.config.model.served_model_names:
            raise InvalidRequestError(f"lora_name '{name}' is the base model's name", "lora_name")
        if self.lora.id_of(name) is not None:
            raise InvalidRequestError(f"The lora adapter '{name}' has already been loaded.",
                                      "lora_name")
        if not isinstance(path, str) or not path:
            raise InvalidRequestError("lora_path must be a non-empty string", "lora_path")
        request = LoRARequest(name, max(self.lora.registered, default=0) + 1, path)
        self.lora.register(request)
        return request

    def list_loras(self) -> list[LoRARequest]:
        return [] if self.lora is None else [r.request for r in self.lora.registered.values()]

    def remove_lora(self, name: str) -> None:
        """Forget an adapter; refused while an unfinished request uses it."""
        lora_id = None if self.lora is None else self.lora.id_of(name)
        if lora_id is None:
            raise InvalidRequestError(f"no LoRA adapter named '{name}' is loaded", "lora_name")
        users = [rid for rid, req in self.requests.items() if req.lora_id == lora_id]
        if users:
            raise InvalidRequestError(f"LoRA adapter '{name}' is in use by {len(users)} "
                                      f"unfinished request(s)", "lora_name")
        self.lora.unregister(name)

    def update_lora(self, name: str, params: dict) -> None:
        """Swap a registered adapter's weights in place, without recompiling: `params` maps PEFT
        tensor names (`...layers.{i}.self_attn.q_proj.lora_A.weight` [r, in], `lora_B.weight`
        [out, r], as get_peft_model_state_dict gives them) to arrays (numpy or jax), with the
        adapter's rank; its scale stays. Projections it omits become zero. Requests of this adapter
        that are running see the new weights from the next step; its prefix-cache entries are
        never matched again. Raises LoRAAdapterError / InvalidRequestError, changing nothing."""
        lora_id = None if self.lora is None else self.lora.id_of(name)
        if lora_id is None:
            raise InvalidRequestError(f"no LoRA adapter named '{name}' is loaded", "lora_name")
        entry = self.lora.registered[lora_id]
        adapter = adapter_from_tensors({k: np.asarray(v) for k, v in params.items()}, self.cfg,
                                       entry.rank, entry.scaling, name)
        self.lora.update(name, adapter)
