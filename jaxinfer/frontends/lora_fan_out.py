"""The LoRA calls of a front end over several engines (data-parallel replicas, a disaggregated
pair): each adapter is registered in every engine under one id, so a request runs its adapter on
whichever engine serves it (docs/lora.md).

Each change is made on the first engine, which checks it and raises changing nothing, then on the
others, which accept what the first did (the same files, the same ids)."""

from __future__ import annotations

from jaxinfer.errors import InvalidRequestError


class LoRAFanOut:
    """Mixed into a front end whose `lora_engines` are the LLMEngines it drives and whose
    `requests` are its unfinished requests."""

    @property
    def lora_engines(self) -> list:
        raise NotImplementedError

    def list_loras(self) -> list:
        return self.lora_engines[0].list_loras()

    def add_lora(self, lora_request) -> None:
        for engine in self.lora_engines:
            engine.add_lora(lora_request)

    def load_lora_adapter(self, name: str, path: str):
        first, *rest = self.lora_engines
        request = first.load_lora_adapter(name, path)
        for engine in rest:
            engine.add_lora(request)
        return request

    def remove_lora(self, name: str) -> None:
        lora_id = next((r.lora_int_id for r in self.list_loras() if r.lora_name == name), None)
        users = [rid for rid, req in self.requests.items() if lora_id and req.lora_id == lora_id]
        if users:  # (one engine's own check would leave the others without it)
            raise InvalidRequestError(f"LoRA adapter '{name}' is in use by {len(users)} "
                                      f"unfinished request(s)", "lora_name")
        for engine in self.lora_engines:
            engine.remove_lora(name)

    def update_lora(self, name: str, params: dict) -> None:
        for engine in self.lora_engines:
            engine.update_lora(name, params)
