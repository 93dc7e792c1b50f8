"""Per-layer KV-cache specs: what one layer keeps in the paged cache, and the rules that follow.

One frozen dataclass per kind of layer state (vLLM V1's ``kv_cache_interface.py``, with the
freeing and prefix-matching rules of its ``single_type_kv_cache_manager.py`` folded in):

- ``FullAttentionSpec``: K and V of every head for every token; keeps every block.
- ``SlidingWindowSpec``: a query at p sees keys p - window < j <= p (HF's convention); blocks
  wholly before that window are freed.
- ``ChunkedLocalAttentionSpec``: a query sees the keys of its own chunk of
  ``attention_chunk`` tokens (Llama 4's local layers); blocks of finished chunks are freed.
- ``MLAAttentionSpec``: one latent per token shared by every head, K and V at once (DeepSeek;
  the V array is empty); keeps every block.
- ``FixedStateSpec``: a state of fixed size per sequence (state-space layers), split over a
  fixed number of blocks a sequence holds from start to end (``state_pages``). Beside
  attention layers its page is theirs (``page_of``), the state spanning as many as it needs.

Every spec answers the same questions, so nothing above it asks which kind a layer is:
``page_bytes`` (bytes per block per layer), ``first_needed_block`` (blocks before it can be
freed), ``keeps_every_block`` (the prefix cache's leaf-first order and the host tier need it),
``blocks_for_sequence`` (sizing), ``state_pages`` (blocks held whatever the length) and, for
attention, ``stored_widths`` (the K and V arrays' widths; the copies between caches carry them
side by side, model/kv_block_rows.py). A prefix match resuming at block n needs exactly blocks
[first_needed_block(n * block_size), n), which is how
``prefix_cache.PrefixCache.match`` reads these specs.

The model's layers get their specs from ``ModelConfig.layer_kv_specs`` (config.py), the one
place that reads a family's attention kinds. This module sits in model/ because the layers
below core/ (the model among them) may not import core/; ``core/kv_cache`` re-exports it.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import ClassVar

import numpy as np


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _itemsize(dtype) -> int:
    return np.dtype(dtype).itemsize


# A float32 state word in a cache of narrower elements takes 6 bytes of them (six fp8 elements
# of 6 bits, three 16-bit ones of 12): every element then stands for a finite value, so an
# attention kernel that reads a stale state element at a masked position (p = 0) multiplies it
# to 0, never 0 x NaN (state_pages.py).
NARROW_BYTES_PER_STATE_WORD = 6


def stored_state_bytes(state_bytes: int, dtype) -> int:
    """The cache bytes that a float32 state of `state_bytes` takes in a cache of `dtype`."""
    if dtype is not None and _itemsize(dtype) < 4:
        return state_bytes // 4 * NARROW_BYTES_PER_STATE_WORD
    return state_bytes


@dataclasses.dataclass(frozen=True)
class KVCacheSpec(abc.ABC):
    """What one layer keeps per block. Subclasses set the rules; equal specs share a group."""
    # Groups are ordered by (rank, span): kinds that keep every block first, as vLLM does.
    rank: ClassVar[int] = 0
    label: ClassVar[str] = "KV"  # the kind, for messages ("a {label} cache")

    @property
    def span(self) -> int:
        """The tokens a query can still reach back (window or chunk); 0 for kinds keeping all."""
        return 0

    @property
    def keeps_every_block(self) -> bool:
        return True

    @property
    def window(self) -> int | None:
        """The sliding window in tokens, None for any other kind (KVCacheGroups.windows)."""
        return None

    @abc.abstractmethod
    def page_bytes(self, block_size: int, dtype) -> int:
        """Bytes one block of this layer takes in a cache of element type `dtype`."""

    def first_needed_block(self, first_query_pos: int, block_size: int) -> int:
        """The first block a query at `first_query_pos` or later still reads: the blocks before
        it can be freed (and a prefix match need not find them)."""
        return 0

    def blocks_for_sequence(self, num_tokens: int, chunk: int, block_size: int,
                            dtype=None) -> int:
        """The most blocks one sequence of `num_tokens` holds at once when its prompt is computed
        in chunks of at most `chunk` tokens (blocks are freed only before a chunk starts), in a
        cache of element type `dtype` (only a fixed state's page count depends on it)."""
        return _cdiv(num_tokens, block_size)

    def state_pages(self, block_size: int, dtype) -> int | None:
        """The blocks a sequence holds in this layer's group from its first token on, whatever
        its length (a fixed state's); None where blocks come with the tokens."""
        return None

    def keeping_every_block(self) -> KVCacheSpec:
        """This layer's spec with every block kept (--no-hybrid-kv-cache; its kernel still
        applies its window): same page, no freeing."""
        return self


@dataclasses.dataclass(frozen=True)
class AttentionSpec(KVCacheSpec):
    """Attention layers: pages of K and V rows, [heads, block, width] each."""

    @property
    @abc.abstractmethod
    def num_kv_heads(self) -> int:
        """Heads the cache stores per token."""

    @property
    @abc.abstractmethod
    def stored_widths(self) -> tuple[int, int]:
        """Widths of one head's K and V rows in the cache arrays."""

    @property
    def values_in_keys(self) -> bool:
        """Whether the V rows are read out of the K rows (no V array of its own): K's fp8 scale
        then serves both."""
        return self.stored_widths[1] == 0

    def page_bytes(self, block_size: int, dtype) -> int:
        """block_size tokens of every stored head's K and V."""
        return block_size * self.num_kv_heads * sum(self.stored_widths) * _itemsize(dtype)


@dataclasses.dataclass(frozen=True)
class FullAttentionSpec(AttentionSpec):
    """Every head's K and V for every token (Llama, Qwen, Mistral without a window, ...)."""
    label: ClassVar[str] = "full-attention KV"
    kv_heads: int
    head_dim: int

    def __post_init__(self):
        if self.kv_heads < 1 or self.head_dim < 1:
            raise ValueError(f"{type(self).__name__}: kv_heads and head_dim must be >= 1 "
                             f"(got {self.kv_heads}, {self.head_dim})")

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads

    @property
    def stored_widths(self) -> tuple[int, int]:
        return (self.head_dim, self.head_dim)

    def keeping_every_block(self) -> KVCacheSpec:
        return FullAttentionSpec(self.kv_heads, self.head_dim)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SlidingWindowSpec(FullAttentionSpec):
    """A query at p sees keys p - window < j <= p (Gemma 2/3's and gpt-oss's local layers)."""
    sliding_window: int
    rank: ClassVar[int] = 1
    label: ClassVar[str] = "sliding-window KV"

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.sliding_window, int) or self.sliding_window < 1:
            raise ValueError(f"sliding window {self.sliding_window!r} must be a positive int")

    @property
    def span(self) -> int:
        return self.sliding_window

    @property
    def keeps_every_block(self) -> bool:
        return False

    @property
    def window(self) -> int | None:
        return self.sliding_window

    def first_needed_block(self, first_query_pos: int, block_size: int) -> int:
        return max(first_query_pos - self.sliding_window + 1, 0) // block_size

    def blocks_for_sequence(self, num_tokens: int, chunk: int, block_size: int,
                            dtype=None) -> int:
        # The window plus the chunk computed at once, and one block for alignment.
        held = _cdiv(min(chunk, num_tokens) + self.sliding_window, block_size) + 1
        return min(_cdiv(num_tokens, block_size), held)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChunkedLocalAttentionSpec(FullAttentionSpec):
    """A query at p sees the keys of its chunk, (p // chunk) * chunk <= j <= p (Llama 4's local
    layers, ``attention_chunk_size``): the blocks of finished chunks are freed."""
    attention_chunk: int
    rank: ClassVar[int] = 2
    label: ClassVar[str] = "chunked local attention KV"

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.attention_chunk, int) or self.attention_chunk < 1:
            raise ValueError(f"attention chunk {self.attention_chunk!r} must be a positive int")

    @property
    def span(self) -> int:
        return self.attention_chunk

    @property
    def keeps_every_block(self) -> bool:
        return False

    def first_needed_block(self, first_query_pos: int, block_size: int) -> int:
        return first_query_pos // self.attention_chunk * self.attention_chunk // block_size

    def blocks_for_sequence(self, num_tokens: int, chunk: int, block_size: int,
                            dtype=None) -> int:
        # A computed chunk reaches back at most one attention chunk, and one block for alignment.
        held = _cdiv(min(chunk, num_tokens) + self.attention_chunk, block_size) + 1
        return min(_cdiv(num_tokens, block_size), held)


@dataclasses.dataclass(frozen=True)
class MLAAttentionSpec(AttentionSpec):
    """Multi-head latent attention: one latent of `latent_width` per token (the compressed KV and
    the rope key) for every head, stored as K with an empty V; its first `value_width` entries
    are what the heads sum as values. Its K rows are its V rows, so one fp8 scale serves both."""
    latent_width: int
    value_width: int
    label: ClassVar[str] = "MLA latent"

    def __post_init__(self):
        if not 0 < self.value_width <= self.latent_width:
            raise ValueError(f"MLA: value width {self.value_width} must be in "
                             f"(0, latent width {self.latent_width}]")

    @property
    def num_kv_heads(self) -> int:
        return 1

    @property
    def stored_widths(self) -> tuple[int, int]:
        return (self.latent_width, 0)


@dataclasses.dataclass(frozen=True)
class FixedStateSpec(KVCacheSpec):
    """A state of `state_bytes` per layer and sequence, whatever its length (a state-space
    layer's convolution and SSM state). A sequence holds `state_pages` blocks of its group from its
    first token to its end, the state split over them in table order and updated in place
    (state_pages.py), so no block is freed while it runs. Its prefix-cache entries are
    snapshots: the state after a block's last token, copied into `state_pages` blocks of their
    own (KVCacheManager), so a match resuming at block n needs block n - 1's snapshot only
    (`first_needed_block`).
    Alone, its page is the state (one block a sequence), so it shares a pool only with specs of
    equal page_bytes (KVCacheGroups refuses others). With `page_of` (a hybrid model's attention
    spec) its page is that spec's, whatever the block size: a state bigger than a page spans
    several (vLLM's hybrid allocator instead grows the attention block to the state's size)."""
    state_bytes: int
    page_of: AttentionSpec | None = None
    rank: ClassVar[int] = 3
    label: ClassVar[str] = "fixed-state"

    def __post_init__(self):
        if self.state_bytes < 1:
            raise ValueError(f"fixed state: state_bytes must be >= 1 (got {self.state_bytes})")

    @property
    def keeps_every_block(self) -> bool:
        return False

    def page_bytes(self, block_size: int, dtype) -> int:
        if self.page_of is not None:
            return self.page_of.page_bytes(block_size, dtype)
        return stored_state_bytes(self.state_bytes, dtype)

    def state_pages(self, block_size: int, dtype) -> int:
        """The blocks one sequence's state spans in a cache of element type `dtype`."""
        if dtype is None and self.page_of is not None:
            raise ValueError("a fixed state's pages depend on the cache dtype: pass `dtype`")
        return _cdiv(stored_state_bytes(self.state_bytes, dtype),
                     self.page_bytes(block_size, dtype))

    def first_needed_block(self, first_query_pos: int, block_size: int) -> int:
        # A query at a block boundary resumes from the snapshot of the block before it.
        return max(first_query_pos // block_size - 1, 0)

    def blocks_for_sequence(self, num_tokens: int, chunk: int, block_size: int,
                            dtype=None) -> int:
        return self.state_pages(block_size, dtype) if num_tokens > 0 else 0
