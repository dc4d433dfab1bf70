"""OutputText, the stop-string cut that the engine and the server share, with exact texts."""

from __future__ import annotations

from jaxserve.engine.output_processor import OutputText


class Letters:
    """A tokenizer whose token i is the character chr(i)."""

    def decode(self, ids):
        return "".join(map(chr, ids))


def ids(text: str) -> list[int]:
    return list(map(ord, text))


def test_a_stop_string_split_across_steps_cuts_the_text_where_it_starts():
    out = OutputText(Letters(), ids("ab"), stop=("STOP", "xyz"))
    assert out.add(ids("hello S")) == "hello S" and not out.stopped
    assert out.new_text(finished=False) == "hell"  # "o S" may start "STOP": 3 characters held back
    out.add(ids("TO"))
    assert out.new_text(finished=False) == "o " and not out.stopped
    out.add(ids("P and on"))
    assert out.stopped and out.final_text == "hello "
    assert out.new_text(finished=False) == ""  # nothing past the stop is ever sent
    assert out.new_text(finished=True) == "" and out.num_tokens == 17


def test_the_earliest_stop_wins_and_include_stop_keeps_it():
    out = OutputText(Letters(), ids("q"), stop=("cd", "b"), include_stop=True)
    out.add(ids("abcd"))
    assert out.final_text == "ab"
    out.add(ids("b"))  # text after the first stop changes nothing
    assert out.final_text == "ab" and out.text == "abcdb"


def test_without_stop_strings_everything_is_sent_at_once():
    out = OutputText(Letters(), ids("q"))
    out.add(ids("xyz"))
    assert not out.stopped and out.new_text(finished=False) == "xyz" and out.new_text(finished=False) == ""


def test_without_a_tokenizer_only_tokens_are_counted():
    out = OutputText(None, [1, 2], stop=("a",))
    assert out.add([3, 4]) == "" and out.num_tokens == 2 and out.final_text == "" and not out.stopped
