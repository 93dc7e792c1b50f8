"""`jaxinfer memory`: KV-cache sizing and the decode roofline for a model on an accelerator.

Everything follows from the per-token KV footprint 2 × L × H_kv × d_k × bytes (K and V, every
attention layer, every KV head), or L × (kv_lora_rank + rope dim) × bytes for multi-head latent
attention (DeepSeek: one latent per token and layer, shared by every head; docs/MLA.md). A
hybrid's state-space layers (Mamba-2, Gated DeltaNet) add one state per sequence, whatever its
length, over as many attention pages as it needs (kv_specs.FixedStateSpec). Decode reads all
weights plus every sequence's whole KV cache once per step and produces one token per sequence,
so its arithmetic intensity is small next to an accelerator's ridge point (peak FLOP/s ÷ memory
bandwidth): decode is memory-bound, and bytes ÷ bandwidth bounds a step from below.
"""

from __future__ import annotations

import argparse
import sys
import dataclasses
import json

import jax.numpy as jnp

from jaxinfer.errors import ConfigError
from jaxinfer.core.kv_cache.cache_config import KV_CACHE_DTYPES, resolve_kv_cache_dtype
from jaxinfer.core.kv_cache import (FixedStateSpec, FullAttentionSpec, KVCacheGroups,
                                    MLAAttentionSpec, SlidingWindowSpec)
from jaxinfer.worker.kv.planner import (GIB, kv_bytes_per_token, latent_bytes_per_token,
                                        format_bytes, parse_size)
from jaxinfer.model.quant_scheme import QUANTIZATIONS, resolve_quantization


@dataclasses.dataclass(frozen=True)
class Accelerator:
    name: str
    memory_bytes: int
    bandwidth: float  # bytes/s
    bf16_flops: float  # dense FLOP/s

    @property
    def ridge_point(self) -> float:
        """FLOP per byte above which a kernel is compute-bound."""
        return self.bf16_flops / self.bandwidth


# Vendor datasheet figures (SXM parts; memory in 10^9 bytes as the datasheets state it).
ACCELERATORS = {
    "h200": Accelerator("h200", 141 * 10**9, 4.8e12, 989e12),
    "h100-80gb": Accelerator("h100-80gb", 80 * 10**9, 3.35e12, 989e12),
    "a100-80gb": Accelerator("a100-80gb", 80 * 10**9, 2.039e12, 312e12),
    "a100-40gb": Accelerator("a100-40gb", 40 * 10**9, 1.555e12, 312e12),
    "l4": Accelerator("l4", 24 * 10**9, 0.3e12, 121e12),
}

def parse_accelerator(text: str, bandwidth_tbs: float | None, tflops: float | None) -> Accelerator:
    """A named accelerator, or a memory size in GiB (roofline then needs --bandwidth/--tflops)."""
    for flag, value in (("--bandwidth", bandwidth_tbs), ("--tflops", tflops)):
        if value is not None and not value > 0:  # (also NaN)
            raise ConfigError(f"{flag} must be > 0; got {value}")
    base = ACCELERATORS.get(text.lower())
    if base is None:
        try:
            gib = float(text)
        except ValueError:
            raise ConfigError(f"--accelerator '{text}' is neither a size in GiB nor one of "
                              f"{', '.join(ACCELERATORS)}") from None
        if gib <= 0:
            raise ConfigError(f"--accelerator must be > 0 GiB; got {text}")
        base = Accelerator(f"{gib:g} GiB", int(gib * GIB), 0.0, 0.0)
    return dataclasses.replace(
        base, bandwidth=bandwidth_tbs * 1e12 if bandwidth_tbs is not None else base.bandwidth,
        bf16_flops=tflops * 1e12 if tflops is not None else base.bf16_flops)


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """What the memory figures need from a model."""
    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_heads: int
    weight_bytes: int
    active_params: int  # parameters one token multiplies with (MoE: routed experts only)
    weight_dtype: str
    quantization: str | None = None  # weight quantization (jaxinfer/model/quant)
    max_position_embeddings: int | None = None  # the model's context (None: shape given as flags)
    layer_windows: tuple[int | None, ...] = ()  # sliding windows (None: a global layer)
    # Multi-head latent attention: the cached latent's width (kv_lora_rank + rope dim) and the
    # part of it the values are (kv_lora_rank); 0: not MLA.
    mla_latent: int = 0
    mla_value: int = 0
    # Per layer whether it is a state-space layer (a fixed state per sequence, no K/V per
    # token); () none is. `state_bytes`: the float32 state of each such layer.
    state_layers: tuple[bool, ...] = ()
    state_bytes: int = 0

    @property
    def attention_layers(self) -> int:
        return self.num_layers - sum(self.state_layers)

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        if self.mla_latent:
            return latent_bytes_per_token(self.num_layers, self.mla_latent, dtype_bytes)
        return kv_bytes_per_token(self.attention_layers, self.num_kv_heads, self.head_dim,
                                  dtype_bytes)

    def attention_flops_per_context_token(self) -> int:
        """QK^T and PV per context token of one decode row: 2 × H_q × (d_k + d_v) per layer;
        MLA's absorbed form scores the 576-wide latent and sums its 512-wide value part."""
        if self.mla_latent:
            return 2 * self.num_layers * self.num_heads * (self.mla_latent + self.mla_value)
        return 4 * self.attention_layers * self.num_heads * self.head_dim

    def kv_read_fraction(self, seq_len: int) -> float:
        """The share of a sequence's KV a decode step reads at context `seq_len`: a windowed
        layer reads at most its window (the kernels skip the pages outside it)."""
        if not self.layer_windows:
            return 1.0
        return sum(min(seq_len, w or seq_len) for w in self.layer_windows) / (
            len(self.layer_windows) * seq_len)

    def kv_pool_fraction(self, seq_len: int, block_size: int, kv_dtype) -> float:
        """What the block pool holds for one sequence of `seq_len` tokens with the hybrid KV
        allocator (kv_groups.py: windowed layers keep their window's blocks, a state-space
        layer the attention pages its state spans in a cache of `kv_dtype`; every KV group pads
        to the same number of layers), over the attention layers' K and V of every token."""
        if not self.layer_windows and not self.state_layers:
            return 1.0
        groups = KVCacheGroups.from_layer_specs(self.layer_specs())
        return groups.tokens_held(seq_len, block_size, kv_dtype) * groups.num_slots / (
            self.attention_layers * seq_len)

    def layer_specs(self) -> list:
        """Each layer's KV-cache spec (model/kv_specs.py)."""
        page = FullAttentionSpec(self.num_kv_heads, self.head_dim)
        windows = self.layer_windows or (None,) * self.num_layers
        states = self.state_layers or (False,) * self.num_layers
        return [FixedStateSpec(self.state_bytes, page_of=page) if state else
                page if window is None else
                SlidingWindowSpec(self.num_kv_heads, self.head_dim, sliding_window=window)
                for window, state in zip(windows, states)]


def _shape_from_args(args: argparse.Namespace) -> ModelShape:
    flags = {"--layers": args.layers, "--kv-heads": args.kv_heads, "--head-dim": args.head_dim,
             "--heads": args.heads, "--kv-lora-rank": args.kv_lora_rank}
    if args.model is None and all(v is None for v in flags.values()):
        from jaxinfer.paths import DEFAULT_MODEL  # as `jaxinfer serve` without a model
        args.model = str(DEFAULT_MODEL)
    if args.model:
        given = [f for f, v in flags.items() if v is not None]
        if given:
            raise ConfigError(f"{given[0]} cannot be combined with --model (the model's "
                              f"config.json defines it)")
        from jaxinfer.model.config import load_config
        from jaxinfer.model.hub import resolve_model
        cfg = load_config(resolve_model(args.model))
        quant = resolve_quantization(args.quantization, cfg.quantization, "safetensors")
        dtype = args.dtype or cfg.dtype
        nbytes = _dtype_bytes(dtype, "--dtype" if args.dtype else f"{args.model}/config.json torch_dtype")
        params = cfg.num_params() if not cfg.layer_states else _param_count(cfg)
        inactive = sum(cfg.layer_is_moe(i) for i in range(cfg.num_layers)) * (
            cfg.num_experts - cfg.num_experts_per_tok) * 3 * cfg.hidden_size * cfg.moe_intermediate_size
        if args.weight_bytes:
            weights = parse_size(args.weight_bytes, "--weight-bytes")
        elif quant:  # 8-bit linears plus their scales: the bytes of the param tree itself
            weights = quantized_weight_bytes(dataclasses.replace(cfg, quantization=quant), dtype)
        else:
            weights = params * nbytes
        spec = cfg.layer_kv_specs()[0]  # MLA models are latent in every layer
        mla = ((spec.latent_width, spec.value_width) if isinstance(spec, MLAAttentionSpec)
               else (0, 0))
        return ModelShape(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.num_heads, weights,
                          params - inactive, dtype, quant, cfg.max_position_embeddings,
                          cfg.layer_windows, *mla,
                          state_layers=tuple(s is not None for s in cfg.layer_states),
                          state_bytes=max((s or 0 for s in cfg.layer_states), default=0))
    if args.quantization:
        raise ConfigError("--quantization needs --model (without it, give the quantized size as "
                          "--weight-bytes)")
    if args.kv_lora_rank is not None:  # MLA: one latent "KV head" of kv_lora_rank + rope dim
        args.kv_heads = args.kv_heads or 1
        args.head_dim = args.head_dim or args.kv_lora_rank + args.qk_rope_dim
    for flag in ("--layers", "--kv-heads", "--head-dim"):
        if getattr(args, flag[2:].replace("-", "_")) is None:
            raise ConfigError(f"{flag} is required without --model")
    flags.update({"--kv-heads": args.kv_heads, "--head-dim": args.head_dim})
    for flag, value in flags.items():
        if value is not None and value < 1:
            raise ConfigError(f"{flag} must be >= 1; got {value}")
    dtype = args.dtype or "bfloat16"
    nbytes = _dtype_bytes(dtype, "--dtype")
    heads = args.heads or args.kv_heads
    if heads % args.kv_heads:
        raise ConfigError(f"--heads {heads} is not a multiple of --kv-heads {args.kv_heads}")
    weights = parse_size(args.weight_bytes, "--weight-bytes") if args.weight_bytes else 0
    mla = ((args.kv_lora_rank + args.qk_rope_dim, args.kv_lora_rank)
           if args.kv_lora_rank is not None else (0, 0))
    return ModelShape(args.layers, args.kv_heads, args.head_dim, heads, weights, weights // nbytes,
                      dtype, mla_latent=mla[0], mla_value=mla[1])


def _param_count(cfg) -> int:
    """Parameters of the model's param tree (a hybrid's layers differ from the attention
    layers ModelConfig.num_params counts)."""
    import jax

    from jaxinfer.model.transformer import param_shapes
    return sum(leaf.size for leaf in jax.tree_util.tree_leaves(param_shapes(cfg)))


def quantized_weight_bytes(cfg, dtype: str) -> int:
    """Bytes of the model's param tree under cfg.quantization (no arrays are made)."""
    import jax

    from jaxinfer.model.transformer import param_shapes
    leaves = jax.tree_util.tree_leaves(param_shapes(cfg, jnp.dtype(KV_CACHE_DTYPES[dtype])))
    return sum(leaf.size * leaf.dtype.itemsize for leaf in leaves)


def _dtype_bytes(name: str, flag: str) -> int:
    if name not in KV_CACHE_DTYPES:
        raise ConfigError(f"{flag} '{name}' is not supported (choose from {', '.join(KV_CACHE_DTYPES)})")
    return jnp.dtype(KV_CACHE_DTYPES[name]).itemsize


def memory_report(shape: ModelShape, *, kv_dtype: str, seq_len: int, batch: int, block_size: int,
                  accelerator: Accelerator, gpu_memory_utilization: float,
                  kv_host_gib: float = 16.0) -> dict:
    """All figures of `jaxinfer memory` as a JSON-ready dict (bytes, tokens, FLOP, seconds)."""
    cache_dtype = resolve_kv_cache_dtype(kv_dtype, shape.weight_dtype)
    kv_bytes = jnp.dtype(cache_dtype).itemsize
    per_token = shape.kv_bytes_per_token(kv_bytes)
    usable = int(gpu_memory_utilization * accelerator.memory_bytes) - shape.weight_bytes
    kv_room = max(usable, 0)
    tokens_fit = kv_room // per_token  # all-global tokens (the pool's blocks)
    pool_fraction = shape.kv_pool_fraction(seq_len, block_size, cache_dtype)
    pool_per_seq = round(per_token * seq_len * pool_fraction)
    report = {
        "model": dataclasses.asdict(shape),
        "kv_cache_dtype_bytes": kv_bytes,
        "kv_bytes_per_token": per_token,
        "kv_bytes_per_block": per_token * block_size,
        "block_size": block_size,
        "seq_len": seq_len,
        "batch": batch,
        # What the pool holds per context token of a sequence at seq_len (less than the above
        # when layers have sliding windows: the hybrid allocator frees blocks out of the window,
        # docs/kv_cache.md); the per-sequence, per-batch and fit figures use it.
        "kv_pool_bytes_per_token": round(per_token * pool_fraction),
        "kv_bytes_per_sequence": pool_per_seq,
        "kv_bytes_per_batch": pool_per_seq * batch,
        # What a decode step reads per context token (windowed layers read at most their window)
        "kv_read_bytes_per_token": round(per_token * shape.kv_read_fraction(seq_len)),
        "accelerator": dataclasses.asdict(accelerator),
        "gpu_memory_utilization": gpu_memory_utilization,
        "kv_budget_bytes": usable,  # before activations, which only a compiled step can tell
        "tokens_fit": tokens_fit,
        "blocks_fit": kv_room // (per_token * block_size),
        "sequences_fit": kv_room // pool_per_seq,
        "batch_fits": kv_room >= pool_per_seq * batch,
        # The host KV tier (--kv-offload --kv-host-gib): whole blocks of prefix it holds.
        "kv_host_gib": kv_host_gib,
        "host_tokens_fit": int(kv_host_gib * (1 << 30)) // (per_token * block_size) * block_size,
    }
    # Decode step at (batch, seq_len): every active weight is a multiply-add per token, attention
    # is QK^T and PV over the context (ModelShape.attention_flops_per_context_token).
    flops = batch * (2 * shape.active_params
                     + shape.attention_flops_per_context_token() * seq_len)
    # A state-space layer reads and writes its state's pages (attention pages, the last one
    # padded) once per sequence and step.
    state_pages = 0
    if shape.state_bytes:
        spec = FixedStateSpec(shape.state_bytes,
                              page_of=FullAttentionSpec(shape.num_kv_heads, shape.head_dim))
        state_pages = (spec.state_pages(block_size, cache_dtype)
                       * spec.page_bytes(block_size, cache_dtype))
    bytes_read = (shape.weight_bytes + batch * seq_len * report["kv_read_bytes_per_token"]
                  + batch * sum(shape.state_layers) * 2 * state_pages)
    intensity = flops / bytes_read
    roofline = {"flops_per_step": flops, "bytes_per_step": bytes_read,
                "arithmetic_intensity": intensity}
    if accelerator.bandwidth and accelerator.bf16_flops:
        step_s = max(bytes_read / accelerator.bandwidth, flops / accelerator.bf16_flops)
        roofline.update(ridge_point=accelerator.ridge_point,
                        bound="memory" if intensity < accelerator.ridge_point else "compute",
                        min_step_seconds=step_s, max_tokens_per_second=batch / step_s)
    report["decode_roofline"] = roofline
    return report


def format_report(r: dict) -> str:
    m, acc, rf = r["model"], r["accelerator"], r["decode_roofline"]
    lines = [
        f"model: {m['num_layers']} layers, {m['num_kv_heads']} KV heads × head_dim {m['head_dim']} "
        f"({m['num_heads']} query heads), weights {format_bytes(m['weight_bytes'])}",
        (f"KV per token:    {r['kv_bytes_per_token']} B = {m['num_layers']} × latent "
         f"{m['mla_latent']} × {r['kv_cache_dtype_bytes']} B (MLA: one latent for all heads)"
         if m["mla_latent"] else
         f"KV per token:    {r['kv_bytes_per_token']} B = 2 × "
         f"{m['num_layers'] - sum(m['state_layers'])} × "
         f"{m['num_kv_heads']} × {m['head_dim']} × {r['kv_cache_dtype_bytes']} B"),
        f"KV per block:    {format_bytes(r['kv_bytes_per_block'])} ({r['block_size']} tokens)",
        *([f"KV held per context token at {r['seq_len']} tokens: {r['kv_pool_bytes_per_token']} "
           f"B (windowed layers keep only their window's blocks); read per decode step: "
           f"{r['kv_read_bytes_per_token']} B"]
          if r["kv_read_bytes_per_token"] != r["kv_bytes_per_token"] else []),
        f"KV per sequence: {format_bytes(r['kv_bytes_per_sequence'])} ({r['seq_len']} tokens)",
        f"KV per batch:    {format_bytes(r['kv_bytes_per_batch'])} ({r['batch']} × {r['seq_len']} tokens)",
        f"accelerator {acc['name']}: {format_bytes(acc['memory_bytes'])}; KV room "
        f"{r['gpu_memory_utilization']:g} × memory − weights = {format_bytes(r['kv_budget_bytes'])} "
        f"(activations not counted)",
        f"fits: {r['tokens_fit']} tokens = {r['blocks_fit']} blocks = {r['sequences_fit']} sequences "
        f"of {r['seq_len']} tokens; the batch of {r['batch']} "
        + ("fits" if r["batch_fits"] else "does NOT fit"),
        f"host tier (--kv-offload --kv-host-gib {r['kv_host_gib']:g}): {r['host_tokens_fit']} "
        f"tokens of prefix = {r['host_tokens_fit'] // max(r['seq_len'], 1)} sequences of "
        f"{r['seq_len']} tokens",
        f"decode step at batch {r['batch']}, context {r['seq_len']}: {rf['flops_per_step'] / 1e9:.1f} "
        f"GFLOP over {format_bytes(rf['bytes_per_step'])} read = {rf['arithmetic_intensity']:.1f} FLOP/B",
    ]
    if "ridge_point" in rf:
        lines.append(
            f"roofline: ridge point {rf['ridge_point']:.0f} FLOP/B, so decode is {rf['bound']}-bound "
            f"(each step reads all weights and all {r['batch']} KV caches to make {r['batch']} "
            f"tokens): ≥ {rf['min_step_seconds'] * 1e3:.3g} ms/step, ≤ "
            f"{rf['max_tokens_per_second']:.0f} tokens/s")
    else:
        lines.append("roofline: pass --bandwidth and --tflops (or a named accelerator) for the ridge point")
    p = r.get("engine_plan")
    if p:
        lines.append(
            f"engine (one device, as `jaxinfer serve` checks before loading): "
            f"{p['gpu_memory_utilization']:g} × {format_bytes(p['device_bytes'])} (JAX's "
            f"allocator: {p['allocator_fraction']:g} of the card) − "
            f"{format_bytes(p['weight_bytes'])} weights − "
            f"≥ {format_bytes(p['activation_floor_bytes'])} activations − "
            f"{format_bytes(p['compile_scratch_bytes'])} compile scratch = "
            f"{format_bytes(p['room_bytes'])} for the KV cache; one sequence of "
            f"{p['max_model_len']} tokens takes {format_bytes(p['sequence_kv_bytes'])}: "
            + ("fits" if p["fits"] else
               f"REFUSED (longest that fits: {p['fitting_model_len']} tokens)"))
    return "\n".join(lines)


def engine_plan(args: argparse.Namespace, accelerator: Accelerator) -> dict | None:
    """The engine's own pre-load check (engine/memory_preflight.py) for --model on the
    accelerator, one sequence of --seq-len and --batch sequences per step: weights, one sequence's
    KV, the activations' floor and the GPU compile scratch (of the most concurrent compiles, as
    on a host of 8 cores or more) against --gpu-memory-utilization of the card, which the engine
    gives JAX's allocator unless XLA_CLIENT_MEM_FRACTION set a share (planner.py). None without
    --model."""
    if not args.model:
        return None
    from jaxinfer.engine.args import EngineArgs
    from jaxinfer.engine.memory_preflight import preflight
    from jaxinfer.model.config import load_config
    from jaxinfer.model.hub import resolve_model
    from jaxinfer.model.transformer import param_shapes
    from jaxinfer.worker.bucket_compiler import MAX_COMPILE_WORKERS
    from jaxinfer.worker.kv.planner import allocator_fraction, usable_card_bytes
    cfg = load_config(resolve_model(args.model))
    cfg = dataclasses.replace(cfg, quantization=resolve_quantization(
        args.quantization, cfg.quantization, "safetensors"))
    dtype = jnp.dtype(KV_CACHE_DTYPES[args.dtype or cfg.dtype])
    fraction = allocator_fraction(unset=args.gpu_memory_utilization)  # as the engine claims it
    card = accelerator.memory_bytes
    engine_args = EngineArgs(model=args.model, max_model_len=args.seq_len,
                             max_num_seqs=args.batch, block_size=args.block_size,
                             kv_cache_dtype=args.kv_cache_dtype,
                             gpu_memory_utilization=args.gpu_memory_utilization)
    figures = preflight(cfg, engine_args, param_shapes(cfg, dtype), None, dtype,
                        device_bytes=usable_card_bytes(card, int(fraction * card),
                                                       args.gpu_memory_utilization),
                        platform="gpu",
                        workers=MAX_COMPILE_WORKERS)
    return {**figures.as_dict(), "allocator_fraction": fraction}


def run(args: argparse.Namespace) -> int:
    for flag, value in (("--seq-len", args.seq_len), ("--batch", args.batch),
                        ("--block-size", args.block_size)):
        if value < 1:
            raise ConfigError(f"{flag} must be >= 1; got {value}")
    if not 0.0 < args.gpu_memory_utilization <= 1.0:
        raise ConfigError(f"--gpu-memory-utilization must be in (0, 1]; got {args.gpu_memory_utilization}")
    shape = _shape_from_args(args)
    if shape.max_position_embeddings and args.seq_len > shape.max_position_embeddings:
        print(f"warning: --seq-len {args.seq_len} is longer than the model's context "
              f"({shape.max_position_embeddings} tokens, max_position_embeddings): the engine "
              f"would not serve such sequences", file=sys.stderr)
    accelerator = parse_accelerator(args.accelerator_memory, args.bandwidth, args.tflops)
    report = memory_report(shape, kv_dtype=args.kv_cache_dtype, seq_len=args.seq_len,
                           batch=args.batch, block_size=args.block_size, accelerator=accelerator,
                           gpu_memory_utilization=args.gpu_memory_utilization,
                           kv_host_gib=args.kv_host_gib)
    plan = engine_plan(args, accelerator)
    if plan is not None:
        report["engine_plan"] = plan
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "memory", help="size the KV cache and the decode roofline for a model and accelerator",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=__doc__.split("\n", 1)[1].strip() + "\n\nExamples:\n"
        "  jaxinfer memory --model ./Llama-3.1-8B --accelerator h200 --seq-len 8192 --batch 64\n"
        "  jaxinfer memory --layers 32 --kv-heads 8 --head-dim 128 --weight-bytes 16.06GB --json\n"
        "  jaxinfer memory --layers 27 --kv-lora-rank 512 --heads 16 --weight-bytes 31.4GB  "
        "# DeepSeek-V2-Lite")
    src = p.add_argument_group("model (a directory, or its shape as flags)")
    src.add_argument("--model", metavar="DIR",
                     help="model directory with a config.json, or a cached hub id (default: the "
                          "bundled demo model, unless the shape flags below are given)")
    src.add_argument("--layers", type=int, help="number of transformer layers")
    src.add_argument("--kv-heads", type=int, help="number of key/value heads")
    src.add_argument("--head-dim", type=int, help="dimension of one attention head")
    src.add_argument("--heads", type=int, help="query heads, for attention FLOPs (default: --kv-heads)")
    src.add_argument("--kv-lora-rank", type=int,
                     help="multi-head latent attention (DeepSeek): the latent's rank, e.g. 512; "
                          "the cache then holds one kv_lora_rank + --qk-rope-dim entry per token "
                          "and layer (--kv-heads/--head-dim not needed)")
    src.add_argument("--qk-rope-dim", type=int, default=64,
                     help="MLA's decoupled RoPE key width (default 64)")
    src.add_argument("--weight-bytes", metavar="SIZE",
                     help="weight bytes, e.g. 16.06GB (default: parameters × --dtype bytes with "
                          "--model, else 0)")
    src.add_argument("--dtype", choices=list(KV_CACHE_DTYPES),
                     help="weight dtype (default: the model's, else bfloat16)")
    src.add_argument("--quantization", choices=QUANTIZATIONS,
                     help="weight quantization: 8-bit linear layers plus per-channel scales "
                          "(default: the checkpoint's quantization_config)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", *KV_CACHE_DTYPES],
                   help="KV-cache element type (default: --dtype)")
    p.add_argument("--seq-len", type=int, default=4096, help="tokens per sequence (default 4096)")
    p.add_argument("--batch", type=int, default=32, help="concurrent sequences (default 32)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default 16)")
    p.add_argument("--accelerator", "--accelerator-memory", dest="accelerator_memory",
                   default="h200", metavar="NAME|GIB",
                   help=f"device memory in GiB, or one of {', '.join(ACCELERATORS)} (datasheet "
                        f"memory, bandwidth and dense bf16 FLOP/s); default h200")
    p.add_argument("--bandwidth", type=float, metavar="TB/S", help="memory bandwidth override, TB/s")
    p.add_argument("--tflops", type=float, help="dense bf16 TFLOP/s override")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="fraction of device memory for weights + KV (default 0.9)")
    p.add_argument("--kv-host-gib", type=float, default=16.0,
                   help="host memory of the host KV tier, for its row (default 16)")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    p.set_defaults(func=run)
    return p
