"""The token ids that end some unfinished request (its stop token ids, and EOS unless it ignores
it), counted over the requests, so that `commit` tests a step's tokens against all of them at once
and looks closely only at the rows that may end."""

from __future__ import annotations

from collections import Counter
from typing import Sequence

import numpy as np

from jaxserve.engine.batching.request import Request


class StopIds:
    def __init__(self, eos_token_ids: Sequence[int] = ()):
        self.eos_token_ids = tuple(eos_token_ids)
        self._counts: Counter[int] = Counter()  # per id: the unfinished requests it ends
        self._table: np.ndarray | None = None  # bool [max id + 2]: whether an id is counted; rebuilt after a change

    def of(self, request: Request) -> tuple[int, ...]:
        """The ids that end `request`."""
        return request.params.stop_token_ids + (() if request.params.ignore_eos else self.eos_token_ids)

    def add(self, request: Request) -> None:
        self._counts.update(self.of(request))
        self._table = None

    def remove(self, request: Request) -> None:
        self._counts.subtract(self.of(request))
        self._table = None

    def among(self, tokens: np.ndarray) -> np.ndarray:
        """Where `tokens` holds an id that ends some unfinished request (whose, the caller checks)."""
        if self._table is None:  # a lookup, 4x faster than np.isin; its last entry is False for every id past it
            ids = [t for t, n in self._counts.items() if n > 0]
            self._table = np.zeros(max(ids, default=-1) + 2, bool)
            self._table[ids] = True
        return self._table[np.minimum(tokens, len(self._table) - 1)]
