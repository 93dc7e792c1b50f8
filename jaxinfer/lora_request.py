"""`LoRARequest(lora_name, lora_int_id, lora_path)`: which adapter a request runs with (vLLM's)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class LoRARequest:
    lora_name: str
    lora_int_id: int  # > 0, unique per adapter in one engine
    lora_path: str = ""
