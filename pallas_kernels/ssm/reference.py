"""Pure-jnp references of the recurrent layers' kernels: the oracles the kernels are tested against,
and the definitions those are checked against.

Every prefill function takes the ragged batch of `batch.py` (packed tokens, cu_seqlens, state
slots, has_initial_state) and returns (output, the state pool with each sequence's final state
written to its slot). Three forms of each layer:
  - `*_step`: one token of one recurrence, the definition;
  - `*_recurrent_reference`: the step scanned over the packed tokens (naive, O(T) sequential);
  - `*_chunked_reference` (GDN, SSD): the chunked form the kernels compute, per sequence padded to
    whole chunks; `causal_conv1d_reference` is the direct windowed sum.
And `*_decode_reference`: one step for each of S sequences, one token each.

Shapes: T tokens, S sequences; Gated DeltaNet: Hk query/key heads of K dims, Hv value heads of
V dims (value head h reads key head h // (Hv // Hk), HF's repeat_interleave), state [Hv, K, V];
Mamba-2: H heads of P dims, G groups of N dims for B/C (head h reads group h // (H // G)), state
[H, P, N]; conv: C channels, kernel width W, state the last W - 1 inputs [W - 1, C].
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.ssm.batch import initial_flags, live_tokens, token_sequence

L2NORM_EPS = 1e-6  # HF's / fla's l2norm epsilon
_HI = lax.Precision.HIGHEST


# ---------------------------------------------------------------------------------- gating, input
def gdn_gating(a: jax.Array, b: jax.Array, a_log: jax.Array, dt_bias: jax.Array
               ) -> tuple[jax.Array, jax.Array]:
    """Qwen3-Next's gates from the projections a, b [..., Hv]: g = -exp(A_log) * softplus(a +
    dt_bias) (the log of the per-token state decay, <= 0) and beta = sigmoid(b), float32."""
    g = -jnp.exp(a_log.astype(jnp.float32)) * jax.nn.softplus(
        a.astype(jnp.float32) + dt_bias.astype(jnp.float32))
    return g, jax.nn.sigmoid(b.astype(jnp.float32))


def mamba2_dt(dt: jax.Array, dt_bias: jax.Array,
              limit: tuple[float, float] = (0.0, float("inf"))) -> jax.Array:
    """Mamba-2's step size from the projection dt [..., H]: clamp(softplus(dt + dt_bias)), f32."""
    out = jax.nn.softplus(dt.astype(jnp.float32) + dt_bias.astype(jnp.float32))
    return jnp.clip(out, limit[0], limit[1])


def l2norm(x: jax.Array, eps: float = L2NORM_EPS) -> jax.Array:
    """x / sqrt(sum(x^2) + eps) over the last axis, float32 (HF's `l2norm`)."""
    x = x.astype(jnp.float32)
    return x * lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def _gdn_qk(q: jax.Array, k: jax.Array, hv: int, use_qk_l2norm: bool):
    """q, k [..., Hk, K] -> float32 [..., Hv, K]: optionally L2-normalised, q scaled by K^-1/2,
    each key head repeated for its Hv // Hk value heads."""
    q, k = q.astype(jnp.float32), k.astype(jnp.float32)
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    q = q * q.shape[-1] ** -0.5
    rep = hv // q.shape[-2]
    return jnp.repeat(q, rep, axis=-2), jnp.repeat(k, rep, axis=-2)


def _ssd_bc(b: jax.Array, c: jax.Array, h: int):
    """B, C [..., G, N] -> float32 [..., H, N] (each group shared by H // G heads)."""
    rep = h // b.shape[-2]
    return (jnp.repeat(b.astype(jnp.float32), rep, axis=-2),
            jnp.repeat(c.astype(jnp.float32), rep, axis=-2))


# ----------------------------------------------------------------------------------- definitions
def gdn_step(state, q, k, v, g, beta):
    """One token of the gated delta rule (float32, any leading dims): state [..., K, V], q and k
    [..., K] (prepared: normalised, q scaled), v [..., V], g and beta [...].
    S <- exp(g) S;  S <- S + k (beta (v - k^T S))^T;  o = q^T S."""
    state = state * jnp.exp(g)[..., None, None]
    kv_mem = jnp.einsum("...kv,...k->...v", state, k, precision=_HI)
    delta = (v - kv_mem) * beta[..., None]
    state = state + k[..., :, None] * delta[..., None, :]
    return state, jnp.einsum("...kv,...k->...v", state, q, precision=_HI)


def ssd_step(state, x, dt, a, b, c):
    """One token of Mamba-2's SSM (float32, any leading dims): state [..., P, N], x [..., P],
    dt and a [...], b and c [..., N].  h <- exp(dt a) h + dt x b^T;  y = h c."""
    state = state * jnp.exp(dt * a)[..., None, None] + (dt[..., None] * x)[..., :, None] * b[..., None, :]
    return state, jnp.einsum("...pn,...n->...p", state, c, precision=_HI)


def conv_step(state, x, weight, bias, activation):
    """One token of the causal depthwise conv: state [W-1, C] (the previous inputs, oldest
    first), x [C], weight [W, C] -> (the last W-1 inputs, y [C]); float32."""
    window = jnp.concatenate([state, x[None]], axis=0)
    y = jnp.sum(window * weight, axis=0)
    y = y if bias is None else y + bias
    return window[1:], _activate(y, activation)


def _activate(y, activation):
    if activation is None:
        return y
    if activation == "silu":
        return jax.nn.silu(y)
    raise ValueError(f"activation={activation!r}: 'silu' or None")


# ------------------------------------------------------------------------------ ragged machinery
def _initial_states(pool, slots, has_initial_state, src_slots):
    """float32 [S, ...]: each sequence's source slot, or zeros where it starts fresh."""
    init = initial_flags(slots, has_initial_state, src_slots).astype(bool)
    src = slots if src_slots is None else src_slots
    states = pool[jnp.maximum(src, 0)].astype(jnp.float32)
    return jnp.where(init.reshape(init.shape + (1,) * (states.ndim - 1)), states, 0.0)


def _recurrence(step, pool, cu_seqlens, slots, has_initial_state, src_slots, xs):
    """Scan step(state, *x_t) -> (state, y_t) over the packed tokens, each sequence starting from
    its source slot (or zeros), and write the final states to `slots`. Returns (ys [T, ...],
    pool)."""
    t = xs[0].shape[0]
    s = slots.shape[0]
    seq, live = token_sequence(cu_seqlens, t), live_tokens(cu_seqlens, slots, t)
    states = _initial_states(pool, slots, has_initial_state, src_slots)

    def body(states, inp):
        i, ok, x = inp
        i = jnp.minimum(i, s - 1)
        new, y = step(states[i], *x)
        return states.at[i].set(jnp.where(ok, new, states[i])), jnp.where(ok, y, 0.0)

    states, ys = lax.scan(body, states, (seq, live, xs))
    return ys, _write_back(pool, states, slots)


def _write_back(pool, states, slots):
    dest = jnp.where(slots >= 0, slots, pool.shape[0])  # out of range: dropped
    return pool.at[dest].set(states.astype(pool.dtype), mode="drop")


def _decode(step, pool, slots, src_slots, xs):
    """One step for each sequence from its source slot into its slot; slots < 0 give zeros and
    write nothing."""
    new, y = jax.vmap(step)(_initial_states(pool, slots, None, src_slots), *xs)
    y = jnp.where((slots >= 0).reshape((-1,) + (1,) * (y.ndim - 1)), y, 0.0)
    return y, _write_back(pool, new, slots)


def _per_sequence(x, cu_seqlens, length):
    """[T, ...] -> [S, length, ...]: sequence s's tokens from row 0, zeros past its end."""
    t = x.shape[0]
    j = jnp.arange(length, dtype=jnp.int32)
    idx = cu_seqlens[:-1, None] + j[None]
    valid = j[None] < (cu_seqlens[1:] - cu_seqlens[:-1])[:, None]
    out = x[jnp.clip(idx, 0, t - 1)]
    return jnp.where(valid.reshape(valid.shape + (1,) * (x.ndim - 1)), out, 0)


def _packed(y, cu_seqlens, slots):
    """[S, L, ...] per-sequence rows -> [T, ...] packed (T = L); padding and dead rows zero."""
    t = y.shape[1]
    seq = token_sequence(cu_seqlens, t)
    i = jnp.minimum(seq, slots.shape[0] - 1)
    j = jnp.clip(jnp.arange(t) - cu_seqlens[i], 0, t - 1)
    live = live_tokens(cu_seqlens, slots, t)
    return jnp.where(live.reshape((t,) + (1,) * (y.ndim - 2)), y[i, j], 0)


def _chunked(chunk_fn, pool, cu_seqlens, slots, has_initial_state, src_slots, xs, chunk):
    """Run chunk_fn(states [S, ...], chunk inputs [S, H, BT, ...]) -> (states, y) over every
    sequence padded to whole chunks (padding rows are zeros: the identity step for both layers).
    xs: per-token inputs [T, H, ...]. Returns (y [T, H, ...], pool)."""
    t = xs[0].shape[0]
    s = slots.shape[0]
    nc = -(-t // chunk)
    states = _initial_states(pool, slots, has_initial_state, src_slots)

    def chunks(x):  # [T, H, ...] -> [nc, S, H, BT, ...]
        x = _per_sequence(x, cu_seqlens, nc * chunk).reshape((s, nc, chunk) + x.shape[1:])
        return jnp.moveaxis(jnp.moveaxis(x, 1, 0), 2, 3)

    states, y = lax.scan(chunk_fn, states, tuple(chunks(x) for x in xs))
    y = jnp.moveaxis(jnp.moveaxis(y, 3, 2), 0, 1).reshape((s, nc * chunk) + y.shape[2:3] + y.shape[4:])
    return _packed(y[:, :t], cu_seqlens, slots), _write_back(pool, states, slots)


def _causal(n):
    i = jnp.arange(n)
    return i[:, None] >= i[None, :]


# ----------------------------------------------------------------------------- Gated DeltaNet
def gdn_recurrent_reference(q, k, v, g, beta, state_pool, cu_seqlens, slots,
                            has_initial_state=None, *, src_slots=None,
                            use_qk_l2norm: bool = True):
    """The gated delta rule token by token over a ragged batch. q, k [T, Hk, K], v [T, Hv, V],
    g (log decay) and beta [T, Hv], state_pool [num_slots, Hv, K, V] float32.
    Returns (o [T, Hv, V] in v's dtype, state_pool)."""
    q, k = _gdn_qk(q, k, v.shape[1], use_qk_l2norm)
    o, pool = _recurrence(gdn_step, state_pool, cu_seqlens, slots, has_initial_state, src_slots,
                          (q, k, v.astype(jnp.float32), g.astype(jnp.float32),
                           beta.astype(jnp.float32)))
    return o.astype(v.dtype), pool


def _gdn_chunk(h, c):
    """One chunk of every (sequence, head) in the WY form: h [S, H, K, V]; q, k [S, H, BT, K],
    v [S, H, BT, V], g, beta [S, H, BT]."""
    q, k, v, g, beta = c
    n = g.shape[-1]
    causal = _causal(n)
    gc = jnp.cumsum(g, axis=-1)
    decay = jnp.exp(jnp.where(causal, gc[..., :, None] - gc[..., None, :], -jnp.inf))
    kk = jnp.einsum("shik,shjk->shij", k, k, precision=_HI)
    strict = causal & ~jnp.eye(n, dtype=bool)
    lower = jnp.where(strict, beta[..., :, None] * kk * decay, 0.0)
    # The UT transform: T = (I + strictly-lower(beta K K^T decay))^-1.
    eye = jnp.broadcast_to(jnp.eye(n, dtype=jnp.float32), lower.shape)
    tmat = jax.scipy.linalg.solve_triangular(eye + lower, eye, lower=True)
    u = jnp.einsum("shij,shjv->shiv", tmat, beta[..., None] * v, precision=_HI)
    w = jnp.einsum("shij,shjk->shik", tmat, (beta * jnp.exp(gc))[..., None] * k, precision=_HI)
    v_new = u - jnp.einsum("shik,shkv->shiv", w, h, precision=_HI)
    qk = jnp.einsum("shik,shjk->shij", q, k, precision=_HI) * decay
    o = (jnp.einsum("shik,shkv->shiv", q * jnp.exp(gc)[..., None], h, precision=_HI)
         + jnp.einsum("shij,shjv->shiv", qk, v_new, precision=_HI))
    last = gc[..., -1:]
    h = (h * jnp.exp(last)[..., None] + jnp.einsum(
        "shik,shiv->shkv", k * jnp.exp(last - gc)[..., None], v_new, precision=_HI))
    return h, o


def gdn_chunked_reference(q, k, v, g, beta, state_pool, cu_seqlens, slots,
                          has_initial_state=None, *, src_slots=None,
                          use_qk_l2norm: bool = True, chunk_size: int = 64):
    """`gdn_recurrent_reference` in the chunked WY form (HF's torch_chunk_gated_delta_rule, with
    the triangular solve for its row loop)."""
    q, k = _gdn_qk(q, k, v.shape[1], use_qk_l2norm)
    xs = (q, k, v.astype(jnp.float32), g.astype(jnp.float32)[..., None],
          beta.astype(jnp.float32)[..., None])
    o, pool = _chunked(lambda h, c: _gdn_chunk(h, (*c[:3], c[3][..., 0], c[4][..., 0])),
                       state_pool, cu_seqlens, slots, has_initial_state, src_slots, xs, chunk_size)
    return o.astype(v.dtype), pool


def gdn_decode_reference(q, k, v, g, beta, state_pool, slots, *, src_slots=None,
                         use_qk_l2norm: bool = True):
    """One token per sequence: q, k [S, Hk, K], v [S, Hv, V], g, beta [S, Hv]."""
    q, k = _gdn_qk(q, k, v.shape[1], use_qk_l2norm)
    o, pool = _decode(gdn_step, state_pool, slots, src_slots,
                      (q, k, v.astype(jnp.float32), g.astype(jnp.float32),
                       beta.astype(jnp.float32)))
    return o.astype(v.dtype), pool


# --------------------------------------------------------------------------------- Mamba-2 SSD
def _with_skip(y, x, d):
    return y if d is None else y + d.astype(jnp.float32)[:, None] * x.astype(jnp.float32)


def ssd_recurrent_reference(x, dt, a, b, c, state_pool, cu_seqlens, slots,
                            has_initial_state=None, *, d=None, src_slots=None):
    """Mamba-2's SSM token by token over a ragged batch. x [T, H, P], dt [T, H] (after softplus:
    `mamba2_dt`), a [H] (= -exp(A_log)), b, c [T, G, N], d [H] or None (the skip D x),
    state_pool [num_slots, H, P, N] float32. Returns (y [T, H, P] in x's dtype, state_pool)."""
    h = x.shape[1]
    b, c = _ssd_bc(b, c, h)
    av = jnp.broadcast_to(a.astype(jnp.float32), dt.shape)
    y, pool = _recurrence(ssd_step, state_pool, cu_seqlens, slots, has_initial_state, src_slots,
                          (x.astype(jnp.float32), dt.astype(jnp.float32), av, b, c))
    live = live_tokens(cu_seqlens, slots, x.shape[0])[:, None, None]
    return jnp.where(live, _with_skip(y, x, d), 0).astype(x.dtype), pool


def _ssd_chunk(h, c):
    """One chunk of every (sequence, head): h [S, H, P, N]; x [S, H, BT, P], dt, a [S, H, BT],
    b, c [S, H, BT, N]."""
    x, dt, a, b, cm = c
    causal = _causal(dt.shape[-1])
    cs = jnp.cumsum(dt * a, axis=-1)
    decay = jnp.exp(jnp.where(causal, cs[..., :, None] - cs[..., None, :], -jnp.inf))
    scores = jnp.einsum("shin,shjn->shij", cm, b, precision=_HI) * decay * dt[..., None, :]
    y = (jnp.einsum("shij,shjp->ship", scores, x, precision=_HI)
         + jnp.exp(cs)[..., None] * jnp.einsum("shin,shpn->ship", cm, h, precision=_HI))
    last = cs[..., -1:]
    h = h * jnp.exp(last)[..., None] + jnp.einsum(
        "shjp,shjn->shpn", x * (dt * jnp.exp(last - cs))[..., None], b, precision=_HI)
    return h, y


def ssd_chunked_reference(x, dt, a, b, c, state_pool, cu_seqlens, slots,
                          has_initial_state=None, *, d=None, src_slots=None,
                          chunk_size: int = 64):
    """`ssd_recurrent_reference` in the chunked (SSD) form of mamba_chunk_scan_combined."""
    h = x.shape[1]
    b, c = _ssd_bc(b, c, h)
    av = jnp.broadcast_to(a.astype(jnp.float32), dt.shape)
    xs = (x.astype(jnp.float32), dt.astype(jnp.float32)[..., None], av[..., None], b, c)
    y, pool = _chunked(lambda s, ch: _ssd_chunk(s, (ch[0], ch[1][..., 0], ch[2][..., 0], *ch[3:])),
                       state_pool, cu_seqlens, slots, has_initial_state, src_slots, xs, chunk_size)
    live = live_tokens(cu_seqlens, slots, x.shape[0])[:, None, None]
    return jnp.where(live, _with_skip(y, x, d), 0).astype(x.dtype), pool


def ssd_decode_reference(x, dt, a, b, c, state_pool, slots, *, d=None, src_slots=None):
    """One token per sequence: x [S, H, P], dt [S, H], b, c [S, G, N]."""
    h = x.shape[1]
    b, c = _ssd_bc(b, c, h)
    av = jnp.broadcast_to(a.astype(jnp.float32), dt.shape)
    y, pool = _decode(ssd_step, state_pool, slots, src_slots,
                      (x.astype(jnp.float32), dt.astype(jnp.float32), av, b, c))
    y = jnp.where((slots >= 0)[:, None, None], _with_skip(y, x, d), 0)
    return y.astype(x.dtype), pool


# ----------------------------------------------------------------------------- causal conv1d
def _conv_step_fn(weight, bias, activation):
    w = weight.astype(jnp.float32)
    bb = None if bias is None else bias.astype(jnp.float32)
    return lambda state, x: conv_step(state, x, w, bb, activation)


def causal_conv1d_recurrent_reference(x, weight, bias, conv_state, cu_seqlens, slots,
                                      has_initial_state=None, *, src_slots=None,
                                      activation="silu"):
    """The causal depthwise conv token by token: x [T, C], weight [W, C], bias [C] or None,
    conv_state [num_slots, W-1, C] (each slot's last W-1 inputs, oldest first).
    Returns (y [T, C] in x's dtype, conv_state)."""
    y, pool = _recurrence(_conv_step_fn(weight, bias, activation), conv_state, cu_seqlens, slots,
                          has_initial_state, src_slots, (x.astype(jnp.float32),))
    return y.astype(x.dtype), pool


def causal_conv1d_reference(x, weight, bias, conv_state, cu_seqlens, slots,
                            has_initial_state=None, *, src_slots=None,
                                      activation="silu"):
    """`causal_conv1d_recurrent_reference` as one windowed sum per sequence (HF's
    F.conv1d(padding=W-1)[:L] with the cached inputs in front)."""
    t, w = x.shape[0], weight.shape[0]
    hist = _initial_states(conv_state, slots, has_initial_state, src_slots)
    ext = jnp.concatenate([hist, _per_sequence(x.astype(jnp.float32), cu_seqlens, t)], axis=1)
    wf = weight.astype(jnp.float32)
    y = sum(wf[i] * ext[:, i:i + t] for i in range(w))
    y = _activate(y if bias is None else y + bias.astype(jnp.float32), activation)
    lens = cu_seqlens[1:] - cu_seqlens[:-1]
    new = jnp.take_along_axis(ext, (lens[:, None] + jnp.arange(w - 1))[..., None], axis=1)
    return _packed(y, cu_seqlens, slots).astype(x.dtype), _write_back(conv_state, new, slots)


def causal_conv1d_update_reference(x, weight, bias, conv_state, slots, *, src_slots=None,
                                   activation="silu"):
    """One token per sequence: x [S, C]; each slot's inputs shift by one."""
    y, pool = _decode(_conv_step_fn(weight, bias, activation), conv_state, slots, src_slots,
                      (x.astype(jnp.float32),))
    return y.astype(x.dtype), pool
