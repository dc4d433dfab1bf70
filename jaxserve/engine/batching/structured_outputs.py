"""What a request's output must match (structured output): a JSON schema, any JSON object, a
regex, one of a list of strings, or a Lark or GBNF grammar; vLLM's `structured_outputs` kinds.

The spec is validated and compiled to an llguidance grammar when it is built (in the API process
for HTTP requests), so a bad schema is refused before anything is queued; the engine turns the
grammar into a token matcher (`jaxserve.engine.grammars`). Pure Python: no jax here.
"""

from __future__ import annotations

import dataclasses
import json

KINDS = ("json", "json_object", "regex", "choice", "grammar")
# JSON is written as json.dumps writes it, with no other whitespace: where any run of whitespace is
# allowed, a small model can loop on spaces until max_tokens. A schema's "x-guidance" overrides it.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# Keywords whose value maps names to schemas, and keywords whose value is data, not a schema.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_DATA = ("enum", "const", "default", "examples", "required")


@dataclasses.dataclass(frozen=True, kw_only=True)
class StructuredOutputs:
    """Exactly one of: `json` (a JSON schema, as a dict or a JSON string), `json_object=True` (any
    JSON object), `regex` (the whole output matches it), `choice` (the output is one of these
    strings), `grammar` (Lark, or GBNF as llama.cpp writes it). Error messages start with the
    request field at fault: `name`, with `{kind}` replaced by the kind set (a server passes e.g.
    `response_format.json_schema.schema`)."""

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    name: str = dataclasses.field(default="structured_outputs.{kind}", compare=False)
    llguidance_grammar: str = dataclasses.field(init=False, repr=False, compare=False)  # what the matcher compiles

    def __post_init__(self):
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"{self.name.removesuffix('.{kind}')} must set exactly one of {', '.join(KINDS)}; got "
                             f"{', '.join(given) if given else 'none'}")
        kind = given[0]
        field = self.field
        schema = None  # a json spec's schema, parsed once
        if self.json_object is not False and self.json_object is not True:
            raise ValueError(f"{field} must be true or false, got {self.json_object!r}")
        if kind == "json":
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except ValueError as e:
                    raise ValueError(f"{field} is not valid JSON: {e}") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError(f"{field} must be a JSON schema (an object), got {type(schema).__name__}")
            # Kept as text, so the params stay hashable; key order is kept too: properties are
            # generated in the schema's order.
            object.__setattr__(self, "json", json.dumps(schema, separators=(",", ":")))
        elif kind == "choice":
            choice = self.choice
            if isinstance(choice, str) or not isinstance(choice, (list, tuple)) or not choice or \
                    any(not isinstance(c, str) or not c for c in choice):
                raise ValueError(f"{field} must be a non-empty list of non-empty strings, got {choice!r}")
            object.__setattr__(self, "choice", tuple(choice))
        elif kind != "json_object" and (not isinstance(getattr(self, kind), str) or not getattr(self, kind)):
            raise ValueError(f"{field} must be a non-empty string, got {getattr(self, kind)!r}")
        object.__setattr__(self, "llguidance_grammar", _compile(self, kind, schema))

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def field(self) -> str:
        """The request field error messages name."""
        return self.name.replace("{kind}", self.kind)


def closed_objects(schema, close: bool = True):
    """The schema with `additionalProperties: false` wherever an object lists its `properties` and
    says nothing of others, as xgrammar's strict mode (vLLM's default) and OpenAI's strict schemas
    do: a small model given room for properties of its own invents them until max_tokens. What it
    generates still validates against the schema as given. Schemas combined with others (`allOf`,
    `$ref` beside `properties`) stay open, since the others may add properties."""
    if isinstance(schema, list):
        return [closed_objects(s, close) for s in schema]
    if not isinstance(schema, dict):
        return schema
    closed = {}
    for key, value in schema.items():
        if key in _DATA:
            closed[key] = value
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            closed[key] = {name: closed_objects(s) for name, s in value.items()}
        else:
            closed[key] = closed_objects(value, close=key != "allOf")
    if close and "properties" in schema and not {"additionalProperties", "unevaluatedProperties",
                                                 "patternProperties", "allOf", "$ref"} & schema.keys():
        closed["additionalProperties"] = False
    return closed


def _compile(spec: StructuredOutputs, kind: str, schema=None) -> str:
    """The llguidance grammar of a spec, checked without a tokenizer; ValueError naming the field.
    `schema`: a json spec's schema as parsed (its text is not parsed again: 6 ms for 500 kB)."""
    import llguidance  # a compiled library with no jax or torch; imported only when a spec is built

    field = spec.field
    try:
        if kind in ("json", "json_object"):
            text = json.dumps(closed_objects(json.loads(spec.json) if schema is None else schema)) \
                if kind == "json" else '{"type": "object"}'
            grammar = llguidance.LLMatcher.grammar_from_json_schema(text, defaults=JSON_LAYOUT)
        elif kind == "choice":
            # Each choice is a literal: a Lark string literal is a JSON string.
            grammar = llguidance.grammar_from("lark", "start: " + " | ".join(json.dumps(c) for c in spec.choice))
        elif kind == "regex":
            grammar = llguidance.grammar_from("regex", spec.regex)
        else:  # Lark, or GBNF (which llguidance converts to Lark)
            grammar = llguidance.grammar_from("grammar", spec.grammar)
    except ValueError as e:
        raise ValueError(f"{field} is invalid: {e}") from None
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise ValueError(f"{field} is invalid: {short_error(error)}")
    return grammar


def short_error(message: str, lines: int = 4) -> str:
    """llguidance's error with its source excerpt, kept short for an HTTP error body."""
    return "\n".join(message.strip().splitlines()[:lines])
