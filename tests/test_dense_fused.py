"""The training forward's fused dense attention (pallas_kernels/attention/dense_fused.py) against
the jnp reference: values and gradients with grouped KV heads in bf16, the variants that stay on
the reference, and `train_forward` routing its attention through `backend.dense`. On the CPU the
fused path runs JAX's XLA composition (`implementation="xla"`), the math cuDNN's kernel computes
on a GPU (which only the H200 training run exercises)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.model.config import config_from_dict
from jaxinfer.model.transformer import param_shapes, train_forward
from jaxinfer.model.kernel_table import REFERENCE_KERNELS
from pallas_kernels.attention.dense_fused import fused_causal_attention, with_fused_dense
from pallas_kernels.attention.reference import causal_attention_reference


def qkv(dtype, length=13):
    rng = np.random.default_rng(0)
    return [jnp.asarray(rng.normal(size=(2, length, h, 8)), dtype) for h in (4, 2, 2)]


def test_values_and_gradients_match_the_reference():
    q, k, v = qkv(jnp.bfloat16)
    cot = jnp.asarray(np.random.default_rng(1).normal(size=q.shape), jnp.bfloat16)

    @jax.jit
    def both(q, k, v):
        fused = jax.vjp(lambda *a: fused_causal_attention(*a, scale=0.35, implementation="xla"), q, k, v)
        ref = jax.vjp(lambda *a: causal_attention_reference(*a, scale=0.35), q, k, v)
        return (fused[0], *fused[1](cot)), (ref[0], *ref[1](cot))

    for new, old in zip(*both(q, k, v)):  # output, dq, dk, dv
        np.testing.assert_allclose(np.asarray(new, np.float32), np.asarray(old, np.float32),
                                   atol=3e-2, rtol=3e-2)


def test_variants_without_a_fused_mask_stay_on_the_reference():
    q, k, v = qkv(jnp.float32, 6)
    np.testing.assert_array_equal(  # one branch for window, softcap and sinks alike
        fused_causal_attention(q, k, v, scale=0.3, window=2, implementation="xla"),
        causal_attention_reference(q, k, v, scale=0.3, window=2))
    with pytest.raises(ValueError, match="not one of"):
        with_fused_dense(REFERENCE_KERNELS, "flash")


def test_train_forward_attends_through_the_backends_dense_path():
    cfg = config_from_dict({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 64,
        "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
        "max_position_embeddings": 32, "tie_word_embeddings": True})
    calls = []

    def spy(q, k, v, **variant):
        calls.append((q.shape, k.shape))
        return causal_attention_reference(q, k, v, **variant)

    fused = with_fused_dense(REFERENCE_KERNELS, "xla")
    assert fused.dense_attention.func is fused_causal_attention
    assert fused.dense_attention.keywords == {"implementation": "xla"}
    backend = dataclasses.replace(fused, dense_attention=spy)
    tokens = jax.ShapeDtypeStruct((2, 5), jnp.int32)
    out = jax.eval_shape(lambda p, t: train_forward(p, cfg, t, backend), param_shapes(cfg), tokens)
    assert out.shape == (2, 5, 64)
    assert calls == [((2, 5, 4, 8), (2, 5, 2, 8))] * 2  # once per layer
