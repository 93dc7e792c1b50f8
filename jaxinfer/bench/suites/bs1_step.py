"""One batch-1 decode step of the Llama-3-8B shape (forward + greedy argmax, KV cache donated), in
variants inside one process (weight layout, FP8 weights, decode rows, K/V write, norm,
attention-kernel configuration, XLA compile options), each timed on the device and traced per
kernel, all against the same weights (or their FP8 twin) and cache; then, with `--engine`, the
engine itself at batch 1 (`--engine-quantization fp8`: with FP8 weights).

    PYTHONUNBUFFERED=1 jaxinfer bench latency --suite bs1-step -- --save [DIR]
        [--ctx 768] [--max-blocks 128] [--variants old_s8,fused,...] [--deadline-s 55] [--engine]
    JAX_PLATFORMS=cpu jaxinfer bench latency --suite bs1-step -- --tiny   # CPU check

The step is what the engine runs per decode token at batch 1 (`forward` over the decode rows, one
real sequence with `--ctx` tokens of context, a block table `--max-blocks` wide as the engine
passes it for `--max-model-len 2048`), without the host: the next step's token is this step's
argmax, on the device. `step_ms`: the best of 3 runs of `--steps` queued steps (the host only
dispatches; `dispatch_ms`: the host time of one dispatch, the least a step can take when the host
is the critical path). For the first `--traced` variants a trace of 5 steps
(profile/trace_engine_step.summarize_steps): busy time, kernels per step, the top kernels; for the
first two also one layer's kernels in launch order (duration, gap before). Each variant's
`read_gb` (its weights but the embedding, and the sequence's K/V), `tb_s` (that over `step_ms`)
and `of_ceiling` (over `read_ceiling_tbs`, an XLA sum over 8 GiB measured first), and
`weight_reads`: profile/hlo_weight_reads.py's verdict on its optimized HLO (whether FP8 weights reach
their matmuls directly or through a bf16 copy). `--hlo-out`: `--hlo-variant`'s optimized HLO
(default the first fp8 variant), gzipped. Before the variants the kernel table's add + RMSNorm kernel
is checked against its reference on this device (`norm_kernel_max_abs_diff`). The deadline skips
variants that would not finish; results are saved after every variant (record bs1_step_<gpu>).
`--engine`: `engine_bs1` (record engine_llama8b_bs1_<gpu>, with FP8 engine_llama8b_bs1_fp8w_<gpu>),
with `bs1_host_probe`: whether the host is the critical path of its steady steps, and why.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gzip
import re
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.bench import results_io
from jaxinfer.bench.presets import LLAMA3_8B
from jaxinfer.worker.kv.device_cache import allocate_kv_cache
from jaxinfer.model.config import config_from_dict
from jaxinfer.model.fused_projections import fuse_projections
from jaxinfer.model.transformer import forward, init_params
from jaxinfer.model.weights import load_params
from jaxinfer.model.kernel_table import REFERENCE_KERNELS, KernelTable
from pallas_kernels.attention.backend import AttentionBackend
from pallas_kernels.attention.metadata import AttentionMetadata
from pallas_kernels.attention.reference import scatter_kv
from pallas_kernels.norm.reference import add_rms_norm_reference
from jaxinfer.bench.profile.trace_decode import device_events
from jaxinfer.bench.profile.trace_engine_step import summarize_steps
from jaxinfer.paths import REPO_ROOT


BLOCK = 16
# name -> what the variant changes in the step (every key optional):
#   seqs     decode rows (default 1): one real sequence and seqs - 1 padding rows, as an engine
#            whose smallest decode bucket is seqs runs batch 1;
#   fused    the weights with q/k/v and gate/up fused (jaxinfer/model/fused_projections.py);
#   write    "scatter": the new token's K/V written with `scatter_kv` (else `write_kv`);
#   kernel   MosaicDecodeConfig keyword arguments for the decode kernel;
#   norm     "xla": the residual add + RMSNorm as XLA emits it (else the backend's kernel);
#   width    the block table's first `width` columns only;
#   options  XLA compile options;
#   quant    the same weights quantized on load as `--quantization` does ("fp8": e4m3 + channel
#            scales; fused with `fused`, as the engine serves them on one GPU);
#   impl     the model's quant_impl (`--quant-impl`): "fp8" W8A8 (per-token e4m3 activations,
#            FP8 x FP8 scaled gemm) or "dequant" weight-only (what the engine picks below
#            FP8_GEMM_MIN_ROWS rows, so at batch 1).
EXHAUSTIVE = "xla_gpu_exhaustive_tiling_search"
VARIANTS: dict[str, dict] = {
    "base": {},
    "fused": dict(fused=True),
    "fused_xlanorm": dict(fused=True, norm="xla"),
    "scatter": dict(write="scatter"),
    "old_s8": dict(seqs=8, write="scatter", norm="xla"),
    "fused_s8": dict(seqs=8, fused=True),
    "base_s8": dict(seqs=8),
    "heroless": dict(options={"xla_gpu_experimental_enable_triton_heroless_priority_fusion": True}),
    "fused_heroless": dict(fused=True, options={
        "xla_gpu_experimental_enable_triton_heroless_priority_fusion": True}),
    "splits1": dict(kernel=dict(num_splits=1)),
    "splits4": dict(kernel=dict(num_splits=4)),
    "splits8": dict(kernel=dict(num_splits=8)),
    "tps128": dict(kernel=dict(tokens_per_step=128)),
    "stages2": dict(kernel=dict(stages=2)),
    "narrow48": dict(width=48),
    "pdl": dict(options={"xla_gpu_enable_pdl": True}),
    "nopdl": dict(options={"xla_gpu_enable_pdl": False}),
    "cublas": dict(options={"xla_gpu_enable_triton_gemm": False}),
    "cmdbuf": dict(options={"xla_gpu_enable_command_buffer": "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL"}),
    "fp8w": dict(fused=True, quant="fp8"),  # the engine's FP8 decode step as it is
    "fp8w_unfused": dict(quant="fp8"),
    "fp8w_w8a8": dict(fused=True, quant="fp8", impl="fp8"),
    # Whether XLA's command buffers (CUDA graphs) take the step's kernels: `dispatch_ms` is the
    # host's launch of ~455-710 kernels without them.
    "fp8w_cmdbuf": dict(fused=True, quant="fp8", options={
        "xla_gpu_enable_command_buffer": "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL"}),
    "fp8w_graph1": dict(fused=True, quant="fp8", options={"xla_gpu_graph_min_graph_size": 1}),
    # The Triton gemm autotuner's whole search space (run each in a process of its own:
    # XLA's in-process autotuning cache does not key on these options).
    "fused_exh": dict(fused=True, options={EXHAUSTIVE: True}),
    "fused_cublas": dict(fused=True, options={"xla_gpu_enable_triton_gemm": False}),
    "fp8w_exh": dict(fused=True, quant="fp8", options={EXHAUSTIVE: True}),
}
TINY = dict(LLAMA3_8B, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=512)


def kernels_for(variant: dict, default: KernelTable) -> KernelTable:
    """The kernel table of `variant`: `default` with its attention, norm, KV write and quantized
    matmul implementation replaced where the variant names them."""
    kernels = dataclasses.replace(default, quantized_matmul=dataclasses.replace(
        default.quantized_matmul, impl=variant.get("impl", "auto")))
    attention = kernels.attention
    if "kernel" in variant:
        from pallas_kernels.attention.flash_prefill import flash_prefill_mosaic
        from pallas_kernels.attention.paged_decode import MosaicDecodeConfig, paged_decode_mosaic
        config = MosaicDecodeConfig(**variant["kernel"])
        attention = AttentionBackend(f"mosaic{config}", split_mixed_steps=True,
                                     decode=functools.partial(paged_decode_mosaic, config=config),
                                     prefill=flash_prefill_mosaic)
    if variant.get("norm") == "xla":
        kernels = dataclasses.replace(kernels, add_rms_norm=add_rms_norm_reference)
    if variant.get("write") == "scatter":
        attention = dataclasses.replace(attention, name=attention.name + "+scatter",
                                        write_kv=scatter_kv)
    return dataclasses.replace(kernels, attention=attention)


def decode_inputs(ctx: int, max_blocks: int, num_blocks: int, seqs: int = 1):
    """(token ids, positions, metadata) of one decode token at position ctx - 1 of one sequence
    whose pages are distinct random blocks, and seqs - 1 padding rows (length 0, slot -1)."""
    pages = -(-ctx // BLOCK)
    blocks = np.random.default_rng(0).permutation(num_blocks)[:pages]
    table = np.zeros((seqs, max_blocks), np.int32)
    table[0, :pages] = blocks
    pos = ctx - 1
    slots = np.full(seqs, -1, np.int32)
    slots[0] = blocks[pos // BLOCK] * BLOCK + pos % BLOCK
    lens = np.zeros(seqs, np.int32)
    lens[0] = ctx
    md = AttentionMetadata(
        slot_mapping=jnp.asarray(slots), query_start_loc=jnp.asarray(
            np.minimum(np.arange(seqs + 1), 1), jnp.int32), seq_lens=jnp.asarray(lens),
        block_tables=jnp.asarray(table), num_decodes=seqs)
    return (jnp.full((seqs,), 7, jnp.int32), jnp.asarray(np.where(lens > 0, pos, 0), jnp.int32),
            md)


def make_step(cfg, kernels, table_width: int | None = None):
    def step(params, kv, ids, pos, md):
        if table_width:
            md = dataclasses.replace(md, block_tables=md.block_tables[:, :table_width])
        logits, kv = forward(params, cfg, ids, pos, kv, md, kernels)
        return jnp.argmax(logits, axis=-1).astype(jnp.int32), kv
    return jax.jit(step, donate_argnums=(1,))


def run_steps(exe, state, n: int, dispatch: list | None = None):
    """`n` queued steps, waited for; `dispatch` gets the host seconds the n dispatches took."""
    params, kv, ids, pos, md = state
    t0 = time.perf_counter()
    for _ in range(n):
        ids, kv = exe(params, kv, ids, pos, md)
    if dispatch is not None:
        dispatch.append(time.perf_counter() - t0)
    jax.block_until_ready(ids)
    return (params, kv, ids, pos, md)


def one_layer(events, per_step: int, anchor: str = "paged_decode") -> list:
    """One layer's kernels in launch order, [name, µs, gap before µs], from the middle step:
    from the kernel before its second attention call to the one before its third."""
    step = events[2 * per_step:3 * per_step] if len(events) >= 3 * per_step else events
    at = [i for i, e in enumerate(step) if anchor in e[0]]
    if len(at) < 3:
        return []
    lo, hi = at[1] - 4, at[2] - 4
    return [[step[i][0][:50], round((step[i][2] - step[i][1]) / 1e3, 2),
             round((step[i][1] - step[i - 1][2]) / 1e3, 2)] for i in range(max(lo, 1), hi)]


def engine_bs1(tiny: bool, out_len: int, save, norm: str = "kernel",
               quantization: str | None = None, decode_steps: int = 1) -> dict:
    """The engine at batch 1 (bench_engine_llama8b's `bs1`: one 512-token prompt, `out_len`
    greedy tokens, best of 2 runs after a first request compiled its steps), its decode step traced
    (profile/trace_engine_step), and the HBM roofline measured here. `norm` "xla": the GPU backends'
    residual add + RMSNorm as XLA emits it instead of their kernel (for attribution).
    `quantization`: the engine's --quantization (the dummy weights quantized on load);
    `bs1_read_gb` / `bs1_tb_s`: the bytes a step reads (step_bytes at the mean context) and the
    rate the TPOT implies; `bs1_host_probe`: profile/engine_host_probe over 32 steady steps (host
    phases per step, dispatch cost, compiles, Python-path jit calls, implicit transfers).
    `decode_steps`: the engine's --decode-steps-per-call (an on-device loop of that many decode
    steps per dispatch: hides a host that is slower than the step)."""
    metrics: dict = {"norm": norm, "quantization": quantization, "decode_steps_per_call": decode_steps}
    import json
    from jaxinfer.bench.suites.llama8b import bs1, measure_rooflines, roofline_figures
    from jaxinfer.engine.args import EngineArgs
    from jaxinfer.engine.llm_engine import LLMEngine
    from jaxinfer.bench.profile.engine_host_probe import probe_host
    from jaxinfer.bench.profile.trace_engine_step import profile_decode_steps
    if norm == "xla":  # the engine's kernel table with the jnp norm (no flag picks it: patched)
        from jaxinfer.engine import kernels, kv_blocks, llm_engine
        with_xla_norm = lambda config: dataclasses.replace(  # noqa: E731
            kernels.engine_kernels(config), add_rms_norm=add_rms_norm_reference)
        llm_engine.engine_kernels = kv_blocks.engine_kernels = with_xla_norm
    with tempfile.TemporaryDirectory() as work:
        if tiny:
            opts = dict(model=str(REPO_ROOT / "checkpoints" / "demo-target"), dtype="float32",
                        max_model_len=256, max_num_batched_tokens=256, max_num_seqs=4,
                        quantization=quantization)
            prompt_len = 32
        else:
            (Path(work) / "config.json").write_text(json.dumps(LLAMA3_8B))
            opts = dict(model=work, load_format="dummy", dtype="bfloat16",
                        attention_backend="mosaic", max_model_len=2048,
                        max_num_batched_tokens=2048, max_num_seqs=256, quantization=quantization)
            prompt_len = 512
        t0 = time.perf_counter()
        # No warm-up: the first call compiles the two step shapes batch 1 uses, and no background
        # compile shares the host with the timed runs.
        engine = LLMEngine.from_engine_args(EngineArgs(
            **opts, num_blocks=2048, compilation_cache_dir="", warmup=False,
            decode_steps_per_call=decode_steps))
        rng = np.random.default_rng(0)

        def prompt():
            return rng.integers(3, engine.cfg.vocab_size, prompt_len).tolist()
        bs1(engine, prompt(), 8)
        metrics["engine_ready_s"] = round(time.perf_counter() - t0, 1)
        runs = [bs1(engine, prompt(), out_len) for _ in range(2)]
        best = min(runs, key=lambda r: r["tpot_ms"])
        metrics.update(bs1_tpot_ms=best["tpot_ms"], bs1_out_tok_s=best["out_tok_s"],
                       bs1_tpot_runs_ms=[r["tpot_ms"] for r in runs])
        read = step_bytes(engine.runner.params, engine.cfg, engine.runner.kv_cache,
                          prompt_len + out_len // 2)
        metrics.update(bs1_read_gb=round(read / 1e9, 3),
                       bs1_tb_s=round(read / (best["tpot_ms"] * 1e-3) / 1e12, 3))
        # Whether the host is the critical path of a steady step, and why (issue 26).
        try:
            metrics["bs1_host_probe"] = probe_host(engine, [prompt()], steps=32)
        except Exception as e:  # a diagnostic: the figures above stand without it
            metrics["bs1_host_probe_error"] = repr(e)[:400]
        save(metrics)
        if not tiny:
            try:
                metrics["bs1_profile"] = profile_decode_steps(engine, [prompt()])
            except Exception as e:  # a diagnostic, as the probe above
                metrics["bs1_profile_error"] = repr(e)[:400]
            params_bytes = sum(a.nbytes for a in jax.tree.leaves(engine.runner.params))
            figs = roofline_figures(measure_rooflines(params_bytes), engine.cfg, prompt_len,
                                    out_len, 256)
            metrics.update({k: v for k, v in figs.items() if "c256" not in k})
            metrics["bs1_of_ceiling"] = round(metrics["bs1_tb_s"] / figs["roofline_hbm_tb_s"], 3)
        save(metrics)
    return metrics


def step_bytes(params, cfg, kv, ctx: int) -> int:
    """What a batch-1 decode step has to read: every weight but the embedding table (it gathers
    one row) and the sequence's K and V."""
    kv_token = sum(2 * cfg.num_kv_heads * cfg.head_dim * k.dtype.itemsize for k, _ in kv)
    return (sum(a.nbytes for a in jax.tree.leaves(params)) - params["embed"]["embedding"].nbytes
            + ctx * kv_token)


class Weights:
    """The variants' weight trees, each made once: bf16 (seed 0), its FP8 twin quantized as
    `--quantization fp8 --load-format dummy` loads it, and either fused."""

    def __init__(self, cfg):
        self.cfg, self.trees = cfg, {}

    def get(self, quant: str | None, fused: bool):
        key = (quant, fused)
        if key not in self.trees:
            if fused:
                self.trees[key] = fuse_projections(self.get(quant, False))
            elif quant:
                self.trees[key] = load_params(None, dataclasses.replace(
                    self.cfg, quantization=quant), jnp.bfloat16, "dummy", seed=0)
            else:
                self.trees[key] = init_params(self.cfg, jax.random.key(0))
        return self.trees[key]


def compile_variant(variant: dict, cfg, kernels, state):
    """The variant's step compiled (`cfg` carries its `impl`)."""
    return make_step(cfg, kernels, variant.get("width")).lower(*state).compile(
        compiler_options=variant.get("options"))


def weight_reads(hlo: str, min_bytes: int) -> dict:
    """profile/hlo_weight_reads' summary of the step: whether 8-bit weights reach their matmuls
    directly or through a wider copy, and the ops that read them."""
    from jaxinfer.bench.profile.hlo_weight_reads import report
    s = report(hlo, min_bytes)["summary"]
    return dict(verdict=s["verdict"], readers=s["readers"],
                bytes_moved_gb=round(s["bytes_moved_estimate"] / 1e9, 3))


def run_variants(args, names: list[str], start: float, save) -> None:
    """Every variant in `names` against one set of weights (or its FP8 twin) and one cache;
    `save(metrics)` after each; a table last."""
    from jaxinfer.bench.kernel_decode import read_ceiling_tbps
    cfg = config_from_dict(TINY if args.tiny else LLAMA3_8B)
    if args.tiny:
        default = REFERENCE_KERNELS
    else:
        from jaxinfer.model.kernel_table import current_platform, resolve_kernels
        default = resolve_kernels(current_platform(), attention="mosaic")
    weights = Weights(cfg)
    params = weights.get(None, False)
    kv = allocate_kv_cache(cfg, args.num_blocks, BLOCK)
    hlo_variant = args.hlo_variant or next((n for n in names if n.startswith("fp8")), names[0])
    ceiling = read_ceiling_tbps(64 << 20 if args.tiny else 8 << 30)
    norm_check = {}
    for rows in (1, 8):  # the norm kernel on this device against its reference
        x = jax.random.normal(jax.random.key(rows), (rows, cfg.hidden_size), jnp.bfloat16)
        w = params["final_norm"]["weight"]
        pairs = zip(default.add_rms_norm(x, x * 0.5, w, eps=cfg.rms_norm_eps),
                    add_rms_norm_reference(x, x * 0.5, w, eps=cfg.rms_norm_eps))
        norm_check[f"rows{rows}"] = [float(jnp.abs(a.astype(jnp.float32) - b).max())
                                     for a, b in pairs]
    metrics: dict = {"setup_s": round(time.perf_counter() - start, 1),
                     "read_ceiling_tbs": round(ceiling, 3), "norm_kernel_max_abs_diff": norm_check}
    print(metrics, flush=True)
    rows = []
    for i, name in enumerate(names):
        variant = VARIANTS[name]
        if time.perf_counter() - start > args.deadline_s - 8:
            metrics[f"{name}_skipped"] = "deadline"
            continue
        try:
            t0 = time.perf_counter()
            inputs = decode_inputs(args.ctx, args.max_blocks, args.num_blocks,
                                   variant.get("seqs", 1))
            vcfg = dataclasses.replace(cfg, quantization=variant.get("quant"))
            tree = weights.get(variant.get("quant"), bool(variant.get("fused")))
            nbytes = step_bytes(tree, cfg, kv, args.ctx)
            state = (tree, kv, *inputs)
            exe = compile_variant(variant, vcfg, kernels_for(variant, default), state)
            compile_s = time.perf_counter() - t0
            state = run_steps(exe, state, 5)
            times, dispatch = [], []
            for _ in range(3):
                t1 = time.perf_counter()
                state = run_steps(exe, state, args.steps, dispatch)
                times.append((time.perf_counter() - t1) / args.steps * 1e3)
            tbs = nbytes / (min(times) * 1e-3) / 1e12
            entry = dict(step_ms=round(min(times), 4), compile_s=round(compile_s, 1),
                         dispatch_ms=round(min(dispatch) / args.steps * 1e3, 4),
                         read_gb=round(nbytes / 1e9, 3), tb_s=round(tbs, 3),
                         of_ceiling=round(tbs / ceiling, 3))
            hlo = exe.as_text()
            # Kernel sequences XLA outlined into command buffers (CUDA graphs), and their calls.
            entry["command_buffers"] = [
                len(re.findall(r"^%?command_buffer[\w.\-]* ", hlo, re.M)),
                len(re.findall(r"to_apply=%?command_buffer", hlo))]
            if name == hlo_variant and args.hlo_out:
                Path(args.hlo_out).parent.mkdir(parents=True, exist_ok=True)
                with gzip.open(args.hlo_out, "wt") as f:
                    f.write(hlo)
            try:
                entry["weight_reads"] = weight_reads(hlo, 16 << 10 if args.tiny else 1 << 20)
            except Exception as e:  # a diagnostic: the timing stands without it
                entry["weight_reads_error"] = repr(e)[:200]
            if (not args.tiny and i < args.traced
                    and time.perf_counter() - start < args.deadline_s - 6):
                with tempfile.TemporaryDirectory() as d:
                    jax.profiler.start_trace(d)
                    state = run_steps(exe, state, 5)
                    jax.profiler.stop_trace()
                    events = device_events(d)
                entry["trace"] = summarize_steps(events, 5, top=12)
                if i < 2:
                    entry["one_layer"] = one_layer(events, len(events) // 5)
            metrics[name] = entry
            rows.append((name, entry["step_ms"], entry["tb_s"],
                         entry.get("trace", {}).get("busy_us_per_step"),
                         entry.get("trace", {}).get("kernels_per_step"), entry["compile_s"],
                         entry["dispatch_ms"]))
            print(name, entry, flush=True)
            kv = state[1]
        except Exception as e:  # one variant failing must not lose the others
            metrics[f"{name}_error"] = repr(e)[:400]
            print(name, "error", repr(e)[:400], flush=True)
            if kv[0][0].is_deleted():  # donated to a step that failed
                kv = allocate_kv_cache(cfg, args.num_blocks, BLOCK)
        state = None
        save(metrics)
    print(f"{'variant':12} {'step_ms':>8} {'TB/s':>6} {'busy_us':>8} {'kernels':>8} "
          f"{'compile_s':>9} {'dispatch_ms':>11}   (read ceiling {ceiling:.3f} TB/s)")
    for r in rows:
        print(f"{r[0]:12} {r[1]:8.3f} {r[2]:6.3f} {str(r[3]):>8} {str(r[4]):>8} {r[5]:9.1f} {r[6]:11.3f}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="a 2-layer model, reference attention")
    ap.add_argument("--ctx", type=int, default=768)
    ap.add_argument("--max-blocks", type=int, default=128)
    ap.add_argument("--num-blocks", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--variants", default=",".join(VARIANTS), help="'' for none")
    ap.add_argument("--deadline-s", type=float, default=55.0, help="for the variants")
    ap.add_argument("--hlo-out", default=None,
                    help="write --hlo-variant's optimized HLO here (gzipped text; read it with "
                         "jaxinfer/bench/profile/hlo_weight_reads.py)")
    ap.add_argument("--hlo-variant", default=None,
                    help="the variant --hlo-out writes (default: the first fp8 one, else the first)")
    ap.add_argument("--traced", type=int, default=3, help="trace the first N variants")
    ap.add_argument("--engine", action="store_true",
                    help="then the engine at batch 1 (record engine_llama8b_bs1_<gpu>)")
    ap.add_argument("--out-len", type=int, default=256, help="the engine run's output tokens")
    ap.add_argument("--engine-norm", choices=("kernel", "xla"), default="kernel",
                    help="the engine's residual add + RMSNorm: the backend's kernel, or XLA's")
    ap.add_argument("--engine-quantization", choices=("fp8", "int8"), default=None,
                    help="the engine's --quantization (record engine_llama8b_bs1_<q>w_<gpu>)")
    ap.add_argument("--engine-decode-steps", type=int, default=1,
                    help="the engine's --decode-steps-per-call (record name ends _loop<N>)")
    results_io.add_save_arg(ap, "bs1_step_<gpu>")
    args = ap.parse_args(argv)
    start = time.perf_counter()
    model = "tiny" if args.tiny else "Llama-3-8B shape, random bf16"
    names = [n for n in args.variants.split(",") if n]
    if names:
        config = dict(model=model, ctx=args.ctx, max_blocks=args.max_blocks, steps=args.steps,
                      variants={n: VARIANTS[n] for n in names})
        run_variants(args, names, start, lambda m: args.save and results_io.save(
            args.save, args.name or f"bs1_step_{results_io.device_slug()}", config=config,
            metrics=m))
    if args.engine:
        q = args.engine_quantization
        econfig = dict(model=model, engine="max_num_seqs 256, max_num_batched_tokens 2048, "
                       "max_model_len 2048, num_blocks 2048, mosaic, no warm-up",
                       out_len=args.out_len, quantization=q)
        loop = f"loop{args.engine_decode_steps}_" if args.engine_decode_steps > 1 else ""
        record = f"engine_llama8b_bs1_{q + 'w_' if q else ''}{loop}{results_io.device_slug()}"
        out = engine_bs1(args.tiny, args.out_len, lambda m: args.save and results_io.save(
            args.save, record, config=econfig, metrics=m), args.engine_norm, q,
            args.engine_decode_steps)
        print({k: v for k, v in out.items() if k != "bs1_profile"}, flush=True)


if __name__ == "__main__":
    main()
