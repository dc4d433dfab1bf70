"""Tool calls that a model writes into its reply as text, read back as OpenAI `tool_calls`
(`--tool-call-parser`, for tool_choice "auto"), from a whole reply or from a stream as it grows.

    reply text ─► parser.split(text, final): pieces in order, text and calls, of the part that is
    settled (the rest may still become a call) ─► content + calls        (parse: a whole reply)
                                               ─► new content, new calls (ToolCallStream: a stream)

Formats:
- `hermes` (Qwen 2.5, Qwen 3, Hermes): free text, then blocks
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`;
- `llama3_json` (Llama 3.1 and later, JSON tool calling): the reply is `{"name": ...,
  "parameters": {...}}`, possibly after `<|python_tag|>`, several separated by `;`.

Nothing the model wrote is lost: a block that is not a valid call (bad JSON, no name, arguments
that are not an object) stays in the content as written. Only whitespace next to a call is dropped.
A stream holds back what may still become a call (a partial `<tool_call>` marker, an open block, a
JSON object not yet closed, whitespace that a call may follow) and sends each call whole once it is
complete and valid, so the streamed reply adds up to exactly the whole one.
"""

from __future__ import annotations

import dataclasses
import json
import uuid


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One call a reply makes: a function's name and its arguments as JSON text (an object)."""

    name: str
    arguments: str

    def openai(self) -> dict:
        """OpenAI's shape of the call, with a new id."""
        return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


Piece = str | ToolCall  # a reply is text and calls, in order


class ToolCallParser:
    """One format of tool calls in a reply's text."""

    name: str  # as --tool-call-parser takes it

    def split(self, text: str, final: bool) -> list[Piece]:
        """The pieces of `text` (adjacent text merged, none empty). Unless `final`, only the part
        that more text cannot change: a tail that may still become a call is left out."""
        raise NotImplementedError

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """A whole reply's content and calls. The content is the text as written when there is no
        call; with calls, the text around them (None if there is none)."""
        pieces = self.split(text, final=True)
        calls = [p for p in pieces if isinstance(p, ToolCall)]
        content = content_of(pieces)
        return (content if content or not calls else None), calls


def content_of(pieces: list[Piece]) -> str:
    """The text pieces joined, each without the whitespace on a side that touches a call."""
    out = []
    for i, piece in enumerate(pieces):
        if isinstance(piece, ToolCall):
            continue
        if i > 0 and isinstance(pieces[i - 1], ToolCall):
            piece = piece.lstrip()
        if i + 1 < len(pieces) and isinstance(pieces[i + 1], ToolCall):
            piece = piece.rstrip()
        out.append(piece)
    return "".join(out)


class HermesParser(ToolCallParser):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks after free text. A block
    the reply ends inside (max_tokens, a stop string) is a call if what it holds is one."""

    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def split(self, text: str, final: bool) -> list[Piece]:
        pieces: list[Piece] = []
        pos = 0
        while True:
            start = text.find(self.OPEN, pos)
            if start < 0:  # text to the end, less what may be the start of a marker
                pieces.append(text[pos:] if final else text[pos:len(text) - _marker_start(text, pos, self.OPEN)])
                break
            pieces.append(text[pos:start])
            body = start + len(self.OPEN)
            end = text.find(self.CLOSE, body)
            if end < 0:  # an open block: settled only when the reply ends
                if final:
                    pieces.append(_call(text[body:], ("arguments",)) or text[start:])
                break
            pieces.append(_call(text[body:end], ("arguments",)) or text[start:end + len(self.CLOSE)])
            pos = end + len(self.CLOSE)
        return _merged(pieces)


class Llama3JsonParser(ToolCallParser):
    """A reply that is `{"name": ..., "parameters": {...}}` (or "arguments"), possibly after
    `<|python_tag|>`, several separated by `;`. The calls are the valid ones it starts with; from
    the first thing that is not one, the rest is content (all of it when it starts with none)."""

    name = "llama3_json"
    TAG = "<|python_tag|>"

    def split(self, text: str, final: bool) -> list[Piece]:
        pos = _skip_space(text, 0)
        if text.startswith(self.TAG, pos):
            pos = _skip_space(text, pos + len(self.TAG))
            if pos == len(text) and not final:
                return []  # a call comes next
        elif not final and self.TAG.startswith(text[pos:]):
            return []  # nothing yet, or the start of the tag
        calls: list[Piece] = []
        rest = 0  # where the content starts
        decoder = json.JSONDecoder()
        while text.startswith("{", pos):
            try:
                value, end = decoder.raw_decode(text, pos)
            except ValueError:  # not closed yet, or not JSON
                if not final:
                    return calls
                break
            call = _as_call(value, ("parameters", "arguments"))
            if call is None:
                break
            calls.append(call)
            rest = after = _skip_space(text, end)
            if after == len(text) and not final:
                return calls  # another call may follow
            if not text.startswith(";", after):
                break
            rest = pos = _skip_space(text, after + 1)
            if pos == len(text) and not final:
                return calls
        return _merged(calls + [text[rest:] if calls else text])


PARSERS: dict[str, ToolCallParser] = {p.name: p for p in (HermesParser(), Llama3JsonParser())}


class ToolCallStream:
    """One choice's streamed reply read by a parser: `feed` it the text as it comes, and it returns
    what is settled and not yet sent."""

    def __init__(self, parser: ToolCallParser):
        self.parser = parser
        self.text = ""
        self.sent = ""  # content sent so far
        self.num_calls = 0  # calls sent so far

    def feed(self, text: str, final: bool) -> tuple[str, list[ToolCall]]:
        """Takes the reply's next text (`final`: the reply has ended); returns the content and
        the calls to send now."""
        self.text += text
        pieces = self.parser.split(self.text, final)
        content = content_of(pieces)
        if not final:
            content = content.rstrip()  # a call may follow, and the whitespace before it goes
        calls = [p for p in pieces if isinstance(p, ToolCall)]
        new_content, new_calls = content[len(self.sent):], calls[self.num_calls:]
        self.sent, self.num_calls = content, len(calls)
        return new_content, new_calls

    @property
    def called(self) -> bool:
        return self.num_calls > 0


def _call(body: str, argument_keys: tuple[str, ...]) -> ToolCall | None:
    try:
        value = json.loads(body)
    except ValueError:
        return None
    return _as_call(value, argument_keys)


def _as_call(value, argument_keys: tuple[str, ...]) -> ToolCall | None:
    """The call a decoded JSON value is: an object with a non-empty string "name" and arguments
    that are an object (or JSON text of one; absent: none). None if it is not one."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    arguments = next((value[k] for k in argument_keys if k in value), {})
    if isinstance(arguments, str):  # some models write the arguments as JSON text
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))


def _marker_start(text: str, pos: int, marker: str) -> int:
    """The length of the longest end of text[pos:] that begins `marker` (0: none)."""
    for n in range(min(len(marker) - 1, len(text) - pos), 0, -1):
        if marker.startswith(text[len(text) - n:]):
            return n
    return 0


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


def _merged(pieces: list[Piece]) -> list[Piece]:
    """Adjacent text joined, empty text dropped."""
    out: list[Piece] = []
    for piece in pieces:
        if isinstance(piece, str):
            if not piece:
                continue
            if out and isinstance(out[-1], str):
                out[-1] += piece
                continue
        out.append(piece)
    return out
