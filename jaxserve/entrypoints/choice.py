"""A choice of a response, whatever the endpoint: the output of one engine request, which
serving_completion.py and serving_chat.py write out in their own shapes."""

from __future__ import annotations

from jaxserve.engine.output_processor import OutputText
from jaxserve.tokenizer import DECODE_CONTEXT, texts_after


class Choice:
    """The output of one engine request as the server answers it: its text (OutputText: the same
    stop-string cut as the engine's), and per-token text and logprobs when asked for."""

    def __init__(self, tokenizer, prompt_ids: list[int], stop: tuple[str, ...], include_stop: bool, logprobs: bool):
        self.tokenizer, self.want_logprobs = tokenizer, logprobs
        self.output = OutputText(tokenizer, prompt_ids, stop, include_stop)
        self.num_prompt_tokens = len(prompt_ids)
        self.num_cached_tokens = 0  # of the prompt, served from the prefix cache
        self.context = prompt_ids[-DECODE_CONTEXT:]  # for the text of alternative tokens
        self.pieces: list[str] = []  # per-token text, for logprobs
        self.offsets: list[int] = []
        self.logprobs: list[float | None] = []
        self.tops: list[list[tuple[str, float]]] = []
        self.finish_reason: str | None = None
        self.error: str | None = None  # why it ended with `error`, when the API process knows
        self.invalid: str | None = None  # why the engine ended it with `error` for its own input
        self.emitted_tokens = 0

    @property
    def num_tokens(self) -> int:
        return self.output.num_tokens

    def add(self, token_ids: list[int], logprobs: list[dict] | None, finish_reason: str | None,
            num_cached_tokens: int, error: str | None = None, invalid: str | None = None) -> None:
        """Takes one step's new tokens (a Delta's fields)."""
        self.num_cached_tokens = num_cached_tokens
        if not self.want_logprobs:  # the common case: one decode for the whole step
            self.output.add(token_ids)
        else:
            for i, token in enumerate(token_ids):
                lp = logprobs[i] if logprobs else {"logprob": None, "top": []}
                self.offsets.append(len(self.output.text))
                piece = self.output.add([token])
                self.pieces.append(piece if self.tokenizer is not None else f"token_id:{token}")
                self.logprobs.append(lp["logprob"])
                texts = self._token_texts([t for t, _ in lp["top"]])
                self.tops.append([(text, v) for text, (_, v) in zip(texts, lp["top"])])
                self.context = (self.context + [token])[-DECODE_CONTEXT:]
        if finish_reason is not None:
            self.finish_reason, self.error, self.invalid = finish_reason, error, invalid

    def _token_texts(self, tokens: list[int]) -> list[str]:
        """The text each of `tokens` would add after the recent context."""
        if self.tokenizer is None:
            return [f"token_id:{t}" for t in tokens]
        return texts_after(self.tokenizer, self.context, [[t] for t in tokens])

    @property
    def final_text(self) -> str:
        return self.output.final_text

    def new_text(self) -> str:
        """Text not yet streamed that is safe to send."""
        return self.output.new_text(self.finish_reason is not None)
