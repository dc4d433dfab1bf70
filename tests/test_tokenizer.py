"""The Tokenizer wrapper: read on first use, and pickled as its file's path."""

import pickle

from tokenizers import Tokenizer as HFTokenizer

from conftest import build_tokenizer
from jaxserve.tokenizer import Tokenizer

TEXT = "the quick brown fox jumps over the lazy dog"


def test_a_tokenizer_file_is_read_on_first_use_and_pickles_as_its_path(tmp_path):
    build_tokenizer(str(tmp_path))
    reference = HFTokenizer.from_file(str(tmp_path / "tokenizer.json"))
    tok = Tokenizer.from_dir(str(tmp_path))
    assert "_tok" not in vars(tok)  # not read yet: the engine process of `serve` never reads it
    blob = pickle.dumps(tok)
    assert len(blob) < 1000 < (tmp_path / "tokenizer.json").stat().st_size  # the path, not the JSON
    copy = pickle.loads(blob)
    assert copy.encode(TEXT) == tok.encode(TEXT) == reference.encode(TEXT).ids
    assert "_tok" in vars(tok) and (copy.bos_token, copy.eos_token) == ("<s>", "</s>")
    assert len(pickle.dumps(tok)) == len(blob)  # still the path once read


def test_a_tokenizer_object_pickles_whole(tmp_path):
    build_tokenizer(str(tmp_path))
    reference = HFTokenizer.from_file(str(tmp_path / "tokenizer.json"))
    blob = pickle.dumps(Tokenizer(reference))
    (tmp_path / "tokenizer.json").unlink()  # the copy needs no file
    copy = pickle.loads(blob)
    assert copy.encode(TEXT) == reference.encode(TEXT).ids and copy.bos_token == "<s>"
