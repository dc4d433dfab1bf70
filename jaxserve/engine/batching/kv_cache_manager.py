"""Each request's block table in every KV-cache group, over the one shared BlockManager.

A group (see `jaxserve.model.kv_groups`) is full attention (window None) or a sliding window of w
tokens: a query at position p sees the keys at positions p - w + 1 .. p. `request.pages[g]` is the
request's table in group g: entry i holds its tokens [i S, (i + 1) S), or is the null page (0)
once no query can see them any more. What the scheduler asks of it:

  drop_out_of_window  before a step: a sliding group frees the pages wholly before
                      `num_computed_tokens - w + 1` (the first key the next query sees); their
                      entries become the null page, and a page with a content hash becomes cached
                      (evictable, still found by the prefix cache), not lost
  pages_to_add, grow  the pages a request needs before it runs: a full group holds every token
                      (a prompt is reserved whole at admission), a sliding group only the tokens
                      one step can reach (`computed + step_tokens`), so a long prompt never
                      reserves what its local layers will free
  cache_hits          the longest prefix of cached pages every group can serve: all its pages in
                      a full group, only those its window still sees in a sliding one
  cache_pages, release

Page accounting is the BlockManager's: one pool, one LRU of cached pages, counts per group.
"""

from __future__ import annotations

from typing import Sequence

from jaxserve.engine.batching.block_manager import BlockManager, pages_for
from jaxserve.engine.batching.request import Request


def first_in_window(window: int | None, position: int, page_size: int) -> int:
    """The first page a query at `position` can see (0 for full attention)."""
    return 0 if window is None else max(0, position - window + 1) // page_size


def pages_per_sequence(windows: Sequence[int | None], page_size: int, length: int, step_tokens: int) -> int:
    """The most pages one sequence of `length` tokens holds at once, over all groups: a full group
    every page, a sliding group at most its window, a step's tokens and a partial page at each end."""
    full = pages_for(length, page_size)
    return sum(full if w is None else min(full, pages_for(w - 1 + step_tokens, page_size) + 1) for w in windows)


class KVCacheManager:
    """Block tables per KV-cache group: `windows[g]` is group g's sliding window (None: full)."""

    def __init__(self, blocks: BlockManager, windows: Sequence[int | None] = (None,), step_tokens: int = 1 << 30):
        if blocks.num_groups != len(windows):
            raise ValueError(f"the block manager counts {blocks.num_groups} groups, the model has {len(windows)}")
        self.blocks = blocks
        self.windows = tuple(windows)
        self.step_tokens = step_tokens  # the most tokens one step runs for a request
        self.page_size = blocks.page_size

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def has_windows(self) -> bool:
        """Whether some group is a sliding window (only those drop pages as sequences grow)."""
        return any(w is not None for w in self.windows)

    def _table_len(self, group: int, computed: int, end: int) -> int:
        """Entries group `group` needs to hold tokens up to `end` of a request that computed `computed`."""
        window = self.windows[group]
        return pages_for(end if window is None else min(end, computed + self.step_tokens), self.page_size)

    def pages_to_add(self, lengths: Sequence[int], computed: int, end: int) -> int:
        """New pages, over all groups, for a request whose tables have `lengths` entries and which
        has computed `computed` tokens, to hold its tokens up to `end` (no side effects)."""
        total = 0
        for g, window in enumerate(self.windows):
            start = max(lengths[g], first_in_window(window, computed, self.page_size))
            total += max(0, self._table_len(g, computed, end) - start)
        return total

    def grow(self, request: Request, end: int) -> bool:
        """Gives the request the pages `pages_to_add` counts (they must be available); entries a
        window no longer sees are the null page. Returns whether a table changed."""
        if not request.pages:
            request.pages = [[] for _ in self.windows]
        changed, computed = False, request.num_computed_tokens
        for g, (window, table) in enumerate(zip(self.windows, request.pages)):
            stop = self._table_len(g, computed, end)
            skip = min(first_in_window(window, computed, self.page_size), stop)
            if len(table) < skip:
                table.extend([0] * (skip - len(table)))
            if len(table) < stop:
                table.extend(self.blocks.allocate(stop - len(table), g))
                changed = True
        request.num_table_tokens = min(map(len, request.pages)) * self.page_size
        return changed

    def drop_out_of_window(self, request: Request) -> list[tuple[int, int]]:
        """Frees the pages each sliding group's window has left behind (oldest first, so they are
        evicted first); returns the (group, index) entries that became the null page. Entries
        before the window are the null page already, so the scan stops at the first one. Sets
        `request.next_window_drop`: until it has computed that many tokens, no window leaves a
        page behind (the scheduler skips it)."""
        computed, page_size = request.num_computed_tokens, self.page_size
        request.next_window_drop = min(((first_in_window(w, computed, page_size) + 1) * page_size + w - 1
                                        for w in self.windows if w is not None), default=1 << 62)
        nulled = []
        for g, (window, table) in enumerate(zip(self.windows, request.pages)):
            if window is None:
                continue
            i = min(first_in_window(window, request.num_computed_tokens, self.page_size), len(table)) - 1
            dropped = []
            while i >= 0 and table[i]:
                dropped.append(table[i])
                nulled.append((g, i))
                table[i] = 0
                i -= 1
            if dropped:
                self.blocks.free(reversed(dropped))
        return nulled

    def release(self, request: Request) -> None:
        """Frees every page of the request, each group's tail first (evicted before its head)."""
        for table in request.pages:
            self.blocks.free([p for p in reversed(table) if p])
        request.pages, request.num_table_tokens, request.next_window_drop = [], 0, 0

    # ---- the prefix cache ----

    def cache_pages(self, request: Request, hashes: Sequence[bytes], start: int) -> list[int]:
        """Records the request's pages start.. len(hashes) in every group's prefix cache (a null
        entry holds nothing to record); returns the pages recorded."""
        return [table[i] for g, table in enumerate(request.pages) for i in range(start, len(hashes))
                if table[i] and self.blocks.cache(table[i], hashes[i], g)]

    def cache_hits(self, hashes: Sequence[bytes]) -> tuple[int, list[list[int]]]:
        """(n, tables): the longest run of leading pages `hashes[:n]` that every group can serve,
        and each group's block table for it. A full group must hold all n pages; a sliding group
        only those a query at position n S still sees, the entries before them the null page."""
        n = len(hashes)
        for g, window in enumerate(self.windows):
            if window is None:
                n = min(n, len(self.blocks.lookup(hashes[:n], g)))
        found = {g: [self.blocks.cached_page(h, g) for h in hashes[:n]]
                 for g, window in enumerate(self.windows) if window is not None}
        last_missing = {}  # per sliding group: [i] the last page before i it does not hold, or -1
        for g, pages in found.items():
            last, missing = [-1], -1
            for i, page in enumerate(pages):
                missing = i if page is None else missing
                last.append(missing)
            last_missing[g] = last
        while n and any(last_missing[g][n] >= first_in_window(self.windows[g], n * self.page_size, self.page_size)
                        for g in found):
            n -= 1
        tables = []
        for g, window in enumerate(self.windows):
            if window is None:
                tables.append(self.blocks.lookup(hashes[:n], g))
            else:
                skip = first_in_window(window, n * self.page_size, self.page_size)
                tables.append([0] * skip + found[g][skip:n])
        return n, tables
