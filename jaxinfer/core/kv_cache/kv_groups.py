"""KV groups: which layers share a block table, and which cache array each layer uses.

A model whose layers attend differently (Gemma 2/3 and gpt-oss mix sliding-window layers with
full-attention ones) needs different blocks kept per layer kind: a full-attention layer keeps
every block of a sequence, a layer with a window of w tokens only the blocks a future query can
still see. Layers that attend alike share one *group*: one block table per sequence, blocks freed
together. This is vLLM V1's hybrid allocator (``kv_cache_groups``, one ``SingleTypeKVCacheManager``
per group), built the same way so every group draws from one pool:

- all groups have the same number of layers, ``num_slots`` (a kind with more layers is split into
  several groups of that size; the last one may be short);
- the device cache has ``num_slots`` K/V array pairs, each ``[heads, num_blocks, block, dim]``;
  a layer's K/V lives in array ``layer_slot[l]`` at the blocks of group ``layer_group[l]``;
- a block id therefore means ``num_slots`` layer-pages, owned by one group at a time: freeing a
  local group's block hands all those pages to whichever group allocates it next.

So a block holds ``num_slots`` layers' pages (not ``num_layers``), and a sequence of n tokens takes
``ceil(n / block)`` blocks per full group and about ``(window + block) / block`` per local group.
The only inputs are the layers' windows; nothing here knows a model family.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from jaxinfer.model.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class KVCacheGroups:
    windows: tuple[int | None, ...]   # per group: its sliding window in tokens, None = full
    layer_group: tuple[int, ...]      # per layer: its group
    layer_slot: tuple[int, ...]       # per layer: the cache array it reads and writes
    num_slots: int                    # cache arrays (layers per group)

    @classmethod
    def full_attention(cls, num_layers: int) -> KVCacheGroups:
        """One group, one array per layer: every layer keeps every block (the classic layout)."""
        return cls((None,), (0,) * num_layers, tuple(range(num_layers)), num_layers)

    @classmethod
    def from_layer_windows(cls, windows: Sequence[int | None]) -> KVCacheGroups:
        """Groups for layers with these windows (None = full attention): full-attention groups
        first, then windows ascending; each kind split into groups of ``num_slots`` layers, the
        size of the smallest kind (vLLM's rule: no group is padded by more than the split)."""
        if not windows:
            raise ValueError("a model needs at least one layer")
        for w in windows:
            if w is not None and (not isinstance(w, int) or w < 1):
                raise ValueError(f"layer window {w!r} must be a positive int or None")
        kinds: dict[int | None, list[int]] = {}
        for layer, w in enumerate(windows):
            kinds.setdefault(w, []).append(layer)
        if len(kinds) == 1 and None in kinds:
            return cls.full_attention(len(windows))
        size = min(len(layers) for layers in kinds.values())
        order = sorted(kinds, key=lambda w: (w is not None, w or 0))
        group_windows: list[int | None] = []
        layer_group = [0] * len(windows)
        layer_slot = [0] * len(windows)
        for w in order:
            layers = kinds[w]
            for start in range(0, len(layers), size):
                for slot, layer in enumerate(layers[start:start + size]):
                    layer_group[layer] = len(group_windows)
                    layer_slot[layer] = slot
                group_windows.append(w)
        return cls(tuple(group_windows), tuple(layer_group), tuple(layer_slot), size)

    @classmethod
    def for_model(cls, cfg: ModelConfig, hybrid: bool = True) -> KVCacheGroups:
        """The model's groups from its layers' windows; `hybrid` False (--no-hybrid-kv-cache):
        one group, every layer keeping every block (the windows still apply in the kernels)."""
        if not hybrid:
            return cls.full_attention(cfg.num_layers)
        return cls.from_layer_windows([cfg.layer_window(i) for i in range(cfg.num_layers)])

    @property
    def kv_layout(self) -> tuple[tuple[int, int], ...] | None:
        """Per layer (cache array, group) for AttentionMetadata.kv_layout; None for one group."""
        if self.num_groups == 1:
            return None
        return tuple(zip(self.layer_slot, self.layer_group))

    def blocks_for_sequence(self, num_tokens: int, chunk: int, block_size: int) -> int:
        """The most blocks one sequence of `num_tokens` holds at once when its prompt is computed
        in chunks of at most `chunk` tokens: a windowed group holds its window plus the chunk
        (it skips blocks only before a chunk starts), and one block for alignment."""
        full = -(-num_tokens // block_size)
        total = 0
        for w in self.windows:
            total += full if w is None else min(full, -(-(min(chunk, num_tokens) + w) // block_size) + 1)
        return total

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def num_layers(self) -> int:
        return len(self.layer_group)

    @property
    def is_hybrid(self) -> bool:
        """Whether any group drops blocks (some layer has a window)."""
        return any(w is not None for w in self.windows)

    def first_needed_block(self, group: int, first_query_pos: int, block_size: int) -> int:
        """The first block of `group` a query at `first_query_pos` or later can still see: keys at
        p - window < j <= p (HF's convention), so blocks before it can go. 0 for full groups."""
        w = self.windows[group]
        if w is None:
            return 0
        return max(first_query_pos - w + 1, 0) // block_size

    def tokens_held(self, num_tokens: int, block_size: int) -> int:
        """Block-tokens (pages x block_size, over all groups) one sequence of `num_tokens` tokens
        holds once its out-of-window blocks are freed, its next query at `num_tokens`."""
        total_blocks = -(-num_tokens // block_size)
        held = 0
        for g in range(self.num_groups):
            held += total_blocks - min(self.first_needed_block(g, num_tokens, block_size),
                                       total_blocks)
        return held * block_size
