"""POST /v1/chat/completions: messages rendered by a chat template into one prompt, answered by n
assistant messages, or by tool calls: when `tools` constrain the reply to them, or when the model
chooses to call them (tool_choice "auto", read by the server's tool-call parser).

    body ─► the output's constraint (constraints.py) ─► the chat template renders the messages
    (and the tools) ─► token ids ─► max_tokens (default: the rest of the context, or the server's
    default within it) ─► SamplingParams ─► ChatServing (serving.py)
    ─► each choice's text as it is, or read as tool calls: JSON (constrained), a parser's format (auto)
"""

from __future__ import annotations

import json

from starlette.requests import Request
from starlette.responses import Response

from jaxserve.entrypoints.app_state import ServedModel
from jaxserve.entrypoints.chat_template import HEADER
from jaxserve.entrypoints.choice import Choice
from jaxserve.entrypoints.constraints import ToolCalls, auto_tool_choice, checked_constraint
from jaxserve.entrypoints import offload
from jaxserve.entrypoints.offload import off_loop
from jaxserve.entrypoints.protocol import ApiError, ChatCompletionRequest, ChatMessage
from jaxserve.entrypoints.serving import Serving, sampling_params
from jaxserve.entrypoints.tool_parsers import PARSERS, ToolCallParser, ToolCallStream


async def create_chat_completion(http_request: Request, body: ChatCompletionRequest, arrival: float) -> Response:
    """Answers a parsed chat request (400 / 404 / 429 / 503 before any byte is sent); the
    response's HEADER names the chat template used."""
    state = http_request.app.state
    model, default_max_tokens = state.model, state.options.default_max_tokens
    model.check_model(body)
    if body.top_logprobs is not None and not body.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
    if body.chat_template is not None and not state.options.trust_request_chat_template:
        raise ApiError(400, "a request's own chat_template is refused: start the server with "
                       "--trust-request-chat-template to allow it", param="chat_template")
    structured, tool_calls = await checked_constraint(body, chat=True, tool_call_parser=state.options.tool_call_parser)
    parser = PARSERS[state.options.tool_call_parser] if auto_tool_choice(body) else None  # constraint() checked it
    text, source = await off_loop(_render, model, body, what="rendering the chat template",
                                  param="chat_template" if body.chat_template is not None else "messages")
    prompt = model.truncate(await off_loop(model.encode, text, bool(body.add_special_tokens),
                                           what="tokenizing the chat", param="messages"),
                            body.truncate_prompt_tokens)
    if not prompt:
        raise ApiError(400, "the rendered chat is empty", param="messages")
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    if max_tokens is None:
        max_tokens = min(default_max_tokens or model.max_model_len, model.room(len(prompt)))
    params = sampling_params(body, max_tokens, (body.top_logprobs or 0) if body.logprobs else None,
                             model.info.vocab_size, structured)
    serving = ChatServing(http_request, body, [prompt], params, tool_calls, parser, arrival)
    return await serving.respond({HEADER: source})


def template_message(m: ChatMessage) -> dict:
    """A message as chat templates read it (Hugging Face's form): a call's arguments as a mapping,
    which templates write out with `tojson`, where the OpenAI API sends them as JSON text."""
    message = {"role": m.role, "content": m.text}
    if m.name:
        message["name"] = m.name
    if m.tool_calls:
        message["tool_calls"] = [{"id": c.id, "type": c.type, "function": {
            "name": c.function.name, "arguments": _arguments(c.function.arguments)}} for c in m.tool_calls]
    if m.tool_call_id is not None:
        message["tool_call_id"] = m.tool_call_id
    return message


def _arguments(text: str):
    """A call's arguments for the template: the mapping the JSON text holds; an empty text as no
    arguments; other text as it is (a model may have written arguments that are not JSON, and the
    client sends back what it got: templates write a string as it is)."""
    if not text.strip():
        return {}
    try:
        arguments = json.loads(text)
    except ValueError:
        return text
    return arguments if isinstance(arguments, dict) else text


def _render(model: ServedModel, body: ChatCompletionRequest) -> tuple[str, str]:
    """The chat as the prompt's text, and which template rendered it."""
    messages = [template_message(m) for m in body.messages]
    variables = body.chat_template_kwargs
    if body.tools:  # templates that know tools describe them to the model, whatever tool_choice says
        variables = {"tools": [t.model_dump(by_alias=True, exclude_none=True) for t in body.tools],
                     **(variables or {})}
    try:
        return model.templates.render(messages, body.add_generation_prompt is not False, body.chat_template,
                                      variables, offload.TIME_LIMIT_S)
    except ValueError as e:
        raise ApiError(400, str(e), param="messages")
    except TimeoutError:  # a request's own template, its worker killed
        raise ApiError(400, f"rendering the chat template took over {offload.TIME_LIMIT_S:g} s to process",
                       param="chat_template") from None


class ChatServing(Serving):
    """A chat completion's choices: assistant messages (or tool calls), streamed as deltas."""

    ID_PREFIX, OBJECT, CHUNK_OBJECT = "chatcmpl", "chat.completion", "chat.completion.chunk"

    def __init__(self, http_request: Request, body: ChatCompletionRequest, prompts: list[list[int]], params,
                 tool_calls: ToolCalls | None, parser: ToolCallParser | None, arrival: float):
        """`tool_calls`: the reply is constrained to tool calls, read back from its text; `parser`:
        the reply may hold tool calls in the parser's format (tool_choice "auto")."""
        super().__init__(http_request, body, prompts, params, bool(body.logprobs), arrival)
        self.tool_calls, self.parser = tool_calls, parser
        self.streams = [ToolCallStream(parser) for _ in self.choices] if parser is not None else []

    def final_choice(self, index: int) -> dict:
        c = self.choices[index]
        message, finish = self._message(c)
        return {"index": index, "message": message,
                "logprobs": _logprobs(c, 0, c.num_tokens) if self.logprobs else None, "finish_reason": finish}

    def delta_choice(self, index: int, text: str, start: int, end: int) -> dict:
        c = self.choices[index]
        logprobs = _logprobs(c, start, end) if self.logprobs else None
        return {"index": index, "delta": {"content": text} if text else {}, "logprobs": logprobs,
                "finish_reason": c.finish_reason}

    def opening_choice(self, index: int) -> dict:
        return {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}

    def choice_chunk(self, index: int) -> dict | None:
        if self.tool_calls is not None:
            return self._tool_calls_chunk(index)
        if self.parser is not None:
            return self._parsed_chunk(index)
        return super().choice_chunk(index)

    def _parsed_chunk(self, index: int) -> dict | None:
        """A streamed reply that may hold tool calls: its content until what may be a call, then
        each call whole once it is complete (tool_parsers.py)."""
        c, stream = self.choices[index], self.streams[index]
        finished = c.finish_reason is not None
        content, calls = stream.feed(c.new_text(), finished)
        start, c.emitted_tokens = c.emitted_tokens, c.num_tokens
        if not content and not calls and start == c.num_tokens and not finished:
            return None
        delta = {"content": content} if content else {}
        if calls:
            first = stream.num_calls - len(calls)
            delta["tool_calls"] = [{"index": first + k, **call.openai()} for k, call in enumerate(calls)]
        return {"index": index, "delta": delta,
                "logprobs": _logprobs(c, start, c.num_tokens) if self.logprobs else None,
                "finish_reason": "tool_calls" if c.finish_reason == "stop" and stream.called else c.finish_reason}

    def _tool_calls_chunk(self, index: int) -> dict | None:
        """A streamed reply constrained to tool calls: held back, then its calls in one delta."""
        c = self.choices[index]
        if c.finish_reason is None:
            return None
        message, finish = self._message(c)
        delta = ({"tool_calls": [{"index": k, **call} for k, call in enumerate(message["tool_calls"])]}
                 if "tool_calls" in message else {"content": message["content"]})
        start, c.emitted_tokens = c.emitted_tokens, c.num_tokens
        logprobs = _logprobs(c, start, c.num_tokens) if self.logprobs else None
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}

    def _message(self, c: Choice) -> tuple[dict, str | None]:
        """A choice's message and finish reason: its text, or its tool calls when the reply was
        constrained to them (and is complete JSON), or the calls the parser reads in it and the
        text around them."""
        content, calls = c.final_text, None
        if self.tool_calls is not None:
            calls = self.tool_calls.parse(c.final_text)
            content = None if calls is not None else content
        elif self.parser is not None:
            content, parsed = self.parser.parse(c.final_text)
            calls = [call.openai() for call in parsed] or None
        if calls is None:
            return {"role": "assistant", "content": content}, c.finish_reason
        return ({"role": "assistant", "content": content, "tool_calls": calls},
                "tool_calls" if c.finish_reason == "stop" else c.finish_reason)


def _logprobs(c: Choice, start: int, end: int) -> dict:
    """Chat logprobs of tokens start..end, each with its alternatives."""
    def entry(text, logprob):
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}
    return {"content": [{**entry(c.pieces[i], c.logprobs[i]),
                         "top_logprobs": [entry(t, v) for t, v in c.tops[i]]} for i in range(start, end)]}
