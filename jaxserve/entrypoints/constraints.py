"""Structured output over HTTP: the request fields that constrain a reply, turned into one
`StructuredOutputs`, and a reply constrained to tool calls turned back into OpenAI's `tool_calls`.

    response_format {"type": "json_schema" | "json_object"}  ─┐
    structured_outputs {json | regex | choice | grammar | json_object} ─┼─► StructuredOutputs (400 naming
    tools + tool_choice {"type": "function", ...} or "required" ─┘       the field, before anything is queued)

A named function constrains the reply to its `parameters` schema: the text is the call's
arguments. "required" constrains it to a JSON array of `{"name", "parameters"}` objects, one of
the tools each (vLLM's shape), at most one with `parallel_tool_calls: false`. "auto" (the default
with tools) constrains nothing: the model chooses between text and calls, which a tool-call parser
reads back from its text (tool_parsers.py), so it needs the server's --tool-call-parser; without
one it is refused, as most models (the default base model among them) cannot choose.
"""

from __future__ import annotations

import dataclasses
import json
import types

from jaxserve.engine.batching.structured_outputs import StructuredOutputs
from jaxserve.entrypoints.offload import TIME_LIMIT_S, off_loop, over_time_limit
from jaxserve.entrypoints.protocol import ApiError
from jaxserve.entrypoints.tool_parsers import PARSERS, ToolCall
from jaxserve.entrypoints.worker_processes import WorkerProcesses

_NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclasses.dataclass(frozen=True)
class ToolCalls:
    """How a reply constrained to tool calls reads back: `function` names the one function it
    calls (its text is the arguments), or None for "required" (its text is a list of calls)."""

    function: str | None = None

    def parse(self, text: str) -> list[dict] | None:
        """OpenAI `tool_calls` of a reply's text; None if it is not complete JSON (cut by max_tokens)."""
        try:
            value = json.loads(text)
        except ValueError:
            return None
        if self.function is not None:
            calls = [(self.function, value)]
        elif isinstance(value, list) and all(isinstance(c, dict) and "name" in c for c in value):
            calls = [(c["name"], c.get("parameters", {})) for c in value]
        else:
            return None
        return [ToolCall(name, json.dumps(arguments)).openai() for name, arguments in calls]


CHECKERS = 2  # worker processes that check constraints
_FIELDS = ("response_format", "structured_outputs", "tools", "tool_choice", "parallel_tool_calls")  # what it reads
_checkers = WorkerProcesses(CHECKERS, "jaxserve-constraint")


async def checked_constraint(body, chat: bool, tool_call_parser: str | None = None
                             ) -> tuple[StructuredOutputs | None, ToolCalls | None]:
    """`constraint`, in a worker process when there is one to check: for a JSON schema of 500 kB,
    turning it into a grammar held the GIL for about 30 ms in pieces of 6-11 ms (every stream
    stopped for one gap that long), and llguidance's check took a second (without the GIL)."""
    fmt = body.response_format
    if body.structured_outputs is None and (fmt is None or fmt.type == "text") and not (chat and body.tools):
        return constraint(body, chat, tool_call_parser)
    fields = types.SimpleNamespace(**{name: getattr(body, name, None) for name in _FIELDS})  # not the prompt
    what = "checking the output's constraint"

    def check():
        try:
            ok, outcome = _checkers.call(_constraint_outcome, (fields, chat, tool_call_parser), TIME_LIMIT_S, what)
        except TimeoutError:  # its worker killed
            raise over_time_limit(what) from None
        if not ok:
            status, message, type_, param, code = outcome
            raise ApiError(status, message, type_, param, code)
        return outcome
    return await off_loop(check, what=what)


def _constraint_outcome(fields, chat: bool, tool_call_parser: str | None):
    """In a worker: (True, `constraint`'s answer), or (False, its ApiError's fields)."""
    try:
        return True, constraint(fields, chat, tool_call_parser)
    except ApiError as e:
        return False, (e.status, e.message, e.type, e.param, e.code)


def constraint(body, chat: bool, tool_call_parser: str | None = None
               ) -> tuple[StructuredOutputs | None, ToolCalls | None]:
    """The reply's constraint from a parsed request body (ApiError 400 naming the field), and how
    to read tool calls back (chat only). `tool_call_parser`: the server's, which tool_choice
    "auto" needs."""
    given = []
    fmt = body.response_format
    if fmt is not None and fmt.type != "text":
        given.append("response_format")
    if body.structured_outputs is not None:
        given.append("structured_outputs")
    tools = _tool_constraint(body, tool_call_parser) if chat else None
    if tools is not None:
        given.append("tool_choice")
    if len(given) > 1:
        raise ApiError(400, f"{' and '.join(given)} both constrain the output: give one", param=given[1])
    try:
        if "response_format" in given:
            return _response_format(fmt), None
        if "structured_outputs" in given:
            so = body.structured_outputs
            return StructuredOutputs(json=so.json_, regex=so.regex, choice=so.choice, grammar=so.grammar,
                                     json_object=bool(so.json_object)), None
    except ValueError as e:
        raise ApiError(400, str(e), param=str(e).split(" ")[0])
    return tools if tools is not None else (None, None)


def _response_format(fmt) -> StructuredOutputs:
    if fmt.type == "json_object":
        if fmt.json_schema is not None:
            raise ApiError(400, 'response_format.json_schema goes with type "json_schema"',
                           param="response_format.json_schema")
        return StructuredOutputs(json_object=True, name="response_format")
    if fmt.json_schema is None:
        raise ApiError(400, 'response_format of type "json_schema" needs a json_schema object',
                       param="response_format.json_schema")
    schema = fmt.json_schema.schema_
    if schema is None:
        return StructuredOutputs(json_object=True, name="response_format.json_schema")
    return StructuredOutputs(json=schema, name="response_format.json_schema.schema")


def _tool_constraint(body, tool_call_parser: str | None) -> tuple[StructuredOutputs, ToolCalls] | None:
    """The constraint a chat request's tools and tool_choice ask for, or None."""
    tools, choice = body.tools or [], body.tool_choice
    if not tools:
        if choice not in (None, "none", "auto"):
            raise ApiError(400, f"tool_choice {_show(choice)} needs tools", param="tool_choice")
        return None
    if auto_tool_choice(body) and tool_call_parser is None:
        raise ApiError(400, 'tool_choice "auto" (the default with tools) needs a tool-call parser: start the '
                            f'server with --tool-call-parser ({" or ".join(PARSERS)}, the format the model writes '
                            'its calls in), or set tool_choice to "required", {"type": "function", "function": '
                            '{"name": ...}} or "none"', param="tool_choice")
    if choice in (None, "auto", "none"):
        return None
    names = [t.function.name for t in tools]
    if len(set(names)) < len(names):
        raise ApiError(400, "tools must have distinct function names", param="tools")
    try:
        schemas = [StructuredOutputs(json=_parameters(t), name=f"tools[{i}].function.parameters")
                   for i, t in enumerate(tools)]
    except ValueError as e:
        raise ApiError(400, str(e), param=str(e).split(" ")[0])
    if choice != "required":
        name = choice.function.name
        if name not in names:
            raise ApiError(400, f"tool_choice names the function {name!r}, which is not among the tools "
                                f"({', '.join(map(repr, names))})", param="tool_choice.function.name")
        return schemas[names.index(name)], ToolCalls(name)
    calls = {"type": "array", "minItems": 1, "items": {"anyOf": [
        {"type": "object", "properties": {"name": {"const": t.function.name}, "parameters": _parameters(t)},
         "required": ["name", "parameters"], "additionalProperties": False} for t in tools]}}
    if body.parallel_tool_calls is False:
        calls["maxItems"] = 1
    try:
        return StructuredOutputs(json=calls, name="tools"), ToolCalls()
    except ValueError as e:
        raise ApiError(400, str(e), param="tools")


def auto_tool_choice(body) -> bool:
    """The model chooses between text and calls to the request's tools (tool_choice "auto")."""
    return bool(body.tools) and body.tool_choice in (None, "auto")


def _parameters(tool) -> dict:
    return tool.function.parameters if tool.function.parameters is not None else _NO_ARGUMENTS


def _show(choice) -> str:
    return json.dumps(choice if isinstance(choice, str) else choice.model_dump())
