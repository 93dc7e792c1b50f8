"""The grouped-matmul kernel with e4m3 expert stacks (`--quantization fp8`): CPU tests.

  - The warp-specialised kernel with e4m3 weights and channel scales runs in Mosaic GPU's
    interpreter against the float32 reference on the dequantized weights, on ragged group sizes
    (empty groups, one hot group, rows past the groups), both consumer splits, SwiGLU (one stack:
    `moe_experts`' down projection), and with one ring across a CTA's units;
  - it lowers for CUDA (the e4m3 -> float16 widening, the 64-byte-swizzled e4m3 panels, the scale
    loads) at Qwen3-30B-A3B's prefill shape with the tilings `moe_experts` picks (decode:
    tests/test_kernel_ir.py);
  - `moe_experts(impl="mosaic", scales=)` matches the XLA paths, and a tiny Qwen3-MoE with FP8
    weights runs the implementation its config names (`--moe-impl`);
  - the dispatch gives e4m3 stacks the kernel unless `--moe-impl xla`.
Speed is the H200's: `jaxinfer bench throughput --suite moe -- --fp8`.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.model.config import config_from_dict
from jaxinfer.model.quant.ops import FP8, dequantize, quantize
from pallas_kernels.moe import grouped_matmul as gm
from pallas_kernels.moe.grouped_matmul_ws import WsConfig, grouped_matmul_ws
from pallas_kernels.common.testing import ragged_group_sizes


def _rel(out, ref) -> float:
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def _stack(rng, shape):
    """An e4m3 stack [G, K, N] with channel scales [G, N] (the loader's quantization)."""
    w = jnp.asarray(rng.standard_normal(shape) * shape[1] ** -0.5, jnp.float32)
    return quantize(w, "fp8", axis=-2)


# The e4m3 path of each consumer split (N: each consumer widens its half of the panel; M), CTAs
# with several units, SwiGLU; one stack through `moe_experts`' down projection in the model test
# below.
CASES = [  # rows, K, N, groups, rows to split, kind, config, fused
    (203, 128, 128, 6, 190, "random", WsConfig(64, 128, 32, 3, "n", num_ctas=2), True),
    (136, 128, 128, 4, 133, "hot", WsConfig(128, 128, 64, 2, "m", num_ctas=3), True),
    (200, 256, 256, 5, 197, "random", WsConfig(64, 256, 32, 4, "n", num_ctas=3), True),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}x{c[1]}x{c[2]}g{c[3]}{c[5]}"
                         f"-{c[6].split}"
                         f"{'-swiglu' if c[7] else ''}")
def test_fp8_kernel_interpreted_matches_dequantized_reference(case):
    rows, k, n, groups, split, kind, config, fused = case
    rng = np.random.default_rng(rows + n)
    sizes = jnp.asarray(ragged_group_sizes(rng, groups, split, kind), jnp.int32)
    used = int(sizes.sum())
    x = jnp.asarray(rng.standard_normal((rows, k)), jnp.float16)
    stacks = [_stack(rng, (groups, k, n)) for _ in range(2 if fused else 1)]
    out = grouped_matmul_ws(x, tuple(q for q, _ in stacks), sizes, config=config, interpret=True,
                            scales=tuple(s for _, s in stacks), out_dtype=jnp.bfloat16)
    deq = [dequantize(q, s, axis=-2) for q, s in stacks]
    ref = gm.gmm_reference(x, deq, sizes)
    assert out.shape == (rows, n) and out.dtype == jnp.bfloat16
    # float16 x and exact e4m3 -> float16 weights: only the bf16 output rounding is left.
    assert _rel(out[:used], ref[:used]) < 5e-3


def test_fp8_kernel_checks_its_inputs():
    rng = np.random.default_rng(0)
    q, s = _stack(rng, (4, 128, 128))
    sizes = jnp.asarray([64, 0, 0, 0], jnp.int32)
    x = jnp.zeros((64, 128), jnp.float16)
    cfg = WsConfig(64, 128, 64, 2, "n")
    with pytest.raises(ValueError, match="float16"):
        grouped_matmul_ws(x.astype(jnp.bfloat16), (q,), sizes, config=cfg, scales=(s,))
    with pytest.raises(ValueError, match="scales"):
        grouped_matmul_ws(x, (q,), sizes, config=cfg, scales=(s[:, :64],))
    with pytest.raises(ValueError, match="weights"):
        grouped_matmul_ws(x, (q.astype(jnp.int8),), sizes, config=cfg, scales=(s,))
    with pytest.raises(ValueError, match="8-bit weight"):
        WsConfig(128, 128, 64, 5, "m").check(2, weight_itemsize=1)
    # Half the ring bytes: a ring 6 deep fits beside the staging tiles where bf16's does not.
    WsConfig(64, 128, 64, 6, "n").check(2, weight_itemsize=1)
    with pytest.raises(ValueError, match="shared memory"):
        WsConfig(64, 128, 64, 6, "n").check(2)
    with pytest.raises(ValueError, match="e4m3"):
        gm.moe_experts(x, (q.astype(jnp.int8),) * 3, sizes, impl="mosaic", scales=(s,) * 3)


def _lower_for_cuda(fn, *avals):
    return jax.jit(fn).trace(*avals).lower(lowering_platforms=("cuda",)).as_text()


# Decode rows' tilings at this shape: tests/test_kernel_ir.py (the lowered module's digest).
@pytest.mark.parametrize("tokens", [2048], ids=["qwen3-prefill"])
def test_fp8_kernel_lowers_for_cuda(tokens):
    experts, h, f, top_k = 128, 2048, 768, 8
    s = jax.ShapeDtypeStruct
    weights = (s((experts, h, f), FP8),) * 2 + (s((experts, f, h), FP8),)
    scales = (s((experts, f), jnp.float32),) * 2 + (s((experts, h), jnp.float32),)

    def layers(x, ws, ss, sizes):  # two layers: each kernel lowers once
        for _ in range(2):
            x = gm.moe_experts(x, ws, sizes, max_group_size=tokens, impl="mosaic", scales=ss)
        return x

    text = _lower_for_cuda(layers, s((tokens * top_k, h), jnp.bfloat16), weights, scales,
                           s((experts,), jnp.int32))
    assert text.count("stablehlo.custom_call @mosaic_gpu") == 2


def test_moe_experts_fp8_kernel_matches_xla_paths():
    rng = np.random.default_rng(5)
    tokens, top_k, groups, h, f = 24, 2, 8, 128, 128
    rows = tokens * top_k
    sizes = jnp.asarray(ragged_group_sizes(rng, groups, rows - 5, "random"), jnp.int32)
    used = int(sizes.sum())
    x = jnp.asarray(rng.standard_normal((rows, h)), jnp.bfloat16)
    stacks = [_stack(rng, s) for s in [(groups, h, f), (groups, h, f), (groups, f, h)]]
    ws, scales = tuple(q for q, _ in stacks), tuple(s for _, s in stacks)
    ref = gm.moe_experts_reference(x, tuple(dequantize(q, s, axis=-2) for q, s in stacks), sizes)
    outs = {impl: gm.moe_experts(x, ws, sizes, max_group_size=tokens, impl=impl, scales=scales,
                                 interpret=impl == "mosaic") for impl in gm.IMPLS}
    assert outs["mosaic"].dtype == jnp.bfloat16
    for impl, out in outs.items():
        assert _rel(out[:used], ref[:used]) < 1e-2, impl
    assert _rel(outs["mosaic"][:used], outs["ragged"][:used]) < 1e-2


def test_fp8_dispatch_takes_the_kernel_unless_configured_off(monkeypatch):
    shape = (128, 2048, 768)
    assert gm.choose_impl(512, shape, 64, jnp.bfloat16, FP8) == "ragged"  # CPU
    assert gm.mosaic_supports(2048, 768, jnp.bfloat16, FP8)
    assert not gm.mosaic_supports(2048, 768, jnp.bfloat16, jnp.int8)
    assert not gm.mosaic_supports(2048, 192, jnp.bfloat16, FP8)  # 768 / TP 4: no 128 blocks
    # On a Hopper GPU: bf16 and e4m3 stacks take the kernel; --moe-impl xla keeps them off it.
    gpu = type("Dev", (), {"platform": "gpu", "compute_capability": "9.0"})()
    monkeypatch.setattr(jax, "devices", lambda *a: [gpu])
    monkeypatch.setattr(gm, "_hopper", lambda: True)
    assert gm.choose_impl(512, shape, 64, jnp.bfloat16) == "mosaic"
    assert gm.choose_impl(512, shape, 64, jnp.bfloat16, FP8) == "mosaic"
    assert gm.choose_impl(512, shape, 64, jnp.bfloat16, FP8, impl="xla") == "padded"
    assert gm.choose_impl(512, shape, 64, jnp.bfloat16, impl="xla") == "padded"
    assert gm.choose_impl(512, shape, 64, jnp.bfloat16, jnp.int8) == "padded"


# ---------------------------------------------------------------------------------- the model
def _tiny_qwen3_moe_fp8():
    """One MoE layer at the kernel's sizes (hidden and expert intermediate 128), FP8 weights made
    by the loader's dummy path (init, then quantized per channel)."""
    from jaxinfer.model.weights import load_params
    cfg = config_from_dict({
        "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 256, "hidden_size": 128,
        "intermediate_size": 256, "moe_intermediate_size": 128, "num_experts": 8,
        "num_experts_per_tok": 2, "norm_topk_prob": True, "decoder_sparse_step": 1,
        "mlp_only_layers": [], "num_hidden_layers": 1, "num_attention_heads": 2,
        "num_key_value_heads": 1, "head_dim": 64, "max_position_embeddings": 256,
        "rms_norm_eps": 1e-6, "torch_dtype": "bfloat16"})
    cfg = dataclasses.replace(cfg, quantization="fp8")
    return cfg, load_params(None, cfg, jnp.bfloat16, "dummy", progress=False, seed=3)


def test_fp8_moe_model_runs_the_configured_experts_impl(monkeypatch):
    """`--moe-impl` reaches `moe_experts` through the model's kernel table, with the loader's e4m3
    stacks and their scales (the kernel itself on them: test_moe_experts_fp8_kernel_matches_xla_paths)."""
    from jaxinfer.model import experts
    from jaxinfer.model.experts import RoutedExperts
    from jaxinfer.model.kernel_table import REFERENCE_KERNELS
    from jaxinfer.model.transformer import train_forward
    cfg, params = _tiny_qwen3_moe_fp8()
    assert params["layers_0"]["moe"]["w_gate"].dtype == FP8
    seen = []

    def spy(x, weights, group_sizes, **kwargs):
        seen.append((kwargs["impl"], weights[0].dtype, kwargs["scales"] is not None))
        return gm.moe_experts(x, weights, group_sizes, **kwargs)

    monkeypatch.setattr(experts, "moe_experts", spy)
    tokens = jax.ShapeDtypeStruct((1, 12), jnp.int32)
    for impl in ("padded", "xla"):  # traced only: the implementations' arithmetic is tested above
        kernels = dataclasses.replace(REFERENCE_KERNELS, routed_experts=RoutedExperts(impl))
        out = jax.eval_shape(functools.partial(train_forward, cfg=cfg, kernels=kernels), params,
                             tokens=tokens)
        assert out.shape == (1, 12, cfg.vocab_size)
    assert seen == [("padded", FP8, True), ("xla", FP8, True)]


def test_engine_greedy_with_fp8_experts_follows_the_forward_and_the_unquantized_model():
    """`--quantization fp8` end to end on a Qwen3-MoE checkpoint (its expert stacks e4m3 with
    channel scales, routed through `moe_experts` with them): the engine's greedy tokens are the
    dense forward's on the same quantized params (paged cache, batching and the quantized experts
    agree), and the quantized model's greedy tokens and logits stay near the unquantized one's."""
    from pathlib import Path

    from jaxinfer import LLM, SamplingParams
    from jaxinfer.model.config import load_config
    from jaxinfer.model.transformer import train_forward
    from jaxinfer.model.weights import load_params
    fixture = Path(__file__).resolve().parent / "fixtures" / "models" / "qwen3_moe"
    golden = np.load(fixture / "golden.npz")
    prompts = [golden["greedy_prompt"].tolist(), golden["prompt_1"].tolist()]
    n = 8
    llm = LLM(str(fixture), quantization="fp8", dtype="float32", max_num_seqs=2,
              max_num_batched_tokens=64, num_blocks=64, block_size=4, warmup=False,
              compilation_cache_dir=None, decode_steps_per_call=1)
    cfg, params = llm.engine.cfg, llm.engine.runner.params
    moe = params["layers_0"]["moe"]
    assert moe["w_gate"].dtype == FP8 and moe["w_down_scale"].dtype == jnp.float32
    outs = llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True),
                        use_tqdm=False)
    dense_cfg = load_config(fixture)
    dense = load_params(fixture, dense_cfg, jnp.float32, progress=False)
    # Both sequences in one [2, L] batch (causal: the zeros after a sequence change nothing before
    # it), so each model compiles once.
    seqs = [p + o.outputs[0].token_ids for p, o in zip(prompts, outs)]
    batch = np.zeros((2, max(map(len, seqs))), np.int32)
    for i, seq in enumerate(seqs):
        batch[i, :len(seq)] = seq
    quant_logits = np.asarray(jax.jit(lambda p, t: train_forward(p, cfg, t))(params, batch))
    dense_logits = np.asarray(jax.jit(lambda p, t: train_forward(p, dense_cfg, t))(dense, batch))
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        at = slice(len(prompt) - 1, len(seqs[i]) - 1)  # the positions that chose each new token
        logits, ref = quant_logits[i, at], dense_logits[i, at]
        assert out.outputs[0].token_ids == logits.argmax(-1).tolist()  # the forward's argmax
        # e4m3 weights (3 mantissa bits, channel scales) in a random model whose routing flips
        # with small changes: the largest logit error within 0.3 of the largest logit (measured
        # 0.11 and 0.20), the same greedy choice at most positions (measured 7 / 8 and 8 / 8).
        assert np.abs(logits - ref).max() <= 0.3 * np.abs(ref).max()
        assert (logits.argmax(-1) == ref.argmax(-1)).mean() >= 0.75
