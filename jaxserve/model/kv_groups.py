"""KV-cache groups: which layers share a block table, and where each layer's K/V sits in a page.

Layers with the same attention kind (full attention, or a sliding window of w tokens) form
groups of equal size P. A page of the pool holds P layers' K/V for S tokens, and each group hands
its sequences pages of its own from the one shared pool: a full-attention group keeps every page
of a sequence, a sliding-window group drops (frees) the pages that fell out of its window.

    Gemma 3 270M: 15 local layers (window 512), 3 global  ->  P = 3: one full group, five sliding
    Llama: every layer global                             ->  P = L: one group (a page holds all)

P is the size of the smallest kind, so no group is padded when the kinds' sizes divide (as in
Gemma 2 and 3); otherwise the last group of a kind has unused slots. Layer i reads and writes pool
slot `layer_slot[i]` (the pool's second axis) through the block table of group `layer_group[i]`.
Pure Python: the scheduler takes the groups' windows, the model the per-layer placement.
"""

from __future__ import annotations

import dataclasses

from jaxserve.model.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class KVGroups:
    windows: tuple[int | None, ...]  # per group: its sliding window, None for full attention
    layer_group: tuple[int, ...]  # per layer: its group
    layer_slot: tuple[int, ...]  # per layer: its slot among the P layers of a page
    layers_per_page: int  # P

    @property
    def num_groups(self) -> int:
        return len(self.windows)


def kv_groups(cfg: ModelConfig) -> KVGroups:
    """The model's KV-cache groups: full-attention layers first, then each window size."""
    kinds: dict[int | None, list[int]] = {}
    for i, window in enumerate(cfg.layer_windows):
        kinds.setdefault(window, []).append(i)
    order = sorted(kinds, key=lambda w: (w is not None, w or 0))  # full attention is group 0
    per_page = min(len(layers) for layers in kinds.values())
    windows: list[int | None] = []
    group, slot = [0] * cfg.num_layers, [0] * cfg.num_layers
    for window in order:
        for j, layer in enumerate(kinds[window]):
            group[layer], slot[layer] = len(windows) + j // per_page, j % per_page
        windows += [window] * -(-len(kinds[window]) // per_page)
    return KVGroups(tuple(windows), tuple(group), tuple(slot), per_page)
