"""KV groups: which layers share a block table, and which cache array each layer uses.

Each layer has a KV-cache spec (kv_specs.py, from ``ModelConfig.layer_kv_specs``): full
attention keeps every block of a sequence, a sliding window of w tokens only the blocks a future
query can still see, and so on. Layers with equal specs share one *group*: one block table per
sequence, blocks freed together by the spec's rule. This is vLLM V1's hybrid allocator
(``kv_cache_groups``, one ``SingleTypeKVCacheManager`` per group), built the same way so every
group draws from one pool:

- all groups have the same number of layers, ``num_slots`` (a kind with more layers is split into
  several groups of that size; the last one may be short);
- the device cache has ``num_slots`` K/V array pairs, each ``[heads, num_blocks, block, dim]``;
  a layer's K/V lives in array ``layer_slot[l]`` at the blocks of group ``layer_group[l]``;
- a block id therefore means ``num_slots`` layer-pages, owned by one group at a time: freeing a
  local group's block hands all those pages to whichever group allocates it next. So every
  group's page must have the same size (the arrays have one shape): specs whose pages differ
  are refused (docs/feature_matrix.md).

So a block holds ``num_slots`` layers' pages (not ``num_layers``), and a sequence of n tokens takes
``ceil(n / block)`` blocks per full group and about ``(window + block) / block`` per local group.
The only inputs are the layers' specs; nothing here knows a model family.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from jaxinfer.model.config import ModelConfig
from jaxinfer.model.kv_specs import FixedStateSpec, FullAttentionSpec, KVCacheSpec, SlidingWindowSpec

# The page shape `from_layer_windows` gives its specs: only the layout is asked of those groups.
_LAYOUT_ONLY = FullAttentionSpec(1, 1)


@dataclasses.dataclass(frozen=True)
class KVCacheGroups:
    specs: tuple[KVCacheSpec, ...]    # per group: what its layers keep
    layer_group: tuple[int, ...]      # per layer: its group
    layer_slot: tuple[int, ...]       # per layer: the cache array it reads and writes
    num_slots: int                    # cache arrays (layers per group)

    @classmethod
    def full_attention(cls, num_layers: int,
                       spec: KVCacheSpec = _LAYOUT_ONLY) -> KVCacheGroups:
        """One group, one array per layer: every layer keeps every block (the classic layout)."""
        return cls((spec.keeping_every_block(),), (0,) * num_layers, tuple(range(num_layers)),
                   num_layers)

    @classmethod
    def from_layer_windows(cls, windows: Sequence[int | None]) -> KVCacheGroups:
        """The layout of layers with these windows (None = full attention), their pages all of
        one (unit) shape: for callers that know only the windows."""
        for w in windows:
            if w is not None and (not isinstance(w, int) or w < 1):
                raise ValueError(f"layer window {w!r} must be a positive int or None")
        return cls.from_layer_specs([
            _LAYOUT_ONLY if w is None else SlidingWindowSpec(1, 1, sliding_window=w)
            for w in windows])

    @classmethod
    def from_layer_specs(cls, specs: Sequence[KVCacheSpec]) -> KVCacheGroups:
        """Groups for layers with these specs: kinds that keep every block first, then by span
        (window, chunk) ascending; each kind split into groups of ``num_slots`` layers, the size
        of the smallest kind (vLLM's rule: no group is padded by more than the split). Raises
        ValueError when the kinds' pages differ in size (one block id spans a page of each)."""
        if not specs:
            raise ValueError("a model needs at least one layer")
        kinds: dict[KVCacheSpec, list[int]] = {}
        for layer, spec in enumerate(specs):
            kinds.setdefault(spec, []).append(layer)
        if len(kinds) == 1 and specs[0].keeps_every_block:
            return cls.full_attention(len(specs), specs[0])
        # Compared at two block sizes: a page that does not grow with the block (a fixed state)
        # never matches one that does, whatever the engine's block size.
        pages = {(spec.page_bytes(1, "int8"), spec.page_bytes(16, "float32")) for spec in kinds}
        if len(pages) > 1:
            raise ValueError(f"layers whose cache pages differ in size cannot share one block "
                             f"pool: {sorted(kinds, key=str)}")
        size = min(len(layers) for layers in kinds.values())
        order = sorted(kinds, key=lambda s: (s.rank, s.span))
        group_specs: list[KVCacheSpec] = []
        layer_group = [0] * len(specs)
        layer_slot = [0] * len(specs)
        for spec in order:
            layers = kinds[spec]
            for start in range(0, len(layers), size):
                for slot, layer in enumerate(layers[start:start + size]):
                    layer_group[layer] = len(group_specs)
                    layer_slot[layer] = slot
                group_specs.append(spec)
        return cls(tuple(group_specs), tuple(layer_group), tuple(layer_slot), size)

    @classmethod
    def for_model(cls, cfg: ModelConfig, hybrid: bool = True) -> KVCacheGroups:
        """The model's groups from its layers' specs; `hybrid` False (--no-hybrid-kv-cache):
        one group, every layer keeping every block (the windows still apply in the kernels)."""
        specs = cfg.layer_kv_specs()
        if not hybrid:
            return cls.from_layer_specs([s.keeping_every_block() for s in specs])
        return cls.from_layer_specs(specs)

    @property
    def windows(self) -> tuple[int | None, ...]:
        """Per group its sliding window in tokens (None: any other kind)."""
        return tuple(spec.window for spec in self.specs)

    @property
    def page_spec(self) -> KVCacheSpec:
        """A spec whose page every cache array has (all groups' pages are of one size)."""
        return self.specs[0]

    def page_bytes(self, block_size: int, dtype) -> int:
        """A block's bytes: one page of each of the ``num_slots`` cache arrays."""
        return self.num_slots * self.page_spec.page_bytes(block_size, dtype)

    @property
    def kv_layout(self) -> tuple[tuple[int, int], ...] | None:
        """Per layer (cache array, group) for AttentionMetadata.kv_layout; None for one group."""
        if self.num_groups == 1:
            return None
        return tuple(zip(self.layer_slot, self.layer_group))

    def blocks_for_sequence(self, num_tokens: int, chunk: int, block_size: int,
                            dtype=None) -> int:
        """The most blocks one sequence of `num_tokens` holds at once when its prompt is computed
        in chunks of at most `chunk` tokens, summed over the groups (KVCacheSpec's rule each:
        a windowed group holds its window plus the chunk and one block for alignment, a fixed
        state's group the pages of its state in a cache of `dtype`)."""
        return sum(spec.blocks_for_sequence(num_tokens, chunk, block_size, dtype)
                   for spec in self.specs)

    def table_width(self, max_model_len: int, block_size: int, dtype, multiple: int = 1) -> int:
        """A block table's columns: a sequence's blocks at `max_model_len`, or a fixed state's
        pages where more, rounded up to a `multiple` (KernelTable.table_columns)."""
        width = max([-(-max_model_len // block_size)] + [
            n for n in self.state_pages(block_size, dtype) if n is not None])
        return -(-width // multiple) * multiple

    def state_pages(self, block_size: int, dtype) -> tuple[int | None, ...]:
        """Per group the blocks a sequence holds from its first token on (a fixed state's
        pages), None for groups whose blocks come with the tokens (KVCacheManager's tables)."""
        return tuple(spec.state_pages(block_size, dtype) for spec in self.specs)

    @property
    def num_groups(self) -> int:
        return len(self.specs)

    @property
    def frees_token_blocks(self) -> bool:
        """Whether a group whose blocks come with the tokens (not a fixed state's) frees some (a
        window, a chunk): a prefix node's entry there may be gone, so the node's blocks are no
        whole prefix block (the host tier needs whole ones)."""
        return any(not spec.keeps_every_block and n is None
                   for spec, n in zip(self.specs, self.state_pages(1, "float32")))

    @property
    def num_layers(self) -> int:
        return len(self.layer_group)

    @property
    def has_fixed_state(self) -> bool:
        """Whether some group is a state-space layer's fixed state (FixedStateSpec)."""
        return any(isinstance(spec, FixedStateSpec) for spec in self.specs)

    @property
    def is_hybrid(self) -> bool:
        """Whether any group drops blocks (some layer has a window, chunk or state)."""
        return not all(spec.keeps_every_block for spec in self.specs)

    def first_needed_block(self, group: int, first_query_pos: int, block_size: int) -> int:
        """The first block of `group` a query at `first_query_pos` or later can still see, so
        blocks before it can go (the group's spec decides; 0 for groups keeping every block)."""
        return self.specs[group].first_needed_block(first_query_pos, block_size)

    def tokens_held(self, num_tokens: int, block_size: int, dtype=None) -> int:
        """Block-tokens (pages x block_size, over all groups) one sequence of `num_tokens` tokens
        holds once its out-of-window blocks are freed, its next query at `num_tokens` (a fixed
        state's group: its state's pages in a cache of `dtype`)."""
        total_blocks = -(-num_tokens // block_size)
        held = 0
        for g, spec in enumerate(self.specs):
            if spec.state_pages(block_size, dtype) is not None:
                held += spec.blocks_for_sequence(num_tokens, num_tokens, block_size, dtype)
                continue
            held += total_blocks - min(self.first_needed_block(g, num_tokens, block_size),
                                       total_blocks)
        return held * block_size
