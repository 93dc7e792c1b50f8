"""Named workloads for `jaxinfer bench throughput | latency --preset NAME`: a model shape (random
weights, `--load-format dummy`, a generated tokenizer covering its vocabulary) and the flags the
project's records of that model ran with. A preset fills in only the flags the command line left
at their defaults, so `--preset llama8b --num-prompts 8` keeps the 8.

The model directory (config.json + tokenizer) is written once under the user cache
(~/.cache/jaxinfer/bench-models/<preset>)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from jaxinfer.paths import user_cache_dir

LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256, "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0, "max_position_embeddings": 8192, "torch_dtype": "bfloat16",
    "tie_word_embeddings": False, "bos_token_id": 128000, "eos_token_id": 128001,
}
LLAMA3_70B = {**LLAMA3_8B, "hidden_size": 8192, "intermediate_size": 28672,
              "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8}
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 2048, "intermediate_size": 6144,
    "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
    "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
    "vocab_size": 151936, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "max_position_embeddings": 40960, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "bos_token_id": 151643, "eos_token_id": 151645,
}
MIXTRAL_8X7B = {
    "architectures": ["MixtralForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
    "num_local_experts": 8, "num_experts_per_tok": 2, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 32000,
    "rms_norm_eps": 1e-5, "rope_theta": 1000000.0, "max_position_embeddings": 32768,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2,
}

DEEPSEEK_V2_LITE = {
    "architectures": ["DeepseekV2ForCausalLM"], "hidden_size": 2048, "intermediate_size": 10944,
    "kv_lora_rank": 512, "max_position_embeddings": 163840, "moe_intermediate_size": 1408,
    "moe_layer_freq": 1, "n_group": 1, "n_routed_experts": 64, "n_shared_experts": 2,
    "norm_topk_prob": False, "num_attention_heads": 16, "num_experts_per_tok": 6,
    "num_hidden_layers": 27, "num_key_value_heads": 16, "q_lora_rank": None,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-6,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707,
                     "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096,
                     "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 1.0, "scoring_func": "softmax",
    "topk_group": 1, "topk_method": "greedy", "v_head_dim": 128, "vocab_size": 102400,
    "first_k_dense_replace": 1, "torch_dtype": "bfloat16", "bos_token_id": 100000,
    "eos_token_id": 100001,
}


# openai/gpt-oss-20b's config.json (32 experts top 4, sliding and full attention alternating).
GPT_OSS_20B = {
    "architectures": ["GptOssForCausalLM"], "hidden_size": 2880, "intermediate_size": 2880,
    "num_hidden_layers": 24, "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64,
    "num_local_experts": 32, "num_experts_per_tok": 4, "sliding_window": 128,
    "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                     "truncate": False, "original_max_position_embeddings": 4096},
    "rope_theta": 150000.0, "swiglu_limit": 7.0, "attention_bias": True, "rms_norm_eps": 1e-5,
    "vocab_size": 201088, "max_position_embeddings": 131072, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "bos_token_id": 199998, "eos_token_id": 200002,
}
# Qwen3-Next-80B-A3B's config.json (Gated DeltaNet 3 : 1 gated attention, 512 experts top 10 and
# a shared expert).
QWEN3_NEXT_80B_A3B = {
    "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "vocab_size": 151936,
    "hidden_size": 2048, "intermediate_size": 5120, "num_hidden_layers": 48,
    "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
    "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "full_attention_interval": 4,
    "num_experts": 512, "num_experts_per_tok": 10, "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "norm_topk_prob": True, "hidden_act": "silu", "max_position_embeddings": 262144,
    "rope_theta": 10000000, "partial_rotary_factor": 0.25, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 151643,
    "eos_token_id": 151645,
}
# ibm-granite/granite-4.0-h-tiny's config.json (Mamba-2 with attention in layers 5, 15, 25 and
# 35, NoPE; 64 experts top 6 beside a shared MLP).
GRANITE_4_H_TINY = {
    "architectures": ["GraniteMoeHybridForCausalLM"], "model_type": "granitemoehybrid",
    "vocab_size": 100352, "hidden_size": 1536, "intermediate_size": 512,
    "shared_intermediate_size": 1024, "num_hidden_layers": 40, "num_attention_heads": 12,
    "num_key_value_heads": 4,
    "layer_types": ["attention" if i in (5, 15, 25, 35) else "mamba" for i in range(40)],
    "mamba_n_heads": 48, "mamba_d_head": 64, "mamba_d_state": 128, "mamba_n_groups": 1,
    "mamba_expand": 2, "mamba_d_conv": 4, "mamba_chunk_size": 256, "mamba_conv_bias": True,
    "mamba_proj_bias": False, "num_local_experts": 64, "num_experts_per_tok": 6,
    "position_embedding_type": "nope", "attention_multiplier": 0.0078125,
    "embedding_multiplier": 12, "residual_multiplier": 0.22, "logits_scaling": 6,
    "rms_norm_eps": 1e-5, "hidden_act": "silu", "max_position_embeddings": 131072,
    "tie_word_embeddings": True, "torch_dtype": "bfloat16", "bos_token_id": 100257,
    "eos_token_id": 100257,
}


@dataclasses.dataclass(frozen=True)
class Preset:
    description: str
    config: dict  # the model's config.json
    flags: dict  # argparse dests -> values, the record's workload

    def model_dir(self, name: str, root: Path | None = None) -> Path:
        """The preset's model directory (config.json and a generated tokenizer), written once."""
        from jaxinfer.bench.generated_tokenizer import write_generated_tokenizer
        d = (root or user_cache_dir() / "bench-models") / name
        cfg = json.dumps(self.config, sort_keys=True)
        if not (d / "tokenizer.json").is_file() or (d / "config.json").read_text() != cfg:
            d.mkdir(parents=True, exist_ok=True)
            (d / "config.json").write_text(cfg)
            write_generated_tokenizer(d)
        return d


_ENGINE = {"load_format": "dummy", "dtype": "bfloat16", "temperature": 0.0}
PRESETS = {
    # benchmarks/results/engine_<gpu>.json's llama8b section
    "llama8b": Preset("Llama-3-8B shape, 64 prompts x 512 in / 256 out, 64 sequences",
                      LLAMA3_8B, {**_ENGINE, "num_prompts": 64, "input_len": 512, "output_len": 256,
                                  "max_num_seqs": 64, "max_num_batched_tokens": 2048,
                                  "max_model_len": 2048}),
    # engine_llama8b_<gpu>.json's c256 workload
    "llama8b_c256": Preset("Llama-3-8B shape, 256 prompts x 512 in / 256 out, 256 sequences",
                           LLAMA3_8B, {**_ENGINE, "num_prompts": 256, "input_len": 512,
                                       "output_len": 256, "max_num_seqs": 256,
                                       "max_model_len": 2048}),
    # fairness_<gpu>.json: 64 streams beside a 32 x 2048 burst (--prefill-burst), room for both
    "llama8b_burst": Preset("Llama-3-8B shape, 64 decoding streams beside 32 x 2048-token prompts",
                            LLAMA3_8B, {**_ENGINE, "max_num_seqs": 256, "max_model_len": 4096,
                                        "num_blocks": 16384, "background_compile": False}),
    "llama70b": Preset("Llama-3-70B shape (needs tensor parallelism), 64 x 512 / 256",
                       LLAMA3_70B, {**_ENGINE, "num_prompts": 64, "input_len": 512,
                                    "output_len": 256, "max_num_seqs": 64, "max_model_len": 2048}),
    # moe_<gpu>.json's engine section
    "qwen3_30b_a3b": Preset("Qwen3-30B-A3B shape (128 experts, top 8), 64 x 512 / 256",
                            QWEN3_30B_A3B, {**_ENGINE, "num_prompts": 64, "input_len": 512,
                                            "output_len": 256, "max_num_seqs": 64,
                                            "max_num_batched_tokens": 2048, "max_model_len": 1024,
                                            "background_compile": False}),
    # families_<gpu>.json's gpt-oss section: batch 1 (`bench latency --batch-size 1`) and c = 64
    "gpt_oss_20b": Preset("gpt-oss-20b shape (32 experts, top 4), 64 x 512 / 256",
                          GPT_OSS_20B, {**_ENGINE, "num_prompts": 64, "input_len": 512,
                                        "output_len": 256, "max_num_seqs": 64,
                                        "max_model_len": 2048}),
    "mixtral_8x7b": Preset("Mixtral-8x7B shape (8 experts, top 2), 64 x 512 / 256",
                           MIXTRAL_8X7B, {**_ENGINE, "num_prompts": 64, "input_len": 512,
                                          "output_len": 256, "max_num_seqs": 64,
                                          "max_num_batched_tokens": 2048, "max_model_len": 1024,
                                          "background_compile": False}),
}


def apply(args, parser, root: Path | None = None) -> None:
    """Fills `args` from `args.preset`: each preset flag the command line left at `parser`'s
    default, and --model (the preset's model directory) unless given."""
    if not getattr(args, "preset", None):
        return
    preset = PRESETS[args.preset]
    for dest, value in preset.flags.items():
        if hasattr(args, dest) and getattr(args, dest) == parser.get_default(dest):
            setattr(args, dest, value)
    if getattr(args, "model", None) == parser.get_default("model"):
        args.model = str(preset.model_dir(args.preset, root))
