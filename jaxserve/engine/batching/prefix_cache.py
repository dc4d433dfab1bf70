"""The prefix cache as the scheduler uses it: the leading pages of a prompt found in the cache
(by content hash, `page_hash`), the pages a running request is computing that another may wait
for, and recording a request's pages once they are full of computed tokens known on the host.
The pages and hashes themselves are the block manager's (per KV-cache group: `kv_cache_manager`).
"""

from __future__ import annotations

from typing import Sequence

from jaxserve.engine.batching.block_manager import BlockManager
from jaxserve.engine.batching.kv_cache_manager import KVCacheManager
from jaxserve.engine.batching.page_hash import page_hashes
from jaxserve.engine.batching.request import Request


class PrefixCache:
    def __init__(self, blocks: BlockManager, kv: KVCacheManager):
        self.blocks, self.kv = blocks, kv
        self._computing: dict[bytes, Request] = {}  # full prompt pages being computed, by hash

    def hits(self, request: Request) -> tuple[int, list[list[int]], list[bytes]]:
        """The leading pages of the request's prompt found in the cache, each group's block table
        for them, and the hashes of the pages that may be looked up: the full pages before its
        last token (which is always computed)."""
        if not self.blocks.enable_caching:
            return 0, [[] for _ in range(self.kv.num_groups)], []
        hashes = page_hashes(request, (request.num_tokens - 1) // self.blocks.page_size, self.blocks.page_size)
        return *self.kv.cache_hits(hashes), hashes

    def being_computed(self, hashes: Sequence[bytes], hit: int) -> bool:
        """Whether the page after the `hit` found ones is being computed by a running request."""
        return hit < len(hashes) and hashes[hit] in self._computing

    def claim(self, request: Request, hashes: Sequence[bytes]) -> None:
        """The admitted request computes these pages (unless another already does)."""
        for h in hashes:
            self._computing.setdefault(h, request)

    def behind(self, request: Request) -> bool:
        """Whether the request has computed a full page that is not recorded yet."""
        return self.blocks.enable_caching and \
            request.num_computed_tokens // self.blocks.page_size > request.num_cached_pages

    def record(self, request: Request) -> list[int]:
        """Records the request's pages that are now full of computed tokens known on the host;
        returns them."""
        start = request.num_cached_pages
        full = min(request.num_computed_tokens,
                   request.num_prompt_tokens + len(request.output_token_ids)) // self.blocks.page_size
        if full <= start or not self.blocks.enable_caching:
            return []  # no page filled since (the common case)
        hashes = page_hashes(request, full, self.blocks.page_size)
        pages = self.kv.cache_pages(request, hashes, start)
        if self._computing:  # prompt pages other requests may be waiting for
            self._unclaim(request, hashes[start:])
        request.num_cached_pages = full
        return pages

    def release(self, request: Request) -> None:
        """The request computes nothing any more (finished or preempted)."""
        self._unclaim(request, request.page_hashes)

    def _unclaim(self, request: Request, hashes: Sequence[bytes]) -> None:
        for h in hashes:
            if self._computing.get(h) is request:
                del self._computing[h]
