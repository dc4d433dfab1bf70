"""The KV page allocator: reference counts over the pool's pages, and the prefix cache on top.

Every page is in exactly one state:
  used    referenced by at least one running sequence;
  cached  unreferenced, but holding the K/V of a full page whose content hash is known, so a later
          prompt that starts with the same tokens can take it instead of recomputing it;
  free    unreferenced and holding nothing reusable.
New pages come from the free pages first, then from the cached ones in least-recently-used order
(evicting one drops its hash). A sequence returns its pages tail first, so a chain's tail is
evicted before its head, and a cached page that gains a reader leaves the evictable set at once.
Page 0 is the null page: never handed out, it is where padding reads and writes.

One pool serves every KV-cache group (`jaxserve.model.kv_groups`): a page belongs to the group
that allocated it until it is free again, its content hash is looked up per group (the same
tokens are different K/V in another group's layers), and used and cached pages are counted per
group. Free pages belong to no group.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterable, Sequence

import numpy as np


def pages_for(num_tokens: int, page_size: int) -> int:
    """Pages needed to hold `num_tokens` tokens."""
    return -(-num_tokens // page_size)


class BlockManager:
    """Hands out pages and keeps the prefix cache: content hash -> page."""

    def __init__(self, num_pages: int, page_size: int, enable_caching: bool = True, num_groups: int = 1):
        if num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is the null page), got {num_pages}")
        if page_size <= 0:
            raise ValueError(f"page_size must be > 0, got {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_caching = enable_caching
        self.num_groups = num_groups
        self._free = list(range(num_pages - 1, 0, -1))  # pop() hands out low pages first
        self._refs = [0] * num_pages
        self._group = [0] * num_pages  # the group a used or cached page belongs to
        self._page_of: dict[tuple[int, bytes], int] = {}  # (group, content hash) -> cached or used page
        self._hash_of: dict[int, tuple[int, bytes]] = {}  # and back
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached pages, least recently used first
        self._used_in = [0] * num_groups  # used pages per group
        self._cached_in = [0] * num_groups  # cached pages per group

    @property
    def total_pages(self) -> int:
        """Pages that can be allocated (the null page excluded)."""
        return self.num_pages - 1

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def cached_pages(self) -> int:
        return len(self._evictable)

    @property
    def used_pages(self) -> int:
        return self.total_pages - self.free_pages - self.cached_pages

    def group_pages(self, group: int) -> tuple[int, int]:
        """(used, cached) pages of one group."""
        return self._used_in[group], self._cached_in[group]

    def page_states(self) -> np.ndarray:
        """Per page, the null page first: how many sequences read it (0: free), or -1 for a cached
        page. For dashboards: a copy, built in a few ms for 300k pages."""
        readers = np.array(self._refs, np.int32)
        unread = readers == 0
        unread[self._free] = False  # what stays unread and not free is cached (or the null page)
        unread[0] = False
        readers[unread] = -1
        return readers

    def can_allocate(self, n: int, keeping: Sequence[int] = ()) -> bool:
        """Whether n new pages can be had while the pages in `keeping` (about to gain a reader)
        stay out of the eviction."""
        kept = sum(1 for p in keeping if p in self._evictable) if keeping else 0
        return n <= len(self._free) + len(self._evictable) - kept

    def allocate(self, n: int, group: int = 0) -> list[int]:
        """n pages for `group`, each with one reference: free pages first, then the least recently
        used cached ones (of any group)."""
        if not self.can_allocate(n):
            raise RuntimeError(f"asked for {n} KV pages, only {len(self._free) + len(self._evictable)} available")
        pages = []
        for _ in range(n):
            if self._free:
                page = self._free.pop()
            else:
                page, _ = self._evictable.popitem(last=False)
                del self._page_of[self._hash_of.pop(page)]
                self._cached_in[self._group[page]] -= 1
            self._refs[page] = 1
            self._group[page] = group
            pages.append(page)
        self._used_in[group] += n
        return pages

    def share(self, pages: Iterable[int]) -> None:
        """Adds a reader to pages already used or cached (a prefix-cache hit)."""
        for p in pages:
            if self._refs[p] == 0 and p not in self._evictable:
                raise RuntimeError(f"page {p} holds nothing to share")
            if p in self._evictable:  # a cached page is read again
                del self._evictable[p]
                self._cached_in[self._group[p]] -= 1
                self._used_in[self._group[p]] += 1
            self._refs[p] += 1

    def free(self, pages: Iterable[int]) -> None:
        """Drops one reference from each page, in the order given: an unreferenced page becomes
        cached (most recently used) if it holds a known hash, else free."""
        for p in pages:
            if p == 0 or self._refs[p] == 0:
                raise RuntimeError(f"page {p} is not allocated")
            self._refs[p] -= 1
            if self._refs[p] == 0:
                self._used_in[self._group[p]] -= 1
                if p in self._hash_of:
                    self._evictable[p] = None
                    self._cached_in[self._group[p]] += 1
                else:
                    self._free.append(p)

    # ---- the prefix cache ----

    def lookup(self, hashes: Iterable[bytes], group: int = 0) -> list[int]:
        """The pages of `group` holding the longest run of `hashes` from the first (no side effects)."""
        pages = []
        for h in hashes:
            page = self._page_of.get((group, h))
            if page is None:
                break
            pages.append(page)
        return pages

    def cached_page(self, content_hash: bytes, group: int = 0) -> int | None:
        """The page of `group` holding `content_hash`, if any (no side effects)."""
        return self._page_of.get((group, content_hash))

    def cache(self, page: int, content_hash: bytes, group: int = 0) -> bool:
        """Records that a used page of `group` now holds the full page `content_hash`; returns
        whether it did. A hash already held by another page keeps that page; this one stays
        unhashed and is freed as usual."""
        key = (group, content_hash)
        if not self.enable_caching or page in self._hash_of or key in self._page_of:
            return False
        self._page_of[key] = page
        self._hash_of[page] = key
        return True

    def forget(self, pages: Iterable[int]) -> None:
        """Forgets the content hashes of `pages` (their K/V may never have been written): a
        cached one becomes free, a used one is freed, not cached, later."""
        for p in pages:
            key = self._hash_of.pop(p, None)
            if key is None:
                continue
            del self._page_of[key]
            if p in self._evictable:
                del self._evictable[p]
                self._cached_in[self._group[p]] -= 1
                self._free.append(p)

    def reset_prefix_cache(self) -> None:
        """Forgets every content hash, for when the pool's K/V are gone (a fresh pool after a
        failed step): cached pages become free, and used pages are freed, not cached, later."""
        self._free.extend(self._evictable)
        self._evictable.clear()
        self._page_of.clear()
        self._hash_of.clear()
        self._cached_in = [0] * self.num_groups
