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
        self._array: np.ndarray | None = None  # the ids counted, rebuilt after a change

    def of(self, request: Request) -> tuple[int, ...]:
        """The ids that end `request`."""
        return request.params.stop_token_ids + (() if request.params.ignore_eos else self.eos_token_ids)

    def add(self, request: Request) -> None:
        self._counts.update(self.of(request))
        self._array = None

    def remove(self, request: Request) -> None:
        self._counts.subtract(self.of(request))
        self._array = None

    def among(self, tokens: np.ndarray) -> np.ndarray:
        """Where `tokens` holds an id that ends some unfinished request (whose, the caller checks)."""
        if self._array is None:
            self._array = np.fromiter((t for t, n in self._counts.items() if n > 0), np.int64)
        return np.isin(tokens, self._array)
