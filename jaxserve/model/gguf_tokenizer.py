"""A `tokenizers.Tokenizer` rebuilt from a GGUF file's tokenizer metadata.

A GGUF carries no tokenizer.json, only llama.cpp's description of the vocabulary:
`tokenizer.ggml.model`, `.tokens`, `.scores`, `.token_type`, the special token ids and the
add-BOS/EOS flags. For the SentencePiece family (`model == "llama"`: Gemma, Llama 2, Mistral) the
tokenizer is a BPE with byte fallback whose merges are implied by the vocabulary; we rebuild it the
way Hugging Face transformers does (`AutoTokenizer.from_pretrained(dir, gguf_file=...)`) so token
ids agree with it exactly, without importing transformers:

- merges: every split of a token into two tokens of the vocabulary, ranked best-first by the
  token's score -- except for Gemma, whose scores do not follow its merge order, so its rank is the
  token's position in the file;
- Gemma stores runs of spaces as real spaces; they are respelled with "▁" like every other piece;
- Gemma: spaces become "▁" and no prefix space is added; Llama 2 style: "▁" is prepended to the
  first word unless `tokenizer.ggml.add_space_prefix` is false;
- control tokens (type 3) and the unknown token are special added tokens, user-defined ones
  (type 4) plain added tokens, so both are matched whole in the text;
- BOS (and EOS) are added by the post-processor as the add_bos/add_eos flags say.
"""

from __future__ import annotations

import os
from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import BPE

from jaxserve.model.gguf_loader import GGUFFile, open_gguf

# llama.cpp token types.
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

_GEMMA_ARCHS = ("gemma", "gemma2", "gemma3")


def _metadata(path_or_reader) -> tuple[dict[str, Any], str]:
    """Metadata dict and a name for messages, from a path, a GGUFFile or a gguf.GGUFReader."""
    if isinstance(path_or_reader, GGUFFile):
        return path_or_reader.metadata, path_or_reader.path
    if isinstance(path_or_reader, (str, os.PathLike)):
        f = open_gguf(path_or_reader)
        return f.metadata, f.path
    try:  # a gguf.GGUFReader
        fields = path_or_reader.fields
    except AttributeError:
        raise TypeError(f"expected a path, GGUFFile or gguf.GGUFReader, got {type(path_or_reader).__name__}") from None
    return {key: field.contents() for key, field in fields.items()}, str(getattr(path_or_reader, "data", "<gguf>"))


def chat_template_from_gguf(path_or_reader) -> str | None:
    """The Jinja chat template stored in `tokenizer.chat_template`, or None when the file has none."""
    meta, _ = _metadata(path_or_reader)
    template = meta.get("tokenizer.chat_template")
    return str(template) if template else None


def _generate_merges(vocab: dict[str, int], ranks: dict[str, float]) -> list[tuple[str, str]]:
    """Every split of a token into two vocabulary pieces, best rank first (higher rank = earlier).

    Ties keep the order of `ranks`, then shorter left and right pieces first, exactly as
    transformers' `generate_merges` orders them.
    """
    merges = []
    for token, rank in ranks.items():
        local = []
        for i in range(1, len(token)):
            left, right = token[:i], token[i:]
            if left in vocab and right in vocab:
                local.append((left, right, rank))
        if len(local) > 1:
            local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        merges.extend(local)
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def _sentencepiece_bpe(meta: dict[str, Any], arch: str, path: str) -> Tokenizer:
    tokens = list(meta["tokenizer.ggml.tokens"])
    gemma = arch in _GEMMA_ARCHS
    if gemma:
        # A run of spaces is stored as real spaces; the model looks pieces up spelled with "▁".
        tokens = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]
        ranks = {t: -i for i, t in enumerate(tokens)}  # merge order = order in the file
    else:
        if "tokenizer.ggml.scores" not in meta:
            raise ValueError(f"{path}: tokenizer.ggml.scores is missing")
        ranks = dict(zip(tokens, (float(s) for s in meta["tokenizer.ggml.scores"])))
    vocab = {t: i for i, t in enumerate(tokens)}
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if unk_id is not None else None
    tok = Tokenizer(BPE(vocab=vocab, merges=_generate_merges(vocab, ranks), unk_token=unk, fuse_unk=True,
                        byte_fallback=True, dropout=None))
    decoder_steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if gemma:
        tok.normalizer = normalizers.Replace(" ", "\u2581")
        tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous", invert=False)
    else:
        prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581",
                                                     prepend_scheme="first" if prefix else "never", split=False)
        if prefix:
            decoder_steps.append(decoders.Strip(content=" ", left=1))
    tok.decoder = decoders.Sequence(decoder_steps)
    return tok


def _add_special_tokens(tok: Tokenizer, meta: dict[str, Any], original_tokens: list[str]) -> None:
    types = meta.get("tokenizer.ggml.token_type")
    if types is None:
        return
    types = [int(t) for t in types]
    special = [AddedToken(t, normalized=False, special=True)
               for t, kind in zip(original_tokens, types) if kind in (CONTROL, UNKNOWN)]
    tok.add_special_tokens(special)
    vocab = tok.get_vocab()
    # User-defined tokens are matched whole; ones whose spelling the vocabulary changed (runs of
    # spaces in Gemma) stay ordinary BPE pieces, as in transformers.
    plain = [AddedToken(t, normalized=False, special=False)
             for t, kind in zip(original_tokens, types) if kind == USER_DEFINED and t in vocab]
    tok.add_tokens(plain)


def _post_processor(tok: Tokenizer, meta: dict[str, Any], tokens: list[str], path: str) -> None:
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", meta.get("tokenizer.ggml.model") == "llama"))
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    ends: dict[str, tuple[str, int]] = {}
    for flag, key in ((add_bos, "bos"), (add_eos, "eos")):
        if not flag:
            continue
        token_id = meta.get(f"tokenizer.ggml.{key}_token_id")
        if token_id is None:
            raise ValueError(f"{path}: tokenizer.ggml.add_{key}_token is set but {key}_token_id is missing")
        ends[key] = (tokens[token_id], int(token_id))
    if not ends:
        return
    bos = f"{ends['bos'][0]}:0 " if "bos" in ends else ""
    eos = f" {ends['eos'][0]}:0" if "eos" in ends else ""
    bos1 = f"{ends['bos'][0]}:1 " if "bos" in ends else ""
    eos1 = f" {ends['eos'][0]}:1" if "eos" in ends else ""
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos}$A:0{eos}",
        pair=f"{bos}$A:0{eos} {bos1}$B:1{eos1}",
        special_tokens=list(dict.fromkeys(ends.values())),
    )


def tokenizer_from_gguf(path_or_reader) -> Tokenizer:
    """Builds the `tokenizers.Tokenizer` a GGUF file describes (see the module docstring).

    `path_or_reader` is a path, a `GGUFFile` from `open_gguf`, or a `gguf.GGUFReader`. Raises
    ValueError for a tokenizer model other than the SentencePiece-style "llama" one.
    """
    meta, path = _metadata(path_or_reader)
    model = meta.get("tokenizer.ggml.model")
    if "tokenizer.ggml.tokens" not in meta:
        raise ValueError(f"{path}: the file has no tokenizer (tokenizer.ggml.tokens is missing)")
    if model != "llama":
        raise ValueError(f"{path}: GGUF tokenizer model {model!r} is not supported (supported: 'llama', "
                         "the SentencePiece-style BPE of Gemma and Llama 2)")
    arch = str(meta.get("general.architecture", ""))
    original = list(meta["tokenizer.ggml.tokens"])
    tok = _sentencepiece_bpe(meta, arch, path)
    _add_special_tokens(tok, meta, original)
    _post_processor(tok, meta, original, path)
    return tok
