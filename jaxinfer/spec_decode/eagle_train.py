"""Training an EAGLE-3 head on a frozen target: the training-time-test (TTT) loss and the jitted
update (optax AdamW, float32 master weights, the forward in `compute_dtype`).

TTT (EAGLE-3): the head runs `k` unrolled steps over every position of a sequence at once, as
the proposer's chain runs them. Step 0 at index t reads token t + 1 and the target's streams of
position t (position t); step j reads token t + 1 + j and step j - 1's output stream (position
t + j: the chain rooted at t). Step j's query at index t attends to step 0's keys at indices <= t
(the KV a served head holds from real streams) and to steps 1..j's keys at index t (the chain's
own KV) -- exactly the keys the proposer's step j sees. Each step's prediction is scored by the
cross-entropy against the target's own next-token distribution at that position, restricted to
the head's draft vocabulary (soft labels: matching the target is what acceptance rewards), step
j weighted 0.8^j; the target's streams and labels come from its dense forward inside the same
jitted step (no stored features).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import optax

from jaxinfer.model.config import ModelConfig
from jaxinfer.model.transformer import forward_aux
from jaxinfer.spec_decode import eagle_head as head

STEP_DECAY = 0.8  # EAGLE-3's weight of unrolled step j: 0.8^j


def _shift(x: jax.Array, j: int) -> jax.Array:
    """x[:, t + j] at index t (zeros past the end)."""
    return jnp.pad(x[:, j:], [(0, 0), (0, j)] + [(0, 0)] * (x.ndim - 2))


def _ttt_attend(keys: list, values: list, scale: float):
    """`attend` of TTT step len(keys) - 1 (its own k/v appended by the call): causal over step 0,
    diagonal over steps 1..j. q [B, L, Hq, D], k/v [B, L, Hkv, D]."""
    def attend(q, k, v):
        keys.append(k)
        values.append(v)
        b, n, hq, d = q.shape
        g = hq // k.shape[2]
        qf = q.astype(jnp.float32).reshape(b, n, k.shape[2], g, d) * scale
        k0, v0 = keys[0].astype(jnp.float32), values[0].astype(jnp.float32)
        causal = jnp.einsum("bqhgd,bkhd->bhgqk", qf, k0)
        causal = jnp.where(jnp.tril(jnp.ones((n, n), bool)), causal, -jnp.inf)
        scores, vs = causal, None
        if len(keys) > 1:  # [B, L, Hkv, j, D]
            ks = jnp.stack([kk.astype(jnp.float32) for kk in keys[1:]], -2)
            vs = jnp.stack([vv.astype(jnp.float32) for vv in values[1:]], -2)
            diag = jnp.einsum("bqhgd,bqhjd->bhgqj", qf, ks)
            scores = jnp.concatenate([causal, diag], axis=-1)
        probs = jax.nn.softmax(scores, axis=-1)
        out = jnp.einsum("bhgqk,bkhd->bqhgd", probs[..., :n], v0)
        if vs is not None:
            out = out + jnp.einsum("bhgqj,bqhjd->bqhgd", probs[..., n:], vs)
        return out.reshape(b, n, hq, d).astype(q.dtype)
    return attend


def ttt_loss(hp: dict, target_params: dict, embed: jax.Array, tokens: jax.Array,
             mask: jax.Array, *, cfg: head.Eagle3Config, target_cfg: ModelConfig, k: int,
             compute_dtype=jnp.bfloat16):
    """-> (loss, per-step top-1 agreement with the target f32[k]). tokens i32[B, L]; mask
    f32[B, L]: 1 where token t is real (the label of index t in step j is position t + 1 + j)."""
    logits_t, _, aux = forward_aux(target_params, target_cfg, tokens, None, None, None,
                                   layers=cfg.aux_layers)
    ids = jnp.arange(cfg.draft_vocab_size) + hp["d2t"]
    labels_all = jax.nn.softmax(jax.lax.stop_gradient(logits_t[..., ids].astype(jnp.float32)))
    best_all = jnp.argmax(logits_t, axis=-1)
    p = {n: (w.astype(compute_dtype) if n != "d2t" else w) for n, w in hp.items()}
    hidden = head.fuse(p, jax.lax.stop_gradient(aux).astype(compute_dtype))
    n = tokens.shape[1]
    positions = jnp.broadcast_to(jnp.arange(n), tokens.shape)
    keys: list = []
    values: list = []
    total, weight, agree = 0.0, 0.0, []
    for j in range(k):
        attend = _ttt_attend(keys, values, cfg.layer.score_scale)
        normed, hidden = head.layer(p, cfg, embed.astype(compute_dtype), _shift(tokens, 1 + j),
                                    hidden, positions + j, attend)
        logp = jax.nn.log_softmax(head.draft_logits(p, normed), axis=-1)
        m = _shift(mask, 1 + j)
        labels = _shift(labels_all, 1 + j)
        ce = -(labels * logp).sum(-1)
        step_loss = (ce * m).sum() / jnp.maximum(m.sum(), 1.0)
        total = total + STEP_DECAY ** j * step_loss
        weight += STEP_DECAY ** j
        hit = (ids[jnp.argmax(logp, -1)] == _shift(best_all, 1 + j)).astype(jnp.float32)
        agree.append((hit * m).sum() / jnp.maximum(m.sum(), 1.0))
    return total / weight, jnp.stack(agree)


@dataclasses.dataclass(frozen=True)
class TrainSettings:
    k: int = 5                 # unrolled TTT steps
    lr: float = 1e-3
    warmup_steps: int = 50
    total_steps: int = 2000    # the cosine's length
    weight_decay: float = 0.0
    clip: float = 0.5
    compute_dtype: str = "bfloat16"


def optimizer(s: TrainSettings) -> optax.GradientTransformation:
    schedule = optax.warmup_cosine_decay_schedule(0.0, s.lr, max(1, s.warmup_steps),
                                                  max(s.total_steps, s.warmup_steps + 1),
                                                  end_value=s.lr * 0.1)
    return optax.chain(optax.clip_by_global_norm(s.clip),
                       optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=s.weight_decay))


def trainable(hp: dict) -> dict:
    return {n: w for n, w in hp.items() if n != "d2t"}


def make_train_step(cfg: head.Eagle3Config, target_cfg: ModelConfig, s: TrainSettings):
    """-> jitted step(trainable f32, opt_state, d2t, target params, embed, tokens, mask) ->
    (trainable, opt_state, loss, agreement f32[k]); the trainable weights and state donated."""
    opt = optimizer(s)
    dtype = jnp.dtype(s.compute_dtype)

    def step(w, opt_state, d2t, target_params, embed, tokens, mask):
        def loss_fn(w):
            return ttt_loss(dict(w, d2t=d2t), target_params, embed, tokens, mask, cfg=cfg,
                            target_cfg=target_cfg, k=s.k, compute_dtype=dtype)
        (loss, agree), grads = jax.value_and_grad(loss_fn, has_aux=True)(w)
        updates, opt_state = opt.update(grads, opt_state, w)
        return optax.apply_updates(w, updates), opt_state, loss, agree

    return jax.jit(step, donate_argnums=(0, 1)), opt


@functools.partial(jax.jit, static_argnames=("cfg", "target_cfg", "k"))
def eval_loss(hp, target_params, embed, tokens, mask, *, cfg, target_cfg, k):
    return ttt_loss(hp, target_params, embed, tokens, mask, cfg=cfg, target_cfg=target_cfg, k=k,
                    compute_dtype=jnp.float32)


def draft_vocab(token_counts, size: int) -> jax.Array:
    """d2t of the `size` most frequent target tokens (sorted by id): draft i -> target
    i + d2t[i], as EAGLE-3's released heads choose theirs."""
    import numpy as np
    top = np.sort(np.argsort(-np.asarray(token_counts), kind="stable")[:size])
    return jnp.asarray(top - np.arange(size), jnp.int32)
