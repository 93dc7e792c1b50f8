"""A small random Llama-shaped model (head_dim 128, GQA 4) and a greedy decode loop driven by
`forward` directly, for the kernels' end-to-end checks on the GPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.worker.kv.device_cache import allocate_kv_cache
from jaxinfer.model.config import config_from_dict
from jaxinfer.model.kernel_table import KernelTable
from jaxinfer.model.transformer import forward, init_params
from pallas_kernels.attention.metadata import AttentionMetadata

PAGE, MAX_BLOCKS = 16, 32
PROMPT_LENS = np.array([37, 150, 300, 5])


def small_llama(dtype=jnp.float32):
    cfg = config_from_dict({"architectures": ["LlamaForCausalLM"], "vocab_size": 512,
                            "hidden_size": 256, "intermediate_size": 512,
                            "num_hidden_layers": 2, "num_attention_heads": 8,
                            "num_key_value_heads": 2, "head_dim": 128,
                            "max_position_embeddings": 4096})
    return cfg, init_params(cfg, jax.random.key(0), dtype, std=0.1)


def greedy_decode(cfg, params, prefill_backend, decode_backend, steps: int = 24, forced=None):
    """Prefill the prompts in two chunks (the second over the cached first half) with
    `prefill_backend`, then `steps` greedy decode steps with `decode_backend` (feeding `forced`
    [S, steps + 1] tokens instead of the argmax where given). Returns tokens [S, steps + 1] and
    the decode steps' logits [S, steps, V]."""
    batch = len(PROMPT_LENS)
    bt = np.random.default_rng(0).permutation(batch * MAX_BLOCKS).reshape(batch, MAX_BLOCKS)
    prompts = [np.random.default_rng(100 + i).integers(0, cfg.vocab_size, n)
               for i, n in enumerate(PROMPT_LENS)]
    step = jax.jit(forward, static_argnames=("cfg", "kernels"), donate_argnums=(4,))
    cache = allocate_kv_cache(cfg, batch * MAX_BLOCKS, PAGE, jnp.bfloat16)

    def run(backend, cache, seqs, starts, ends, num_decodes, last=None):
        pos = np.concatenate([np.arange(a, b) for a, b in zip(starts, ends)])
        seq = np.repeat(np.arange(batch), ends - starts)
        toks = np.concatenate([s[a:b] for s, a, b in zip(seqs, starts, ends)])
        slots = jnp.asarray(bt[seq, pos // PAGE] * PAGE + pos % PAGE, jnp.int32)
        qsl = jnp.asarray(np.concatenate([[0], np.cumsum(ends - starts)]), jnp.int32)
        md = AttentionMetadata(slots, qsl, jnp.asarray(ends, jnp.int32),
                               jnp.asarray(bt, jnp.int32), num_decodes=num_decodes)
        return step(params, cfg, jnp.asarray(toks, jnp.int32), jnp.asarray(pos, jnp.int32),
                    cache, md, kernels=KernelTable(attention=backend),
                    logits_indices=None if last is None else jnp.asarray(last, jnp.int32))

    half = PROMPT_LENS // 2
    _, cache = run(prefill_backend, cache, prompts, np.zeros(batch, int), half, 0)
    logits, cache = run(prefill_backend, cache, prompts, half, PROMPT_LENS, 0,
                        last=np.cumsum(PROMPT_LENS - half) - 1)
    tok = np.asarray(jnp.argmax(logits, -1), np.int32)
    seqs = [list(p) for p in prompts]
    toks, all_logits, lens = [tok], [], PROMPT_LENS.copy()
    for i in range(steps):
        feed = tok if forced is None else forced[:, i]
        for s, t in zip(seqs, feed):
            s.append(int(t))
        logits, cache = run(decode_backend, cache, seqs, lens, lens + 1, batch)
        all_logits.append(np.asarray(logits))
        tok = np.asarray(jnp.argmax(logits, -1), np.int32)
        toks.append(tok)
        lens = lens + 1
    return np.stack(toks, 1), np.stack(all_logits, 1)
