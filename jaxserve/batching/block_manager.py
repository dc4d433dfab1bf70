"""The KV page allocator: a free list and reference counts over the pool's pages.

Page 0 is the null page: never handed out, it is where padding reads and writes.
"""

from __future__ import annotations


def pages_for(num_tokens: int, page_size: int) -> int:
    """Pages needed to hold `num_tokens` tokens."""
    return -(-num_tokens // page_size)


class BlockManager:
    """Hands out pages; a page returns to the free list when its last reference is dropped."""

    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is the null page), got {num_pages}")
        if page_size <= 0:
            raise ValueError(f"page_size must be > 0, got {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self._free = list(range(num_pages - 1, 0, -1))  # pop() hands out low pages first
        self._refs = [0] * num_pages

    @property
    def total_pages(self) -> int:
        """Pages that can be allocated (the null page excluded)."""
        return self.num_pages - 1

    @property
    def free_pages(self) -> int:
        return len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        """n fresh pages, each with one reference."""
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} KV pages, only {len(self._free)} free")
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self._refs[p] = 1
        return pages

    def share(self, pages: list[int]) -> None:
        """Adds a reference to pages that another sequence now reads too."""
        for p in pages:
            if self._refs[p] == 0:
                raise RuntimeError(f"page {p} is not allocated")
            self._refs[p] += 1

    def free(self, pages: list[int]) -> None:
        """Drops one reference from each page; unreferenced pages become free."""
        for p in pages:
            if p == 0 or self._refs[p] == 0:
                raise RuntimeError(f"page {p} is not allocated")
            self._refs[p] -= 1
            if self._refs[p] == 0:
                self._free.append(p)
