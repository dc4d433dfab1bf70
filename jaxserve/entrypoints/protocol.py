"""OpenAI- and vLLM-compatible request bodies (pydantic, strict types) and the error envelope.

Every field that OpenAI's or vLLM's completions and chat APIs define is accepted by name; a field
no API defines (a typo such as `max_token`) is refused and named. Each accepted field is one of:
- honoured: sampling, `n`, `stop`, `logprobs`, `echo`, `stream_options`, `truncate_prompt_tokens`,
  `add_special_tokens`, `chat_template`, ...;
- a no-op by nature (`user`, `metadata`, `parallel_tool_calls`, `prompt_cache_key`, ...);
- `_only` its default or a value that changes nothing (`presence_penalty: 0`, `store: false`,
  ...): any other value is a 400 that says why, rather than being silently ignored.
Structured output: `response_format` (text, json_object, json_schema), vLLM's
`structured_outputs` (json, regex, choice, grammar, json_object), and for chat `tools` with a
`tool_choice` that names a function or is "required"; the server turns them into a
`StructuredOutputs` (one per request), whose checks name the field at fault. `tools` with
tool_choice "auto" (the default) constrain nothing: the server's tool-call parser reads the calls.
The JSON schema of each field says exactly what is accepted (the OpenAPI document is built from
these models). Sampling ranges are checked by `SamplingParams`; here they are only documented.
"""


import difflib
from typing import Annotated, Any, Callable, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, WithJsonSchema

from jaxserve.engine.batching.sampling_params import MAX_LOGPROBS

MAX_N = 16  # choices per prompt
MAX_CHOICES = 256  # prompts x n in one payload


def _integral(v):
    """JSON Schema counts 5.0 as an integer, so a strict int field takes it as 5 (and still
    refuses 5.5, "5" and true)."""
    return int(v) if type(v) is float and v.is_integer() else v


Int = Annotated[int, BeforeValidator(_integral)]


def _only(schema: dict, allowed: Callable[[Any], bool], why: str):
    """A field accepted for compatibility: null and the values for which `allowed(v)` holds pass
    (they change nothing); any other is refused with `why`. `schema` documents exactly those."""
    def check(v):
        if v is not None and not allowed(v):
            raise ValueError(why)
        return v
    return Annotated[Any, AfterValidator(check),
                     WithJsonSchema({"anyOf": [schema, {"type": "null"}], "description": why})]


def _number(x) -> bool:
    return type(x) in (int, float)


def _equals(value):
    return lambda v: _number(v) and v == value


def _is(value, why: str):
    """Only `value` (a bool or string default) or null."""
    return _only({"const": value}, lambda v: type(v) is type(value) and v == value, why)


def _zero(name: str, default: float = 0.0):
    return _only({"type": "number", "minimum": default, "maximum": default}, _equals(default),
                 f"{name} is not implemented by jaxserve; leave it at {default:g}")


_EMPTY_LIST = {"type": "array", "maxItems": 0}
_EMPTY_OBJECT = {"type": "object", "maxProperties": 0}


def _empty(why: str, kind: str = "list"):
    schema, t = (_EMPTY_LIST, list) if kind == "list" else (_EMPTY_OBJECT, dict)
    return _only(schema, lambda v: type(v) is t and not v, why)


def _absent(why: str):
    """Only null: a feature jaxserve does not have."""
    return _only({"not": {}}, lambda v: False, why)


def _range(**bounds) -> dict:
    """A JSON-schema range for documentation (SamplingParams enforces it)."""
    return {"json_schema_extra": bounds}


# Fields accepted for compatibility (see _only): what each accepts, and why nothing more.
_NO_FUNCTIONS = "the deprecated functions API is not implemented by jaxserve: use tools"
_NONE_OR_AUTO = {"enum": ["none", "auto"]}
_PresencePenalty = _zero("presence_penalty")
_FrequencyPenalty = _zero("frequency_penalty")
_RepetitionPenalty = _zero("repetition_penalty", 1.0)
_LengthPenalty = _zero("length_penalty", 1.0)
_LogitBias = _empty("logit_bias is not implemented by jaxserve", "dict")
_MinTokens = _only({"type": "integer", "minimum": 0, "maximum": 0}, _equals(0),
                   "min_tokens is not implemented by jaxserve; leave it at 0")
_UseBeamSearch = _is(False, "beam search is not implemented by jaxserve")
_SkipSpecialTokens = _is(True, "jaxserve always skips special tokens in the text")
_PromptLogprobs = _absent("prompt_logprobs is not implemented by jaxserve")
_AllowedTokenIds = _absent("allowed_token_ids is not implemented by jaxserve")
_BadWords = _empty("bad_words is not implemented by jaxserve")
_LogitsProcessors = _absent("logits processors are not implemented by jaxserve")
_Guided = _absent("guided_* fields are not implemented by jaxserve: use structured_outputs or response_format")
_Priority = _only({"type": "integer", "minimum": 0, "maximum": 0}, _equals(0),
                  "request priorities are not implemented by jaxserve; leave priority at 0")
_ReturnTokensAsTokenIds = _is(False, "return_tokens_as_token_ids is not implemented by jaxserve")
_ReturnTokenIds = _is(False, "return_token_ids is not implemented by jaxserve")
_KvTransferParams = _absent("KV transfer is not implemented by jaxserve")
_VllmXargs = _absent("vllm_xargs are not supported by jaxserve")
_BestOf = _only({"type": "integer", "minimum": 1, "maximum": 1}, _equals(1),
                "best_of > 1 is not implemented by jaxserve (use n)")
_Suffix = _only({"type": "string", "maxLength": 0}, lambda v: v == "",
                "suffix (insertion) is not implemented by jaxserve")
_PromptEmbeds = _absent("prompt_embeds are not supported by jaxserve")
_FunctionCall = _absent("function calls are not implemented by jaxserve")
_Audio = _absent("audio is not supported by jaxserve")
_Functions = _empty(_NO_FUNCTIONS)
_FunctionCallChat = _only(_NONE_OR_AUTO, lambda v: v in ("none", "auto"),
                          f'{_NO_FUNCTIONS}: function_call may only be "none" or "auto"')
_Store = _is(False, "jaxserve does not store completions (store must be false)")
_ServiceTier = _only({"enum": ["auto", "default"]}, lambda v: v in ("auto", "default"),
                     'jaxserve has one service tier: "auto" or "default"')
_Modalities = _only({"type": "array", "items": {"const": "text"}, "minItems": 1, "maxItems": 1},
                    lambda v: v == ["text"], 'jaxserve outputs text only: modalities must be ["text"]')
_AudioOutput = _absent("audio output is not supported by jaxserve")
_Prediction = _absent("predicted outputs are not implemented by jaxserve")
_ReasoningEffort = _absent("reasoning_effort is not supported: the served model does not reason")
_Verbosity = _absent("verbosity is not supported by jaxserve")
_WebSearchOptions = _absent("web search is not supported by jaxserve")
_Echo = _is(False, "echo is not implemented for chat by jaxserve")
_ContinueFinalMessage = _is(False, "continue_final_message is not implemented by jaxserve")
_Documents = _absent("documents are not supported by jaxserve")
_MmProcessorKwargs = _absent("jaxserve serves text-only models")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class JsonSchemaFormat(_Strict):
    """OpenAI's `response_format.json_schema`."""

    name: str | None = Field(None, description="the schema's name (not used)")
    description: str | None = Field(None, description="accepted; not shown to the model")
    schema_: dict[str, Any] | None = Field(None, alias="schema",
                                           description="the JSON schema the output must match (absent: any JSON object)")
    strict: bool | None = Field(None, description="accepted; jaxserve always enforces the schema")


class ResponseFormat(_Strict):
    """OpenAI's `response_format`: plain text, any JSON object, or JSON matching a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = Field(None, description='required with type "json_schema"')


class StructuredOutputsBody(_Strict):
    """vLLM's `structured_outputs`: set exactly one of json, regex, choice, grammar, json_object."""

    json_: dict[str, Any] | str | None = Field(None, alias="json", description="a JSON schema (object or string)")
    regex: str | None = Field(None, description="the whole output matches this regular expression")
    choice: list[str] | None = Field(None, description="the output is exactly one of these strings")
    grammar: str | None = Field(None, description="a Lark or GBNF grammar")
    json_object: bool | None = Field(None, description="true: any JSON object")
    disable_fallback: bool | None = Field(None, description="accepted; jaxserve has one backend (llguidance)")


class FunctionDefinition(_Strict):
    name: str
    description: str | None = Field(None, description="accepted; not shown to the model unless the chat template does")
    parameters: dict[str, Any] | None = Field(None, description="JSON schema of the arguments (absent: none)")
    strict: bool | None = Field(None, description="accepted; jaxserve always enforces the schema")


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    """`tool_choice` naming the function the reply must call."""

    type: Literal["function"]
    function: FunctionName


class StreamOptions(_Strict):
    include_usage: bool | None = Field(False, description="a last chunk with the usage of the whole request")
    continuous_usage_stats: bool | None = Field(False, description="vLLM: usage so far in every chunk")
    include_obfuscation: bool | None = Field(None, description="accepted; jaxserve never pads chunks")


class _Sampling(_Strict):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    max_tokens: Int | None = Field(None, **_range(minimum=1))
    temperature: float | None = Field(None, **_range(minimum=0))
    top_p: float | None = Field(None, **_range(exclusiveMinimum=0, maximum=1))
    top_k: Int | None = Field(None, description="-1, 0 or at least the vocabulary size: off", **_range(minimum=-1))
    min_p: float | None = Field(None, **_range(minimum=0, maximum=1))
    n: Int = Field(1, ge=1, le=MAX_N)
    seed: Int | None = Field(None, **_range(minimum=0, maximum=2**32 - 1))
    stop: str | list[str] | None = Field(None, description="strings that end generation (not empty)",
                                         **_range(minLength=1, items={"type": "string", "minLength": 1}))
    stop_token_ids: list[Annotated[Int, Field(ge=0)]] | None = None
    include_stop_str_in_output: bool | None = False
    ignore_eos: bool | None = False
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, description="accepted; no effect")
    request_id: str | None = Field(None, description="vLLM: the id of the response (default: generated)")
    truncate_prompt_tokens: Annotated[Int | None, WithJsonSchema({"anyOf": [
        {"type": "integer", "minimum": 1}, {"const": -1}, {"type": "null"}]})] = Field(
        None, description="keep only the last k prompt tokens; -1: as many as the context holds")
    presence_penalty: _PresencePenalty = None
    frequency_penalty: _FrequencyPenalty = None
    repetition_penalty: _RepetitionPenalty = None
    length_penalty: _LengthPenalty = None
    logit_bias: _LogitBias = None
    min_tokens: _MinTokens = None
    best_of: _BestOf = None
    use_beam_search: _UseBeamSearch = None
    skip_special_tokens: _SkipSpecialTokens = None
    spaces_between_special_tokens: _SkipSpecialTokens = None
    prompt_logprobs: _PromptLogprobs = None
    allowed_token_ids: _AllowedTokenIds = None
    bad_words: _BadWords = None
    logits_processors: _LogitsProcessors = None
    response_format: ResponseFormat | None = Field(None, description="text, json_object or json_schema")
    guided_json: _Guided = None
    guided_regex: _Guided = None
    guided_choice: _Guided = None
    guided_grammar: _Guided = None
    guided_decoding_backend: _Guided = None
    guided_whitespace_pattern: _Guided = None
    structured_outputs: StructuredOutputsBody | None = Field(None, description="vLLM: constrain the output")
    priority: _Priority = None
    return_tokens_as_token_ids: _ReturnTokensAsTokenIds = None
    return_token_ids: _ReturnTokenIds = None
    cache_salt: str | None = None  # requests with different salts never share prefix-cache pages
    kv_transfer_params: _KvTransferParams = None
    vllm_xargs: _VllmXargs = None

    @property
    def stop_list(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.include_usage and self.stream_options.continuous_usage_stats)


Prompt = Annotated[str | list[str] | list[Int] | list[list[Int]],
                   Field(description="a string, a list of strings, a list of token ids or a list of token-id lists")]


class CompletionRequest(_Sampling):
    """POST /v1/completions."""

    prompt: Prompt
    logprobs: Int | None = Field(None, **_range(minimum=0, maximum=MAX_LOGPROBS))
    echo: bool | None = False
    add_special_tokens: bool | None = Field(True, description="add the tokenizer's BOS to text prompts")
    suffix: _Suffix = None
    prompt_embeds: _PromptEmbeds = None


class ContentPart(_Strict):
    """A part of a message's content: only text (this server runs text-only models)."""

    type: Annotated[str, AfterValidator(lambda t: _text_part(t)), WithJsonSchema({"const": "text"})]
    text: str


def _text_part(t: str) -> str:
    if t != "text":
        raise ValueError(f"content part type {t!r} is not supported: jaxserve serves text-only models")
    return t


class CalledFunction(_Strict):
    name: str
    arguments: str = Field(description="the call's arguments as the reply gave them: JSON text")


class ToolCallMade(_Strict):
    """A call an earlier assistant turn made, sent back with the conversation."""

    id: str
    type: Literal["function"]
    function: CalledFunction


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = Field(None, description="a tool turn: the id of the call it answers")
    refusal: str | None = Field(None, description="accepted; no effect")
    tool_calls: list[ToolCallMade] | None = Field(None, description="an assistant turn: the calls it made")
    function_call: _FunctionCall = None
    audio: _Audio = None

    @property
    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""



class ChatCompletionRequest(_Sampling):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Int | None = Field(None, **_range(minimum=1))
    logprobs: bool | None = False
    top_logprobs: Int | None = Field(None, **_range(minimum=0, maximum=MAX_LOGPROBS))
    add_generation_prompt: bool | None = True
    add_special_tokens: bool | None = Field(False, description="add the tokenizer's BOS to the rendered chat")
    chat_template: str | None = Field(None, description="a Jinja chat template for this request")
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="extra variables for the template")
    tools: list[Tool] | None = Field(None, description='functions the reply may call, shown to the chat template '
                                                       '(as `tools`) whatever tool_choice says')
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description='"required" or a named function constrains the reply to tool calls; "auto" (the '
                          'default with tools) lets the model choose, and needs a server started with '
                          '--tool-call-parser (else 400); "none": the reply is text')
    parallel_tool_calls: bool | None = Field(None, description='accepted; "required" and "auto" allow several calls')
    functions: _Functions = None
    function_call: _FunctionCallChat = None
    metadata: dict[str, str] | None = Field(None, description="accepted; not stored")
    store: _Store = None
    service_tier: _ServiceTier = None
    safety_identifier: str | None = Field(None, description="accepted; no effect")
    prompt_cache_key: str | None = Field(None, description="accepted; no effect")
    modalities: _Modalities = None
    audio: _AudioOutput = None
    prediction: _Prediction = None
    reasoning_effort: _ReasoningEffort = None
    include_reasoning: bool | None = Field(None, description="accepted; no effect (no reasoning)")
    verbosity: _Verbosity = None
    web_search_options: _WebSearchOptions = None
    echo: _Echo = None
    continue_final_message: _ContinueFinalMessage = None
    documents: _Documents = None
    mm_processor_kwargs: _MmProcessorKwargs = None


_SHAPES = {"prompt": "prompt must be a string, a list of strings, a list of token ids or a list of token-id lists",
           "stop": "stop must be a string or a list of strings",
           "content": "message content must be a string or a list of {\"type\": \"text\", \"text\": ...} parts"}


def describe(error: ValidationError, model: type[BaseModel] | None = None) -> tuple[str, str | None]:
    """One readable message and the offending parameter (dotted path) for a pydantic error."""
    errors = error.errors(include_url=False)
    # Our own checks (value errors) say the most; in a union they sit beside the type mismatches.
    e = next((x for x in errors if x["type"] == "value_error"), errors[0])
    loc: list[str] = []
    union = False  # pydantic tags each member of a union in the path: stop there
    for part in e["loc"]:
        if isinstance(part, str) and (part in _UNION_TAGS or "[" in part):
            union = True
            break
        loc.append(str(part))
    param = ".".join(loc) or None
    kind = e["type"]
    if kind == "json_invalid":
        return f"malformed JSON body: {e['msg'].removeprefix('Invalid JSON: ')}", None
    if kind == "model_type" and not loc:
        return "the request body must be a JSON object", None
    if kind == "extra_forbidden":
        return f"unknown field {param!r}{_suggest(loc, model)}", param
    if kind == "missing":
        return f"field {param!r} is required", param
    if kind == "value_error":
        return str(e.get("ctx", {}).get("error", e["msg"])), param
    if union:
        return _SHAPES.get(loc[-1] if loc else "", f"{param} has the wrong type"), param
    return f"{param}: {e['msg']}" if param else e["msg"], param


_UNION_TAGS = {"str", "int", "float", "bool", "ContentPart", "list", "dict", "NamedToolChoice"}


def _suggest(loc: list[str], model: type[BaseModel] | None) -> str:
    """', did you mean ...?' for a misspelt top-level field."""
    if model is None or len(loc) != 1:
        return ""
    close = difflib.get_close_matches(loc[0], model.model_fields, n=1, cutoff=0.8)
    return f" (did you mean {close[0]!r}?)" if close else ""


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | int | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class ApiError(Exception):
    """An HTTP error answered with the OpenAI envelope."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code, self.headers = (
            status, message, type_, param, code, headers)
