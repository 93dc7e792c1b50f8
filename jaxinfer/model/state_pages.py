"""A fixed-state layer's states in the paged cache (kv_specs.FixedStateSpec), for every such
layer (mamba2.py's Mamba-2 mixer, qwen3_next.py's Gated DeltaNet): the states a step's
sequences start from, gathered into a pool of one slot per sequence, and the states they end
with, written back.

A sequence's first n blocks of the layer's group table (n = FixedStateSpec.state_pages, held
from its first token to its end) hold the layer's states (a conv state and a recurrent state, in
the order `shapes` gives) after the sequence's last computed token, as float32 words, the rest
zero. The cache arrays ([heads, blocks, block_size, width], K and V) are split over KV heads
under tensor parallelism, so the words are laid out in shares by head (`state_shares`): the
arrays' heads in g equal groups, every state's heads (or channels, part by part: `StateShape`)
in g equal shares, share i's words end to end over head group i's slice of the n pages (its K
slice, then its V slice, of each block in turn). g, the greatest count dividing the stored KV
heads and every part, depends on the model and the stored heads alone: a page's layout is the
same at every tensor-parallel size storing those heads (a device holds whole shares:
parallel/state_heads.py), so the disaggregated hand-over copies pages between TP sizes as they
are.

A word is one float32 element; in a 16-bit or fp8 cache, six bytes of elements that each hold a
few of its bits and stand for a finite value (`_fields`, kv_specs.stored_state_bytes): an
attention layer that later gets the block reads its stale elements at masked positions, and a
raw word's bits may be a NaN or infinity there (0 x NaN reaches its output). A step reads them
(zeros for a sequence with no context) and writes the new ones over them, so chunked prefill
carries the state across chunks and a decode updates it in place; a fork's shared pages are
copied before either side writes (KVCacheManager's copy-on-write).
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import jax
import jax.numpy as jnp

from jaxinfer.model.kv_specs import stored_state_bytes

_F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class StateShape:
    """One state array of a fixed-state layer, [*shape] a sequence, whose `axis` runs over its
    heads or channels in `parts` (their sizes along it, in order; None: one part, the whole
    axis). The pages hold each part split evenly into shares (`state_shares`), as tensor
    parallelism splits it over devices."""
    shape: tuple[int, ...]
    axis: int = 0
    parts: tuple[int, ...] | None = None

    @property
    def part_sizes(self) -> tuple[int, ...]:
        return self.parts or (self.shape[self.axis],)

    def split(self, count: int) -> StateShape:
        """The state one of `count` equal shares of every part holds."""
        parts = tuple(p // count for p in self.part_sizes)
        shape = self.shape[:self.axis] + (sum(parts),) + self.shape[self.axis + 1:]
        return StateShape(shape, self.axis, None if self.parts is None else parts)


Shapes = tuple[StateShape, ...]


@dataclasses.dataclass(frozen=True)
class StateBatch:
    """A step's sequences as the ssm kernels take them (pallas_kernels/ssm/batch.py): cu_seqlens
    [S + 1], slots [S] (-1: no tokens), has_initial_state [S], each state's pool [S, *shape]
    (zeros where a sequence starts fresh), their `shapes`, and the pages [S, n] each writes its
    final states over (out of range: none; None on the dense path, which keeps no states).
    `decode`: a pure-decode step (one token a sequence, no padding rows), which runs the
    one-token kernels."""
    cu_seqlens: jax.Array
    slots: jax.Array
    has_initial_state: jax.Array
    pools: tuple[jax.Array, ...]
    shapes: Shapes
    destinations: jax.Array | None = None
    decode: bool = False

    @property
    def ragged(self) -> tuple[jax.Array, jax.Array, jax.Array]:
        """(cu_seqlens, slots, has_initial_state), the kernels' ragged arguments."""
        return self.cu_seqlens, self.slots, self.has_initial_state

    def written(self, kv, states: tuple[jax.Array, ...]):
        """The layer's cache pair with the step's final `states` over their pages (None on the
        dense path)."""
        return None if self.destinations is None else write_states(kv, self.destinations, states,
                                                                       self.shapes)


def step_states(lead: tuple[int, ...], kv, md, shapes: Shapes) -> StateBatch:
    """A fixed-state layer's batch for x of leading shape `lead`: `dense_batch` without a cache
    (kv None), else `paged_batch` of the step's tokens."""
    if kv is None:
        return dense_batch(lead, shapes)
    batch = paged_batch(md, kv, shapes)
    return dataclasses.replace(batch, decode=md.num_decodes == md.num_seqs == math.prod(lead))


def state_words(shapes: Shapes) -> int:
    """float32 words of the states of `shapes`."""
    return sum(math.prod(s.shape) for s in shapes)


def state_shares(heads: int, shapes: Shapes) -> int:
    """The shares the states of `shapes` are laid out in over a cache of `heads` KV heads: the
    greatest count dividing the heads and every part. A device's shard of tp (heads / tp of them,
    its parts 1/tp) has 1/tp of the shares of the whole cache: the same layout."""
    return math.gcd(heads, *(p for s in shapes for p in s.part_sizes))


def dense_batch(lead: tuple[int, ...], shapes: Shapes) -> StateBatch:
    """Rows of x [B, L, H] (or [L, H]) as B fresh sequences of L tokens, each in its own slot."""
    rows, length = (1, lead[0]) if len(lead) == 1 else lead
    return StateBatch(jnp.arange(rows + 1, dtype=jnp.int32) * length,
                      jnp.arange(rows, dtype=jnp.int32), jnp.zeros((rows,), bool),
                      tuple(jnp.zeros((rows, *s.shape), _F32) for s in shapes), shapes)


def paged_batch(md, kv, shapes: Shapes) -> StateBatch:
    """The batch of a paged step (md: AttentionMetadata of the layer's group): sequence s reads
    its states from its state's pages and writes them back there (a padding sequence, or a
    finished row of a decode loop, has no tokens: slot -1, its pages out of range)."""
    cu = md.query_start_loc.astype(jnp.int32)
    seq_lens = md.seq_lens.astype(jnp.int32)
    s = seq_lens.shape[0]
    num_blocks = kv[0].shape[1]
    pages = md.block_tables[:, :state_pages(kv, shapes)]
    q = cu[1:] - cu[:-1]
    live = (q > 0) & (seq_lens > 0)
    has_init = live & (seq_lens - q > 0)
    pools = tuple(jnp.where(has_init.reshape((s,) + (1,) * (p.ndim - 1)), p, 0.0)
                  for p in read_states(kv, pages, shapes))
    slots = jnp.where(live, jnp.arange(s), -1).astype(jnp.int32)
    return StateBatch(cu, slots, has_init, pools, shapes,
                      jnp.where(live[:, None], pages, num_blocks))


def state_pages(kv, shapes: Shapes) -> int:
    """The pages of the cache array pair kv that the states of `shapes` span
    (FixedStateSpec.state_pages for this cache)."""
    dtype = kv[0].dtype
    page_bytes = sum(a[:, 0].size for a in kv) * dtype.itemsize
    return -(-stored_state_bytes(state_words(shapes) * 4, dtype) // page_bytes)


def _fields(dtype) -> tuple[int, int, int]:
    """(bits, fields, marker) of a float32 word in elements of a narrower `dtype`: `fields`
    elements of `bits` each, low first, ORed with `marker`. 16-bit: 12 bits with bit 13 set, an
    exponent field of 64-95 (bfloat16) or 8-11 (float16): normal and finite. 8-bit: 6 bits, below
    0x40: finite in e4m3fn and e5m2."""
    bits = 6 * dtype.itemsize
    return bits, -(-32 // bits), 0x2000 if dtype.itemsize == 2 else 0


def _words(elements: jax.Array, num_words: int) -> jax.Array:
    """The first `num_words` float32 words stored in [S, E] cache elements (bit-exact)."""
    s, dtype = elements.shape[0], elements.dtype
    if dtype == _F32:
        return elements[:, :num_words]
    bits, fields, _ = _fields(dtype)
    uint = jnp.dtype(f"uint{8 * dtype.itemsize}")
    parts = jax.lax.bitcast_convert_type(elements[:, :num_words * fields], uint)
    parts = parts.reshape(s, num_words, fields).astype(jnp.uint32) & ((1 << bits) - 1)
    word = sum(parts[..., i] << (i * bits) for i in range(fields))
    return jax.lax.bitcast_convert_type(word, _F32)


def _elements(words: jax.Array, dtype, num_elements: int) -> jax.Array:
    """float32 words [S, W] as [S, num_elements] cache elements of `dtype`, zeros after them
    (`_words` reads them back); in a narrower cache each word as `_fields` gives."""
    dtype = jnp.dtype(dtype)
    s = words.shape[0]
    if dtype == _F32:
        out = words
    else:
        bits, fields, marker = _fields(dtype)
        uint = jnp.dtype(f"uint{8 * dtype.itemsize}")
        word = jax.lax.bitcast_convert_type(words, jnp.uint32)
        parts = jnp.stack([(word >> (i * bits)) & ((1 << bits) - 1) | marker
                           for i in range(fields)], axis=-1)
        out = jax.lax.bitcast_convert_type(parts.astype(uint), dtype).reshape(s, -1)
    return jnp.pad(out, ((0, 0), (0, num_elements - out.shape[1])))


def _page_rows(kv, blocks: jax.Array, shares: int) -> jax.Array:
    """[S, shares, n * E / shares]: per share, its head group's slices of the pages `blocks`
    [S, n] of the cache array pair kv end to end (each block's K slice, then its V slice)."""
    s, n = blocks.shape
    rows = []
    for a in kv:
        heads = a.shape[0]
        x = a[:, blocks].reshape(shares, heads // shares, s, n, -1)
        rows.append(jnp.transpose(x, (2, 0, 3, 1, 4)).reshape(s, shares, n, -1))
    return jnp.concatenate(rows, axis=-1).reshape(s, shares, -1)


def _to_shares(x: jax.Array, state: StateShape, shares: int) -> jax.Array:
    """A state [S, *shape] as [S, shares, its words / shares]: share i holds the i-th of
    `shares` equal slices of each part."""
    axis, pieces = state.axis + 1, []
    for part in jnp.split(x, list(itertools.accumulate(state.part_sizes))[:-1], axis=axis):
        shape = part.shape
        part = part.reshape(shape[:axis] + (shares, shape[axis] // shares) + shape[axis + 1:])
        pieces.append(jnp.moveaxis(part, axis, 1))
    return jnp.concatenate(pieces, axis=axis + 1).reshape(x.shape[0], shares, -1)


def _from_shares(words: jax.Array, state: StateShape, shares: int) -> jax.Array:
    """`_to_shares`' inverse: [S, shares, words / shares] float32 as the state [S, *shape]."""
    s, share = words.shape[0], state.split(shares)
    axis, pieces = state.axis + 1, []
    x = words.reshape(s, shares, *share.shape)
    for part in jnp.split(x, list(itertools.accumulate(share.part_sizes))[:-1], axis=axis + 1):
        part = jnp.moveaxis(part, 1, axis)
        shape = part.shape
        pieces.append(part.reshape(shape[:axis] + (-1,) + shape[axis + 2:]))
    return jnp.concatenate(pieces, axis=axis)


def read_states(kv, blocks: jax.Array, shapes: Shapes) -> tuple[jax.Array, ...]:
    """The states in pages `blocks` [S, n] of the cache array pair kv: one float32
    [S, *shape] per entry of `shapes`."""
    s, shares = blocks.shape[0], state_shares(kv[0].shape[0], shapes)
    rows = _page_rows(kv, blocks, shares)
    words = _words(rows.reshape(s * shares, -1), state_words(shapes) // shares)
    words = words.reshape(s, shares, -1)
    start, out = 0, []
    for state in shapes:
        size = math.prod(state.shape) // shares
        out.append(_from_shares(words[..., start:start + size], state, shares))
        start += size
    return tuple(out)


def write_states(kv, blocks: jax.Array, states: tuple[jax.Array, ...], shapes: Shapes):
    """kv with `states` (each [S, *shape] of `shapes`, in `read_states`' order) written over
    pages `blocks` [S, n] (out of range: not written), the rest of the pages zero."""
    s, n = blocks.shape
    shares = state_shares(kv[0].shape[0], shapes)
    sizes = [a[:, 0].size // shares for a in kv]  # elements of one share's slice of a page
    words = jnp.concatenate([_to_shares(x.astype(_F32), state, shares)
                             for x, state in zip(states, shapes)], axis=-1)
    elements = _elements(words.reshape(s * shares, -1), kv[0].dtype, n * sum(sizes))
    pages = jnp.split(elements.reshape(s, shares, n, -1), [sizes[0]], axis=-1)
    out = []
    for a, page in zip(kv, pages):
        heads, _, block_size, width = a.shape
        rows = page.reshape(s, shares, n, heads // shares, block_size, width)
        rows = jnp.transpose(rows, (1, 3, 0, 2, 4, 5)).reshape(heads, s, n, block_size, width)
        out.append(a.at[:, blocks].set(rows, mode="drop"))
    return tuple(out)
