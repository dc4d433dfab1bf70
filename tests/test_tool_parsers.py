"""Tool-call parsers (tool_choice "auto"): Hermes blocks and Llama 3 JSON read from whole replies
and from streams cut anywhere, markers split across deltas, and text that is not a valid call
kept as content, exactly as written."""

from __future__ import annotations

import json
import random

import pytest

from jaxserve.entrypoints.tool_parsers import PARSERS, ToolCall, ToolCallStream

HERMES, LLAMA = PARSERS["hermes"], PARSERS["llama3_json"]
PARIS = ToolCall("get_weather", '{"city": "paris"}')
OSLO = ToolCall("get_weather", '{"city": "oslo", "days": 2}')
NOOP = ToolCall("noop", "{}")


def block(name: str, arguments, key: str = "arguments") -> str:
    return f'<tool_call>\n{json.dumps({"name": name, key: arguments})}\n</tool_call>'


HERMES_CASES = [
    ("the answer is 4", "the answer is 4", []),
    ("", "", []),
    (block("get_weather", {"city": "paris"}), None, [PARIS]),
    ("Let me check.\n\n" + block("get_weather", {"city": "paris"}), "Let me check.", [PARIS]),
    (block("get_weather", {"city": "paris"}) + "\n" + block("get_weather", {"city": "oslo", "days": 2}) + "\n",
     None, [PARIS, OSLO]),
    ('<tool_call>{"name": "noop"}</tool_call>', None, [NOOP]),  # no arguments: none
    ('<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"paris\\"}"}</tool_call>', None, [PARIS]),
    ("a " + block("get_weather", {"city": "paris"}) + " b", "ab", [PARIS]),
    ("  x " + block("noop", {}) + "\n\n  y  ", "  xy  ", [NOOP]),
    # not calls: kept as written
    ("see <tool_call>{not json}</tool_call> ok", "see <tool_call>{not json}</tool_call> ok", []),
    ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
    ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>', '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
     []),
    ("1 < 2 and <tool_calls> are <b>", "1 < 2 and <tool_calls> are <b>", []),
    (block("noop", {}) + '<tool_call>{"name": </tool_call>', '<tool_call>{"name": </tool_call>', [NOOP]),
    # the reply ends inside a block (max_tokens, a stop string)
    ('<tool_call>{"name": "noop", "arguments": {}}', None, [NOOP]),
    ('hi <tool_call>{"name": "noop", "argu', 'hi <tool_call>{"name": "noop", "argu', []),
    ("hi <tool_ca", "hi <tool_ca", []),
]

LLAMA_CASES = [
    ("the answer is 4", "the answer is 4", []),
    ('{"name": "get_weather", "parameters": {"city": "paris"}}', None, [PARIS]),
    ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "paris"}}', None, [PARIS]),
    (' {"name": "get_weather", "parameters": {"city": "paris"}}; {"name": "get_weather", "parameters": '
     '{"city": "oslo", "days": 2}};\n', None, [PARIS, OSLO]),
    ('{"name": "noop", "arguments": {}}', None, [NOOP]),
    ('{"name": "noop"}', None, [NOOP]),
    ('{"name": "noop", "parameters": {}} and then some', "and then some", [NOOP]),
    ('{"name": "noop", "parameters": {}}; {"name": "noop", "parameters": [', '{"name": "noop", "parameters": [',
     [NOOP]),
    ('{"name": "noop", "parameters": {}}; {"city": "paris"}', '{"city": "paris"}', [NOOP]),
    # not calls: kept as written
    ('{"city": "paris"}', '{"city": "paris"}', []),
    ('{"name": "noop", "parameters": {', '{"name": "noop", "parameters": {', []),
    ("<|python_tag|>print(1)", "<|python_tag|>print(1)", []),
    ('here: {"name": "noop", "parameters": {}}', 'here: {"name": "noop", "parameters": {}}', []),
    ("  <|pyth", "  <|pyth", []),
]


@pytest.mark.parametrize("text, content, calls", HERMES_CASES)
def test_hermes_reads_whole_replies(text, content, calls):
    assert HERMES.parse(text) == (content, calls)


@pytest.mark.parametrize("text, content, calls", LLAMA_CASES)
def test_llama3_json_reads_whole_replies(text, content, calls):
    assert LLAMA.parse(text) == (content, calls)


def streamed(parser, deltas: list[str]) -> list[tuple[str, list[ToolCall]]]:
    """What a stream sends after each delta (the last one ends the reply)."""
    stream = ToolCallStream(parser)
    return [stream.feed(d, final=i == len(deltas) - 1) for i, d in enumerate(deltas)]


@pytest.mark.parametrize("parser, cases", [(HERMES, HERMES_CASES), (LLAMA, LLAMA_CASES)], ids=["hermes", "llama3"])
def test_a_stream_cut_anywhere_adds_up_to_the_whole_reply(parser, cases):
    """Character by character, and at random cuts: the content sent adds up to the whole reply's
    content, and the calls come once each, in order."""
    rng = random.Random(0)
    for text, content, calls in cases:
        cuts = [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text) + [""]]
        for _ in range(20):
            points = sorted(rng.sample(range(len(text) + 1), min(4, len(text) + 1)))
            cuts.append([text[a:b] for a, b in zip([0] + points, points + [len(text)])])
        for deltas in cuts:
            sent = streamed(parser, deltas)
            assert "".join(c for c, _ in sent) == (content or ""), (text, deltas)
            assert [call for _, new in sent for call in new] == calls, (text, deltas)


def test_hermes_holds_back_a_marker_split_across_deltas():
    assert streamed(HERMES, ["Sure. <tool", "_ca", 'll>{"name": "noop", ', '"arguments": {}}</tool_', "call>", ""]) == [
        ("Sure.", []), ("", []), ("", []), ("", []), ("", [NOOP]), ("", [])]
    # what looked like a marker was text after all: sent once that is clear
    assert streamed(HERMES, ["a <tool", "box> b", ""]) == [("a", []), (" <toolbox> b", []), ("", [])]
    # an invalid block goes out as content when it closes, with the whitespace held before it
    assert streamed(HERMES, ["x ", "<tool_call>{oops}", "</tool_call>", " y"]) == [
        ("x", []), ("", []), (" <tool_call>{oops}</tool_call>", []), (" y", [])]


def test_llama3_json_sends_each_call_once_it_closes():
    assert streamed(LLAMA, ['{"name": "noop", ', '"parameters": {}}', "; ", '{"name": "get_weather", "parameters": '
                            '{"city": "paris"', "}}", ""]) == [
        ("", []), ("", [NOOP]), ("", []), ("", []), ("", [PARIS]), ("", [])]
    # plain text goes out as it comes; an object that is not a call is text once it closes
    assert streamed(LLAMA, ["The", " answer"]) == [("The", []), (" answer", [])]
    assert streamed(LLAMA, ['{"a": ', '1} ok', ""]) == [("", []), ('{"a": 1} ok', []), ("", [])]


def test_calls_read_as_openai_sends_them():
    call = PARIS.openai()
    assert call["id"].startswith("call_") and len(call["id"]) == 29
    assert call == {"id": call["id"], "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "paris"}'}}
    assert HERMES.parse(block("f", {"city": "Zürich"}))[1] == [ToolCall("f", '{"city": "Zürich"}')]
