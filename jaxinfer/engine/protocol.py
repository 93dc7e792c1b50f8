"""`EngineClient`: the one interface of every front end (vLLM V1's `EngineClient`, vllm/engine/
protocol.py, in a step-driven form): one `LLMEngine`, data-parallel replicas, a disaggregated
prefill/decode pair, the multi-host leader. The server, `LLM` and `AsyncEngine` hold an
`EngineClient` and use nothing else of it.

A front end is not thread-safe: one thread makes every call (AsyncEngine's worker thread, or the
caller of `LLM.generate`), `check_health` excepted."""

from __future__ import annotations

import abc
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from jaxinfer.core.outputs import RequestOutput
from jaxinfer.errors import InvalidRequestError, RequestFailedError
from jaxinfer.sampling_params import SamplingParams

if TYPE_CHECKING:
    from jaxinfer.engine.config import EngineConfig
    from jaxinfer.engine.startup import StartupTimes
    from jaxinfer.model.config import ModelConfig
    from jaxinfer.model.tokenizer import Tokenizer
    from jaxinfer.structured.grammar import GrammarCompiler


class EngineClient(abc.ABC):
    # What the server and LLM read: the settings, the model, its limits, the shared grammar cache,
    # the Prometheus metrics (`.registry`), the KV pool's size over every engine.
    config: EngineConfig
    cfg: ModelConfig
    tokenizer: Tokenizer | None
    max_model_len: int
    model_name: str
    grammars: GrammarCompiler
    metrics: Any
    num_total_blocks: int
    startup: StartupTimes | None  # the startup phases' times (one engine's: the first one built)

    # ---- requests -----------------------------------------------------------------------------
    @abc.abstractmethod
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    priority: int = 0, arrival_time: float | None = None, *,
                    final_output_only: bool = False, lora_request=None) -> object:
        """Validate and queue a request; raises InvalidRequestError (nothing queued). With
        `final_output_only` the request reports once, when it finishes: every choice, whole text.
        `lora_request`: its LoRA adapter (a LoRARequest; docs/lora.md), None for the base model."""

    @abc.abstractmethod
    def abort(self, request_id: str, reason: str = "abort") -> RequestOutput | None:
        """Stop a request and free its blocks; its final output, or None if it is unknown."""

    @abc.abstractmethod
    def take_failed(self) -> list[tuple[str, RequestFailedError]]:
        """The requests the engine failed since the previous call (each already aborted)."""

    @abc.abstractmethod
    def has_unfinished_requests(self) -> bool: ...

    @property
    @abc.abstractmethod
    def num_waiting(self) -> int:
        """Sequences waiting to be scheduled (the server's --max-waiting check)."""

    # ---- outputs ------------------------------------------------------------------------------
    @abc.abstractmethod
    def step(self) -> list[RequestOutput]:
        """One engine step; the outputs of the requests it advanced."""

    def run_to_completion(self) -> Iterable[RequestOutput]:
        while self.has_unfinished_requests():
            yield from self.step()

    # ---- lifecycle ----------------------------------------------------------------------------
    @abc.abstractmethod
    def warmup(self, progress: bool = True) -> float:
        """Compile the step shapes; the seconds it took."""

    @property
    @abc.abstractmethod
    def weight_version(self) -> int: ...

    @abc.abstractmethod
    def update_weights(self, params) -> list[RequestOutput]:
        """New weights (the research loop); requests in flight are aborted and returned."""

    @abc.abstractmethod
    def sleep(self) -> list[RequestOutput]:
        """Release the KV cache's device memory; requests in flight are aborted and returned."""

    @abc.abstractmethod
    def wake(self) -> None: ...

    # ---- LoRA adapters (served by LLMEngine; the other front ends refuse them) ----------------
    def list_loras(self) -> list:
        return []

    def load_lora_adapter(self, name: str, path: str):
        raise InvalidRequestError(f"{type(self).__name__} serves no LoRA adapters", "lora_name")

    def remove_lora(self, name: str) -> None:
        raise InvalidRequestError(f"{type(self).__name__} serves no LoRA adapters", "lora_name")

    def update_lora(self, name: str, params: dict) -> None:
        raise InvalidRequestError(f"{type(self).__name__} serves no LoRA adapters", "lora_name")

    def check_health(self) -> None:
        """Raise if the front end can no longer serve (the server's /health). Called from any
        thread, so it only reads."""
