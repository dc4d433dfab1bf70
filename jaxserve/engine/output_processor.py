"""Outputs as users see them. `OutputText`: one request's text, detokenized as its tokens arrive,
and cut at the first of its stop strings; `OutputProcessor`: the engine's requests as
RequestOutputs, ended when their text holds a stop string. The one place stop strings are
applied: the engine ends a request with them (`OutputProcessor`), and the server cuts and streams
the text with the same `OutputText`.

    tokens ─► add() ─► IncrementalDetokenizer delta ─► text ─► stopped? ─► final_text (cut)
                                                                         └► new_text() (streamed, a
                                                                            possible stop's start held back)
"""

from __future__ import annotations

import logging

from jaxserve.engine.batching.request import FinishReason, Request, RequestOutput
from jaxserve.faults import faults
from jaxserve.tokenizer import DECODE_CONTEXT, IncrementalDetokenizer, Tokenizer, decode_after, first_stop

log = logging.getLogger(__name__)


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


class OutputProcessor:
    """Requests as users see them: the text of each, and its stop strings, which end it. Only
    requests with stop strings are detokenized every step; the others once, when asked. A request
    whose stop-string pass or text raises ends alone with `error`."""

    def __init__(self, tokenizer: Tokenizer | None):
        self.tokenizer = tokenizer
        self._texts: dict[str, OutputText] = {}  # requests with stop strings: their text so far

    def add(self, request: Request) -> None:
        if request.params.stop:
            self._texts[request.request_id] = OutputText(self.tokenizer, request.prompt_token_ids,
                                                         request.params.stop)

    def release(self, request_id: str) -> None:
        self._texts.pop(request_id, None)

    def apply_stop_strings(self, requests: dict[str, Request], finish) -> list[Request]:
        """Detokenizes the new tokens of the requests that have stop strings and ends, through
        `finish(request, reason)`, those whose text now holds one; returns them."""
        finished = []
        for request_id, text in self._texts.items():
            request = requests[request_id]
            if text.stopped or len(request.output_token_ids) == text.num_tokens:
                continue
            try:
                if faults.armed:
                    faults.check("stop_strings", request_id)
                _add_until_stopped(text, request)
                if text.stopped:
                    if not request.finished:
                        finish(request, FinishReason.STOP)
                        finished.append(request)
                    elif request.finish_reason is FinishReason.LENGTH:
                        request.finish_reason = FinishReason.STOP  # the last token completed a stop string
            except Exception:  # noqa: BLE001 — this request's text failed, not the engine: it ends with `error`
                log.exception("request %s: its pass for stop strings failed", request_id)
                if not request.finished:
                    finish(request, FinishReason.ERROR)
                    finished.append(request)
        return finished

    def output(self, r: Request, finish) -> RequestOutput:
        """The current state of a request as a RequestOutput. If its text cannot be had, it ends
        (through `finish(request, reason)`, if running) or is marked with `error`, its text empty."""
        try:
            text = self._text(r)
        except Exception:  # noqa: BLE001 — this request's text failed: it alone ends with `error`
            log.exception("request %s: detokenizing its output failed", r.request_id)
            finish(r, FinishReason.ERROR)
            r.finish_reason, text = FinishReason.ERROR, ""
        return RequestOutput(
            request_id=r.request_id, prompt_token_ids=r.prompt_token_ids, token_ids=list(r.output_token_ids),
            text=text, finish_reason=r.finish_reason.value if r.finish_reason else None,
            ttft_s=None if r.first_token_time is None else r.first_token_time - r.arrival_time,
            latency_s=None if r.finish_time is None else r.finish_time - r.arrival_time,
            logprobs=list(r.logprobs) if r.params.logprobs is not None else None,
            num_cached_tokens=r.num_cached_tokens or 0, error=r.error)

    def _text(self, r: Request) -> str:
        if faults.armed:
            faults.check("detokenize", r.request_id)
        text = self._texts.get(r.request_id)
        if text is not None and text.stopped:
            return text.final_text
        if self.tokenizer is None:
            return ""
        return decode_after(self.tokenizer, r.prompt_token_ids[-DECODE_CONTEXT:], r.output_token_ids)


def _add_until_stopped(text: OutputText, request: Request) -> None:
    """Adds a request's new tokens to its text. Several at once (kept speculative drafts) go one
    by one, and a stop string completed before the last of them cuts the output there."""
    new = request.output_token_ids[text.num_tokens:]
    if len(new) == 1:
        text.add(new)
        return
    for token in new:
        text.add([token])
        if text.stopped:
            request.keep_output(text.num_tokens)
            return
