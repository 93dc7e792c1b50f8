"""The training forward's fused dense attention (pallas_kernels/attention/dense_fused.py) against
the jnp reference: values and gradients through `train_forward`, grouped KV heads, bf16 and f32.
On the CPU the fused path runs JAX's XLA composition (`implementation="xla"`), the math cuDNN's
kernel computes on a GPU (which only the H200 training run exercises)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.model.config import config_from_dict
from jaxinfer.model.transformer import param_shapes, train_forward
from pallas_kernels.attention.backend import REFERENCE
from pallas_kernels.attention.dense_fused import fused_causal_attention, with_fused_dense
from pallas_kernels.attention.reference import causal_attention_reference

CFG = config_from_dict({
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 64,
    "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
    "max_position_embeddings": 32, "tie_word_embeddings": True})


def test_train_forward_and_grads_match_the_reference():
    dtype, tol = jnp.bfloat16, 3e-2
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda a: jnp.asarray(rng.normal(0, 0.2, a.shape), dtype),
                          param_shapes(CFG, dtype))
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, CFG.vocab_size, (2, 13)), jnp.int32)
    fused = with_fused_dense(REFERENCE, "xla")
    assert fused.name == "reference+dense_xla"

    def loss(p, backend):
        logits = train_forward(p, CFG, tokens, backend).astype(jnp.float32)
        return jax.nn.log_softmax(logits).mean(), logits

    grad = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=1)
    (_, logits_ref), g_ref = grad(params, REFERENCE)
    (_, logits_new), g_new = grad(params, fused)
    np.testing.assert_allclose(logits_new, logits_ref, atol=tol * 10, rtol=tol)
    for a, b in zip(jax.tree.leaves(g_new), jax.tree.leaves(g_ref)):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                   atol=tol, rtol=tol * 10)


def test_variants_without_a_fused_mask_stay_on_the_reference():
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(1, 6, h, 8)), jnp.float32) for h in (4, 2, 2))
    np.testing.assert_array_equal(  # one branch for window, softcap and sinks alike
        fused_causal_attention(q, k, v, scale=0.3, window=2, implementation="xla"),
        causal_attention_reference(q, k, v, scale=0.3, window=2))
    with pytest.raises(ValueError, match="not one of"):
        with_fused_dense(REFERENCE, "flash")
