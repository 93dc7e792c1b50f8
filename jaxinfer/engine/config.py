"""The engine's settings in parts, as vLLM's VllmConfig holds them: what model, how its KV cache is
kept, how steps are scheduled, over which devices, with which speculation, adapters and compiled
kernels, and what it records about itself.

`EngineArgs` (engine/args.py) stays the flat form users and the command line write;
`EngineArgs.create_engine_config()` cuts it into these frozen parts once, and the engine and its
pieces read only the part they need. The parts carry no defaults of their own: EngineArgs's are
the only ones. Each part's fields carry the EngineArgs names, so a flag is
found under one name everywhere (`tests/test_engine_config.py` checks that every EngineArgs
field lands in exactly one part, and that no part grows past MAX_FIELDS).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from jaxinfer.core.kv_cache import CacheConfig
from jaxinfer.model.hub import is_hub_id, resolve_model
from jaxinfer.spec_decode.config import SpeculativeConfig

MAX_FIELDS = 15

# The on-device decode loop's default: this many steps per call while at most AUTO_LOOP_MAX_SEQS
# sequences decode (the launch-bound regime). A request that arrives meanwhile waits for at most
# one loop before its prefill (the scheduler starts no loop while one waits).
AUTO_DECODE_STEPS = 8
AUTO_LOOP_MAX_SEQS = 8


@dataclasses.dataclass(frozen=True)
class ModelSettings:
    """Which checkpoint, read how, and what clients call it."""
    model: str
    load_format: str
    dtype: str
    quantization: str | None
    max_model_len: int | None
    tokenizer: str | None
    chat_template: str | None
    served_model_name: str | list[str] | None
    seed: int

    @property
    def model_path(self) -> str:
        """--model as a directory: a hub id resolves to its snapshot in the local HF cache."""
        return resolve_model(self.model)

    @property
    def served_model_names(self) -> list[str]:
        names = self.served_model_name
        if not names:  # a hub id is its own name; a directory is named by its last part
            return [self.model if is_hub_id(self.model) else Path(self.model).name]
        return [names] if isinstance(names, str) else list(names)

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """What one step holds and how steps follow each other."""
    max_num_seqs: int
    max_num_batched_tokens: int
    long_prefill_chunk: int
    max_step_tokens_while_decoding: int | None
    itl_target_ms: float | str | None
    decode_steps_per_call: int | None
    decode_loop_max_seqs: int | None
    spec_loop_iterations: int | None
    async_scheduling: bool
    async_launch: bool

    def decode_loop(self, speculative: bool, auto: bool = True) -> tuple[int, int]:
        """(steps per call, most decoding sequences) of the on-device decode loop; 1 step: none.
        The automatic loop stays off with speculative decoding, whose verify steps serve the same
        few-sequence regime and never run in a loop, and where the engine says (`auto` False:
        engine/fixed_state.py `automatic_decode_loop`)."""
        steps = self.decode_steps_per_call
        if steps is None:
            steps = AUTO_DECODE_STEPS if auto and not speculative else 1
            default_seqs = AUTO_LOOP_MAX_SEQS
        else:
            default_seqs = self.max_num_seqs
        seqs = self.decode_loop_max_seqs
        return steps, min(self.max_num_seqs, default_seqs if seqs is None else seqs)


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """The devices and processes one engine spans (jaxinfer/parallel/, jaxinfer/disagg/)."""
    tensor_parallel_size: int
    data_parallel_size: int
    expert_layout: str
    coordinator_address: str | None
    num_processes: int | None
    process_id: int | None
    disaggregate: bool
    prefill_tensor_parallel_size: int
    decode_tensor_parallel_size: int
    prefill_devices: str | list[int] | None
    decode_devices: str | list[int] | None


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    """LoRA adapters (docs/lora.md)."""
    enable_lora: bool
    lora_modules: list | None
    max_loras: int
    max_lora_rank: int
    lora_impl: str
    max_cpu_loras: int | None


@dataclasses.dataclass(frozen=True)
class CompilationConfig:
    """Which kernels fill the kernel table's slots, and when and where steps are compiled."""
    attention_backend: str
    moe_impl: str
    quant_impl: str
    warmup: bool
    background_compile: bool
    compilation_cache_dir: str | None


@dataclasses.dataclass(frozen=True)
class ObservabilityConfig:
    """What the engine records about itself beyond its metrics."""
    profile_dir: str | None
    profile_steps: int


# The parts cut from EngineArgs by field name; speculation is read from its own flags instead
# (EngineArgs.spec_config: a JSON config or the flat flags).
FLAT_PARTS = {"model": ModelSettings, "cache": CacheConfig, "scheduler": SchedulerConfig,
              "parallel": ParallelConfig, "lora": LoRAConfig, "compilation": CompilationConfig,
              "observability": ObservabilityConfig}


def cut(args, part: type):
    """The part `part` of flat settings `args` (EngineArgs), field by field."""
    return part(**{f.name: getattr(args, f.name) for f in dataclasses.fields(part)})


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    model: ModelSettings
    cache: CacheConfig
    scheduler: SchedulerConfig
    parallel: ParallelConfig
    speculative: SpeculativeConfig | None
    lora: LoRAConfig
    compilation: CompilationConfig
    observability: ObservabilityConfig

    @classmethod
    def from_args(cls, args) -> "EngineConfig":
        parts = {name: cut(args, part) for name, part in FLAT_PARTS.items()}
        return cls(**parts, speculative=args.spec_config())

    def decode_loop(self, auto: bool = True) -> tuple[int, int]:
        return self.scheduler.decode_loop(self.speculative is not None, auto)
