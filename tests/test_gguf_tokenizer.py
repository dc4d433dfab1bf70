"""The tokenizer rebuilt from GGUF metadata against transformers' tokenizer for the same file."""

from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("gguf")

from jaxserve.model.gguf_loader import open_gguf  # noqa: E402
from jaxserve.model.gguf_tokenizer import chat_template_from_gguf, tokenizer_from_gguf  # noqa: E402

TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "",
    " ",
    " leading space",
    "trailing space ",
    "multiple   spaces    and\ttabs\t\there",
    "line one\nline two\n\n\nafter three newlines\r\nwindows",
    "        eight spaces of indentation",
    "Ünïcödé: café, naïve, Straße, Ångström",
    "日本語のテキスト、中文文本，한국어 텍스트",
    "Русский текст и ελληνικά",
    "emoji 😀🎉👩‍👩‍👧‍👦 and flags 🇫🇷🇯🇵",
    "def f(x):\n    return {'a': [1, 2, 3], \"b\": x ** 2}  # comment\n",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    "numbers 1234567890 3.14159 -42 1e-6 0xFF",
    "<start_of_turn>user\nWhat is JAX?<end_of_turn>\n<start_of_turn>model\n",
    "<bos>literal special tokens<eos> inside <pad> text",
    "[multimodal] user-defined token",
    "rare bytes \x00\x07 and control \u200b zero-width",
    "a" * 300,
    "mixed\u00a0nbsp and\u2003em space",
]


@pytest.fixture(scope="module")
def ours(gemma3_path):
    return tokenizer_from_gguf(gemma3_path)


@pytest.fixture(scope="module")
def hf(gemma3_path):
    """transformers' tokenizer for the file: the class AutoTokenizer picks for it, named, since
    AutoTokenizer reads the GGUF's 262k-token vocabulary once more for the config (32 s, not 9)."""
    transformers = pytest.importorskip("transformers")
    folder, name = os.path.split(gemma3_path)
    return transformers.GemmaTokenizer.from_pretrained(folder, gguf_file=name)


@pytest.mark.slow
def test_same_tokenizer_definition(ours, hf):
    """Same model (vocab, merges), normalizer, pre-tokenizer, decoder, post-processor, added tokens."""
    assert json.loads(ours.to_str()) == json.loads(hf.backend_tokenizer.to_str())


@pytest.mark.slow
@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_hf(ours, hf, text):
    want = hf(text).input_ids  # BOS added, as tokenizer.ggml.add_bos_token says
    got = ours.encode(text).ids
    assert got == want
    assert got[:1] == [2]
    plain = ours.encode(text, add_special_tokens=False).ids
    assert plain == hf(text, add_special_tokens=False).input_ids
    assert ours.decode(got, skip_special_tokens=False) == hf.decode(want)
    assert ours.decode(got, skip_special_tokens=True) == hf.decode(want, skip_special_tokens=True)


@pytest.mark.slow
@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(ours, text):
    assert ours.decode(ours.encode(text, add_special_tokens=False).ids, skip_special_tokens=False) == text


@pytest.mark.slow
def test_special_tokens(ours, gemma3_path):
    meta = open_gguf(gemma3_path).metadata
    assert [ours.token_to_id(t) for t in ("<pad>", "<eos>", "<bos>", "<unk>")] == [0, 1, 2, 3]
    assert (meta["tokenizer.ggml.bos_token_id"], meta["tokenizer.ggml.eos_token_id"],
            meta["tokenizer.ggml.padding_token_id"]) == (2, 1, 0)
    ids = ours.encode("<start_of_turn>user\nhi<end_of_turn>", add_special_tokens=False).ids
    assert ids[0] == ours.token_to_id("<start_of_turn>") and ours.token_to_id("<end_of_turn>") in ids
    assert ours.get_vocab_size() == 262144


@pytest.mark.slow
def test_gemma_file_has_no_chat_template(gemma3_path):
    assert chat_template_from_gguf(gemma3_path) is None


def test_tiny_llama_tokenizer_and_chat_template(tmp_path):
    """A Llama-2-style vocabulary (prefix space, merges ranked by score) and a stored chat template."""
    gguf = pytest.importorskip("gguf")
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    pieces = ["\u2581", "h", "e", "l", "o", "w", "r", "d", "he", "ll", "llo", "hello", "\u2581hello", "\u2581w",
              "or", "\u2581wor", "ld", "\u2581world"]
    tokens += pieces
    scores = [0.0, 0.0, 0.0] + [0.0] * 256 + [-float(i) for i in range(len(pieces))]
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    path = str(tmp_path / "tok.gguf")
    w = gguf.GGUFWriter(path, "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(True)
    w.add_chat_template(template)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()

    tok = tokenizer_from_gguf(path)
    assert tok.encode("hello world").tokens == ["<s>", "\u2581hello", "\u2581world"]
    assert tok.decode(tok.encode("hello world").ids, skip_special_tokens=True) == "hello world"
    bytes_ids = tok.encode("hé", add_special_tokens=False).tokens
    assert bytes_ids == ["\u2581", "h", "<0xC3>", "<0xA9>"]  # byte fallback for the missing é
    assert tok.decode(tok.encode("hé").ids, skip_special_tokens=True) == "hé"
    assert chat_template_from_gguf(path) == template
    # The same answer from a gguf.GGUFReader.
    reader = gguf.GGUFReader(path)
    assert tokenizer_from_gguf(reader).encode("hello world").ids == tok.encode("hello world").ids
    assert chat_template_from_gguf(reader) == template

    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="tok.gguf")
    for text in ("hello world", "world hello", " hello", "héllo wörld"):
        assert tok.encode(text).ids == hf(text).input_ids, text


def test_unsupported_tokenizer_model(tmp_path):
    gguf = pytest.importorskip("gguf")
    path = str(tmp_path / "bert.gguf")
    w = gguf.GGUFWriter(path, "llama")
    w.add_tokenizer_model("bert")
    w.add_token_list(["[PAD]", "a"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    with pytest.raises(ValueError, match="'bert'"):
        tokenizer_from_gguf(path)


@pytest.mark.slow
def test_gemma_chat_prompt_starts_with_one_bos(ours, hf):
    """The built-in Gemma 3 template writes the BOS (chat prompts are encoded without special
    tokens): the prompt is Gemma's turn format, and its ids are what HF's tokenizer gives the
    same turns with its BOS."""
    from jaxserve.entrypoints.chat_template import ChatTemplates
    from jaxserve.model.loader import GEMMA3_CHAT_TEMPLATE
    from jaxserve.tokenizer import Tokenizer
    tok = Tokenizer(ours, GEMMA3_CHAT_TEMPLATE)
    assert tok.bos_token == "<bos>"
    messages = [{"role": "user", "content": "What is JAX?"}, {"role": "assistant", "content": "A library."},
                {"role": "user", "content": "More?"}]
    text, _ = ChatTemplates(tok, "builtin:gemma3").render(messages)
    turns = ("<start_of_turn>user\nWhat is JAX?<end_of_turn>\n<start_of_turn>model\nA library.<end_of_turn>\n"
             "<start_of_turn>user\nMore?<end_of_turn>\n<start_of_turn>model\n")
    assert text == "<bos>" + turns
    assert tok.encode(text, add_special_tokens=False) == hf(turns).input_ids
