"""Engine settings and their command-line flags (`jaxinfer generate`, `jaxinfer serve`, benchmarks).

`EngineArgs.add_cli_args(parser)` registers every flag; `EngineArgs.from_cli_args(ns)` reads them
back. The KV-cache flags are the cache package's own (`add_cache_arguments`).
"""

from __future__ import annotations

import argparse
import dataclasses

from jaxinfer import paths
from jaxinfer.errors import ConfigError
from jaxinfer.core.kv_cache import CacheConfig, add_cache_arguments
from jaxinfer.disagg.args import add_disagg_arguments, check_disagg_args
from jaxinfer.engine.config import (AUTO_DECODE_STEPS, AUTO_LOOP_MAX_SEQS, EngineConfig,
                                    ModelSettings, cut)
from jaxinfer.engine.itl_target import (AUTO_FACTOR, MAX_STEPS_WITHOUT_PROMPTS, check_itl_target,
                                        parse_itl_target)
from jaxinfer.engine.lora_args import add_lora_arguments, check_lora_args
from jaxinfer.model.quant_scheme import QUANTIZATIONS
from jaxinfer.parallel.sharding import DEFAULT_EXPERT_LAYOUT, EXPERT_LAYOUTS
from jaxinfer.spec_decode.config import (SpeculativeConfig, add_speculative_arguments,
                                         speculative_config)

DEFAULT_MODEL = str(paths.DEFAULT_MODEL)
DTYPES = ("auto", "bfloat16", "float16", "float32")


def default_compilation_cache_dir() -> str:
    return str(paths.user_cache_dir() / "jax_compilation_cache")


@dataclasses.dataclass
class EngineArgs:
    model: str = DEFAULT_MODEL
    load_format: str = "auto"
    dtype: str = "auto"  # auto: the checkpoint's dtype (config.json torch_dtype)
    quantization: str | None = None  # None: the checkpoint's (config.json quantization_config)
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    block_size: int = 16
    num_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    kv_cache_dtype: str = "auto"
    kv_cache_scales: str = "auto"
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    long_prefill_chunk: int = 512
    # Tokens (decodes + prompt chunks) of a step that decodes (None: the whole step budget), so a
    # long prefill chunk does not stall the running streams.
    max_step_tokens_while_decoding: int | None = None
    # Inter-token latency target of the decoding streams (engine/itl_target.py): ms, "auto"
    # (AUTO_FACTOR x the measured idle decode step) or None (off; `jaxinfer serve`: "auto").
    # It lowers max_step_tokens_while_decoding step by step from measured step times.
    itl_target_ms: float | str | None = None
    enable_prefix_caching: bool = True
    hybrid_kv_cache: bool = True  # sliding-window layers drop blocks out of their window
    kv_offload: bool = False  # host KV tier (core/kv_cache/host_tier.py)
    kv_host_gib: float = 16.0
    attention_backend: str = "auto"
    # The MoE experts' and quantized matmuls' implementations (the kernel table's slots,
    # model/kernel_table.py; "auto": chosen per call shape and device).
    moe_impl: str = "auto"
    quant_impl: str = "auto"
    warmup: bool = True
    # Ready once the first buckets are compiled; the rest compile in the background.
    background_compile: bool = True
    # Decode steps per on-device loop when only decodes run and nothing waits (1: no loop);
    # None: AUTO_DECODE_STEPS, for at most decode_loop_max_seqs sequences.
    decode_steps_per_call: int | None = None
    # The most decoding sequences a loop runs for; None: AUTO_LOOP_MAX_SEQS with the automatic
    # steps per call, no limit with a given number.
    decode_loop_max_seqs: int | None = None
    # Verifying iterations per on-device loop of an EAGLE-3 / MTP head while at most
    # decode_loop_max_seqs sequences decode (spec_decode/spec_loop.py); None: automatic (none
    # over state-space layers); 1: none.
    spec_loop_iterations: int | None = None
    compilation_cache_dir: str | None = dataclasses.field(
        default_factory=default_compilation_cache_dir)  # "" or None: no executable cache
    profile_dir: str | None = None
    profile_steps: int = 5
    seed: int = 0
    # Names clients may use for the model; the first is the one responses and metrics report.
    served_model_name: str | list[str] | None = None
    tokenizer: str | None = None  # directory with tokenizer.json (default: the model directory)
    chat_template: str | None = None  # a template file, or the template itself (overrides the model's)
    # Schedule step N+1 before waiting for step N's tokens (host/device overlap).
    async_scheduling: bool = True
    # Dispatch each step from a launcher thread while the engine processes the previous one.
    async_launch: bool = False
    # Parallelism (jaxinfer/parallel/): devices per replica, replicas, multi-process run.
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    expert_layout: str = DEFAULT_EXPERT_LAYOUT  # MoE experts under tp: "ep" or "tp"
    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    # Speculative decoding (jaxinfer/spec_decode/config.py; None: off or the default).
    speculative_method: str | None = None
    speculative_model: str | None = None
    num_speculative_tokens: int | None = None
    ngram_prompt_lookup_min: int | None = None
    ngram_prompt_lookup_max: int | None = None
    speculative_disable_by_batch_size: int | None = None
    speculative_min_acceptance: float | None = None
    speculative_config: str | dict | None = None
    # Prefill and decode on separate device groups (jaxinfer/disagg/, docs/disaggregation.md).
    disaggregate: bool = False
    prefill_tensor_parallel_size: int = 1
    decode_tensor_parallel_size: int = 1
    prefill_devices: str | list[int] | None = None  # device indices; default: the first ones
    decode_devices: str | list[int] | None = None   # default: the ones after the prefill group
    # LoRA adapters (engine/lora_args.py, docs/lora.md).
    enable_lora: bool = False
    lora_modules: list | None = None  # "name=path" or {"name": ..., "path": ...} entries
    max_loras: int = 1
    max_lora_rank: int = 16
    # The LoRA delta's implementation (the kernel table's slot; model/lora/delta.py): xla,
    # pallas, or auto (kernel_table.lora_impl).
    lora_impl: str = "auto"
    max_cpu_loras: int | None = None  # None: max_loras

    def __post_init__(self):
        def check(ok: bool, flag: str, value, why: str):
            if not ok:
                raise ConfigError(f"--{flag} {value!r}: {why}")

        check(self.dtype in DTYPES, "dtype", self.dtype, f"choose from {', '.join(DTYPES)}")
        check(self.quantization in (None, *QUANTIZATIONS), "quantization", self.quantization,
              f"choose from {', '.join(QUANTIZATIONS)}")
        check(self.max_num_seqs >= 1, "max-num-seqs", self.max_num_seqs, "must be >= 1")
        check(self.max_num_batched_tokens >= self.max_num_seqs, "max-num-batched-tokens",
              self.max_num_batched_tokens, f"must be >= --max-num-seqs ({self.max_num_seqs})")
        check(self.long_prefill_chunk >= 1, "long-prefill-chunk", self.long_prefill_chunk,
              "must be >= 1")
        check(self.max_step_tokens_while_decoding is None
              or self.max_step_tokens_while_decoding >= 1, "max-step-tokens-while-decoding",
              self.max_step_tokens_while_decoding, "must be >= 1")
        self.itl_target_ms = check_itl_target(self.itl_target_ms)
        check(self.decode_steps_per_call is None or self.decode_steps_per_call >= 1,
              "decode-steps-per-call", self.decode_steps_per_call, "must be >= 1")
        check(self.decode_loop_max_seqs is None or self.decode_loop_max_seqs >= 1,
              "decode-loop-max-seqs", self.decode_loop_max_seqs, "must be >= 1")
        check(self.spec_loop_iterations is None or self.spec_loop_iterations >= 1,
              "spec-loop-iterations", self.spec_loop_iterations, "must be >= 1")
        check(self.max_model_len is None or self.max_model_len >= 2, "max-model-len",
              self.max_model_len, "must be >= 2")
        check(self.tensor_parallel_size >= 1, "tensor-parallel-size", self.tensor_parallel_size,
              "must be >= 1")
        check(self.data_parallel_size >= 1, "data-parallel-size", self.data_parallel_size,
              "must be >= 1")
        check(self.expert_layout in EXPERT_LAYOUTS, "expert-layout", self.expert_layout,
              f"choose from {', '.join(EXPERT_LAYOUTS)}")
        from jaxinfer.model.quant.ops import CHOICES as QUANT_IMPLS
        from pallas_kernels.moe.grouped_matmul import CHOICES as MOE_IMPLS
        check(self.moe_impl in MOE_IMPLS, "moe-impl", self.moe_impl,
              f"choose from {', '.join(MOE_IMPLS)}")
        check(self.quant_impl in QUANT_IMPLS, "quant-impl", self.quant_impl,
              f"choose from {', '.join(QUANT_IMPLS)}")
        self.cache_config()  # validates the KV-cache flags
        self.spec_config()  # validates the speculative-decoding flags
        check_disagg_args(self)
        check_lora_args(self)

    def cache_config(self) -> CacheConfig:
        return CacheConfig(block_size=self.block_size,
                           gpu_memory_utilization=self.gpu_memory_utilization,
                           num_blocks=self.num_blocks, kv_cache_dtype=self.kv_cache_dtype,
                           enable_prefix_caching=self.enable_prefix_caching,
                           hybrid_kv_cache=self.hybrid_kv_cache,
                           kv_cache_scales=self.kv_cache_scales, kv_offload=self.kv_offload,
                           kv_host_gib=self.kv_host_gib)

    def spec_config(self) -> SpeculativeConfig | None:
        return speculative_config(
            method=self.speculative_method, model=self.speculative_model,
            num_tokens=self.num_speculative_tokens, lookup_min=self.ngram_prompt_lookup_min,
            lookup_max=self.ngram_prompt_lookup_max,
            disable_by_batch_size=self.speculative_disable_by_batch_size,
            config_json=self.speculative_config, min_acceptance=self.speculative_min_acceptance)

    def create_engine_config(self) -> EngineConfig:
        """These settings cut into the parts the engine reads (engine/config.py)."""
        return EngineConfig.from_args(self)

    def decode_loop(self) -> tuple[int, int]:
        return self.create_engine_config().decode_loop()

    def _model_settings(self) -> ModelSettings:
        return cut(self, ModelSettings)

    @property
    def model_path(self) -> str:
        return self._model_settings().model_path

    @property
    def served_model_names(self) -> list[str]:
        return self._model_settings().served_model_names

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        from pallas_kernels.attention.backend import available_backends
        from pallas_kernels.moe.grouped_matmul import CHOICES as MOE_IMPLS
        from jaxinfer.model.quant.ops import CHOICES as QUANT_IMPLS
        from jaxinfer.model.weights import LOAD_FORMATS
        from jaxinfer.parallel.distributed import add_parallel_arguments
        d = EngineArgs.__dataclass_fields__
        g = parser.add_argument_group("model")
        g.add_argument("--model", default=DEFAULT_MODEL,
                       help="HF-format model directory, or a hub id already in the local Hugging "
                            "Face cache (default: the bundled demo model)")
        g.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                       help="names the API accepts for the model; the first is reported in "
                            "responses and metrics (default: the directory name)")
        g.add_argument("--tokenizer", default=None,
                       help="directory (or cached hub id) with tokenizer.json (default: the "
                            "model's)")
        g.add_argument("--chat-template", default=None,
                       help="chat template file (or the template itself) used instead of the "
                            "model's")
        g.add_argument("--load-format", default="auto", choices=list(LOAD_FORMATS))
        g.add_argument("--dtype", default="auto", choices=DTYPES,
                       help="weight/activation dtype (default: the checkpoint's)")
        g.add_argument("--quantization", default=None, choices=QUANTIZATIONS,
                       help="weight quantization: fp8 (e4m3 weights and per-token activations on "
                            "FP8 tensor cores) or int8 (weight-only); a bf16 checkpoint is "
                            "quantized on load (default: the checkpoint's quantization_config)")
        g.add_argument("--max-model-len", type=int, default=None,
                       help="longest prompt + output in tokens (default: the model's maximum)")
        g.add_argument("--seed", type=int, default=0,
                       help="seed of the generator that seeds requests without their own seed")
        add_cache_arguments(parser)
        s = parser.add_argument_group("scheduler")
        s.add_argument("--max-num-seqs", type=int, default=d["max_num_seqs"].default,
                       help="most sequences in one step")
        s.add_argument("--max-num-batched-tokens", type=int,
                       default=d["max_num_batched_tokens"].default,
                       help="token budget of one step (decodes + prefill chunks)")
        s.add_argument("--long-prefill-chunk", type=int, default=d["long_prefill_chunk"].default,
                       help="most prompt tokens of one sequence per step (chunked prefill)")
        s.add_argument("--max-step-tokens-while-decoding", type=int, default=None,
                       help="most tokens (decodes + prompt chunks) in a step that decodes; prompt "
                            "chunks get at least a quarter of it (default: the whole step "
                            "budget); lower keeps inter-token latency smooth under load")
        s.add_argument("--itl-target-ms", type=parse_itl_target, default=None,
                       help="inter-token latency target of the decoding streams: a step that "
                            "decodes carries only the prompt tokens that keep it under this "
                            "many ms, from step times measured as the engine runs (a long prompt "
                            "still advances, at least one step in %d); 'auto': %g x the measured "
                            "time of a step of decodes alone, of the batch the running and "
                            "waiting requests make; 'off' (default: auto for `serve`, off "
                            "otherwise)"
                       % (MAX_STEPS_WITHOUT_PROMPTS + 1, AUTO_FACTOR))
        s.add_argument("--decode-steps-per-call", type=int, default=None,
                       help="decode steps run on the device per host round trip when only "
                            "decodes run and no request waits (an on-device loop of that many "
                            "steps; a sequence that finishes inside it stops there, the others "
                            "go on); 1: no loop (default: 1 for `serve`, whose streams get each "
                            "token as its step ends; otherwise %d while at most "
                            "--decode-loop-max-seqs sequences decode, else 1)" % AUTO_DECODE_STEPS)
        s.add_argument("--decode-loop-max-seqs", type=int, default=None,
                       help="most decoding sequences a decode loop runs for (default: %d with "
                            "the default --decode-steps-per-call, no limit with a given one); "
                            "a request arriving during a loop waits for its end"
                       % AUTO_LOOP_MAX_SEQS)
        s.add_argument("--spec-loop-iterations", type=int, default=None,
                       help="with an EAGLE-3 / MTP head: verifying iterations (head catch-up, "
                            "k proposals, verify) per on-device loop while only decodes run, "
                            "all speculate and at most --decode-loop-max-seqs do; 1: none "
                            "(default: 4; none over state-space layers)")
        s.add_argument("--no-async-scheduling", dest="async_scheduling", action="store_false",
                       help="wait for each step's tokens before scheduling the next")
        s.add_argument("--async-launch", action="store_true",
                       help="dispatch steps from a thread of their own, overlapping jax's and "
                            "XLA's dispatch cost with output processing (a failed dispatch then "
                            "fails the engine, not only the step's requests)")
        k = parser.add_argument_group(
            "kernels and compilation", "(--moe-impl, --quant-impl and --lora-impl force one kernel: "
            "for benchmarks and bisection, docs/kernels/)")
        k.add_argument("--attention-backend", default="auto", choices=available_backends())
        # Kernel overrides for benchmarks and bisection, accepted but kept out of --help (the
        # kernel table picks per platform and shape; docs/kernels/grouped_matmul.md,
        # docs/quantization.md, docs/lora.md say what each forces).
        k.add_argument("--moe-impl", default="auto", choices=MOE_IMPLS, help=argparse.SUPPRESS)
        k.add_argument("--quant-impl", default="auto", choices=QUANT_IMPLS, help=argparse.SUPPRESS)
        k.add_argument("--no-warmup", dest="warmup", action="store_false",
                       help="do not compile every step bucket at start-up")
        k.add_argument("--no-background-compile", dest="background_compile",
                       action="store_false",
                       help="compile every step bucket before ready (default: ready once the "
                            "first buckets are compiled, the rest compiling in the background)")
        k.add_argument("--compilation-cache-dir", default=default_compilation_cache_dir(),
                       help="where compiled steps are kept for the next start ('' disables)")
        o = parser.add_argument_group("observability")
        o.add_argument("--profile-dir", default=None,
                       help="write a jax.profiler trace of --profile-steps steps here")
        o.add_argument("--profile-steps", type=int, default=5)
        add_parallel_arguments(parser)
        add_speculative_arguments(parser)
        add_disagg_arguments(parser)
        add_lora_arguments(parser)
        return parser

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> "EngineArgs":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in vars(ns).items() if k in names})
