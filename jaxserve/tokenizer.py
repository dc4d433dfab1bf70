"""Text <-> token ids through a `tokenizers` tokenizer, plus incremental detokenization."""

from __future__ import annotations

import functools
import json
import os

from tokenizers import Tokenizer as HFTokenizer


class Tokenizer:
    """Encodes with the tokenizer's own special-token rules (e.g. a BOS prefix) and decodes
    without special tokens."""

    def __init__(self, tokenizer: HFTokenizer | str, chat_template: str | None = None,
                 bos_token: str | None = None, eos_token: str | None = None):
        """`tokenizer`: a `tokenizers` tokenizer, or the path of a tokenizer.json, read on first use
        (`load()`). Reading Gemma 3's takes seconds and holds the GIL: the engine process of `serve`
        never reads it (the API process does the text), and a tokenizer from a file pickles as its
        path, so the process that unpickles it reads the file itself, while the engine warms up."""
        self._file = tokenizer if isinstance(tokenizer, str) else None
        if self._file is None:
            self._tok = tokenizer
        self.chat_template = chat_template
        self.chat_template_source = "model" if chat_template else None  # or "builtin:..." (the loader's)
        if bos_token is not None:
            self.bos_token = bos_token
        self.eos_token = eos_token

    @functools.cached_property
    def _tok(self) -> HFTokenizer:
        return HFTokenizer.from_file(self._file)

    def load(self) -> "Tokenizer":
        """Reads the tokenizer now (it is read on first use otherwise)."""
        self._tok  # noqa: B018 — the cached property's read
        return self

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if not (k == "_tok" and self._file)}

    @functools.cached_property
    def bos_token(self) -> str | None:
        """The special token this tokenizer's own rules put before a text (its BOS), if any."""
        plain = self._tok.encode("a", add_special_tokens=False).ids
        full = self._tok.encode("a", add_special_tokens=True).ids
        return self._tok.id_to_token(full[0]) if len(full) == len(plain) + 1 and full[1:] == plain else None

    @classmethod
    def from_dir(cls, path: str) -> "Tokenizer":
        """`tokenizer.json` (read on first use) and the chat template of `tokenizer_config.json`, if any."""
        file = os.path.join(path, "tokenizer.json")
        if not os.path.exists(file):
            raise FileNotFoundError(f"no tokenizer.json in {path}")
        config = {}
        config_file = os.path.join(path, "tokenizer_config.json")
        if os.path.exists(config_file):
            with open(config_file) as f:
                config = json.load(f)
        token = lambda v: v.get("content") if isinstance(v, dict) else v
        return cls(file, config.get("chat_template"), token(config.get("bos_token")), token(config.get("eos_token")))

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def to_str(self) -> str:
        """The tokenizer as `tokenizers` JSON (what llguidance builds its token trie from)."""
        return self._tok.to_str()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)


# Prompt ids decoded before new ones, so that a leading space survives tokenizers (SentencePiece)
# that drop it at the start of a decode.
DECODE_CONTEXT = 4


def decode_after(tokenizer: Tokenizer, context: list[int], ids: list[int]) -> str:
    """The text `ids` add after the `context` ids."""
    return texts_after(tokenizer, context, [ids])[0]


def texts_after(tokenizer: Tokenizer, context: list[int], candidates: list[list[int]]) -> list[str]:
    """The text each list of ids in `candidates` would add after the `context` ids (the context
    decoded once for all of them)."""
    start = len(tokenizer.decode(context))
    return [tokenizer.decode(context + ids)[start:] for ids in candidates]


def first_stop(text: str, stops) -> tuple[int, str] | None:
    """(index, stop string) of the earliest stop string in `text`, or None."""
    hits = [(i, s) for i, s in ((text.find(s), s) for s in stops) if i >= 0]
    return min(hits) if hits else None


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Decoding a short window of recent tokens and holding back text that ends in an incomplete
    UTF-8 sequence keeps each step O(1) while multi-token characters come out whole.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int]):
        self.tokenizer = tokenizer
        self.ids = list(prompt_ids[-DECODE_CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""
        self.num_added = 0  # generated tokens consumed so far

    def add(self, token_ids: list[int]) -> str:
        """Appends tokens; returns the newly completed text (possibly empty)."""
        self.ids.extend(token_ids)
        self.num_added += len(token_ids)
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset: self.read_offset])
        full = self.tokenizer.decode(self.ids[self.prefix_offset:])
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return ""
        delta = full[len(prefix):]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        self.text += delta
        return delta
