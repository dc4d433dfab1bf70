"""Content hashes of full KV pages, chained so that a page's hash names its whole prefix.

hash(page i) = SHA-256(hash(page i - 1), the page's token ids, the request's cache salt)

A strong hash, so a collision can never serve another prompt's K/V; the salt keeps tenants that
pass different `cache_salt`s from ever sharing a page. A partly filled page has no hash.
"""

from __future__ import annotations

import hashlib
from array import array
from typing import Sequence

ROOT = b""  # the parent of a sequence's first page
_SHA256 = hashlib.sha256()  # copied for each page: cheaper than a new one, which looks the algorithm up again


def hash_page(parent: bytes, token_ids: Sequence[int], salt: str | None) -> bytes:
    digest = _SHA256.copy()
    digest.update(parent)
    digest.update(array("q", token_ids).tobytes())
    digest.update(b"\0" if salt is None else b"\1" + salt.encode())
    return digest.digest()


def page_hashes(request, num_pages: int, page_size: int) -> list[bytes]:
    """A Request's first `num_pages` page hashes, computed once and kept on it (`page_hashes`)."""
    hashes = request.page_hashes
    for i in range(len(hashes), num_pages):
        hashes.append(hash_page(hashes[i - 1] if i else ROOT, request.token_ids(i * page_size, (i + 1) * page_size),
                                request.cache_salt))
    return hashes[:num_pages]
