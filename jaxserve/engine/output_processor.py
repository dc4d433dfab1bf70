"""One request's output text: detokenized as its tokens arrive, and cut at the first of its stop
strings. The one place stop strings are applied: the engine ends a request when its text holds
one (`Engine`), and the server cuts and streams the text (`completion_job.Choice`).

    tokens ─► add() ─► IncrementalDetokenizer delta ─► text ─► stopped? ─► final_text (cut)
                                                                         └► new_text() (streamed, a
                                                                            possible stop's start held back)
"""

from __future__ import annotations

from jaxserve.tokenizer import IncrementalDetokenizer, Tokenizer, first_stop


class OutputText:
    def __init__(self, tokenizer: Tokenizer | None, prompt_ids: list[int], stop=(), include_stop: bool = False):
        self.detok = IncrementalDetokenizer(tokenizer, prompt_ids) if tokenizer is not None else None
        self.stop, self.include_stop = tuple(stop), include_stop
        self.text = ""  # all generated text, before the cut
        self.num_tokens = 0  # tokens added so far
        self.emitted = 0  # characters of final_text already given out by new_text()
        self._stop: tuple[int, str] | None = None  # (index, stop string) of the first stop in text

    def add(self, token_ids: list[int]) -> str:
        """Appends tokens; returns the text they completed (possibly empty)."""
        delta = self.detok.add(token_ids) if self.detok is not None and token_ids else ""
        self.text += delta
        self.num_tokens += len(token_ids)
        if delta and self.stop and self._stop is None:
            # A stop string can start in earlier text: search back as far as the longest one reaches.
            start = max(0, len(self.text) - len(delta) - max(map(len, self.stop)) + 1)
            hit = first_stop(self.text[start:], self.stop)
            if hit is not None:
                self._stop = (start + hit[0], hit[1])
        return delta

    @property
    def stopped(self) -> bool:
        """Whether the text holds one of the stop strings."""
        return self._stop is not None

    @property
    def final_text(self) -> str:
        """The text up to the first stop string (with it, if `include_stop`)."""
        if self._stop is None:
            return self.text
        i, s = self._stop
        return self.text[: i + len(s)] if self.include_stop else self.text[:i]

    def new_text(self, finished: bool) -> str:
        """Text not yet given out that is safe to send: while unfinished, the end that could be
        the start of a stop string is held back."""
        text = self.final_text
        if not finished and self.stop and not self.stopped:
            text = text[: len(text) - (max(map(len, self.stop)) - 1)]
        new = text[self.emitted:]
        self.emitted = max(self.emitted, len(text))
        return new
