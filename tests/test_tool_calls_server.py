"""tool_choice "auto" over HTTP with the official `openai` client: a tiny Qwen3 whose chat template
describes the tools and asks for Hermes tool calls, served with the hermes parser (engine core in
a thread). A random model writes no call by itself, so `structured_outputs.choice` forces the
reply's text: the calls read back, streamed and whole, are known exactly. Also: tool_choice "none",
the llama3_json parser, the 400 without a parser, and the command line."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from conftest import build_checkpoint, build_symbols_tokenizer
from jaxserve import Engine, EngineConfig
from jaxserve.entrypoints.api_server import create_app
from jaxserve.entrypoints.app_state import ServerOptions
from jaxserve.entrypoints.chat_template import ChatTemplates
from jaxserve.entrypoints.cli import build_parser, serve
from jaxserve.entrypoints.engine_client import EngineClient
from jaxserve.entrypoints.protocol import ChatCompletionRequest
from jaxserve.entrypoints.serving_chat import template_message
from jaxserve.tokenizer import Tokenizer
from server_helpers import ServerThread, wait_idle

# Qwen's turn markers, and the tools described in a system turn as Qwen 2.5 and 3 templates do (no
# newlines in what the model writes: the tiny tokenizer cannot spell them).
HERMES_TEMPLATE = """\
{% if tools %}<|im_start|>system
Functions you may call, in <tools></tools>:
<tools>{% for tool in tools %}{{ tool | tojson }}{% endfor %}</tools>
To call one, write <tool_call>{"name": <name>, "arguments": <object>}</tool_call>.<|im_end|>
{% endif %}
{% for m in messages %}<|im_start|>{{ m['role'] }}
{% if m['role'] == 'tool' %}<tool_response>{{ m['content'] }}</tool_response>{% else %}{{ m['content'] }}{% endif %}\
{% for call in m['tool_calls'] or [] %}<tool_call>{{ call['function'] | tojson }}</tool_call>{% endfor %}<|im_end|>
{% endfor %}
{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
WEATHER = {"type": "function", "function": {"name": "get_weather",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
MESSAGES = [{"role": "user", "content": "the weather in paris and oslo?"}]
CALLS = [("get_weather", '{"city": "paris"}'), ("get_weather", '{"city": "oslo"}')]
REPLY = ('Let me look. <tool_call>{"name": "get_weather", "arguments": {"city": "paris"}}</tool_call> '
         '<tool_call>{"name": "get_weather", "arguments": {"city": "oslo"}}</tool_call>')


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    path = build_checkpoint(str(tmp_path_factory.mktemp("qwen3-hermes")), "qwen3")
    build_symbols_tokenizer(path)  # spells the JSON of a call
    with open(f"{path}/tokenizer_config.json", "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": "</s>", "chat_template": HERMES_TEMPLATE}, f)
    return path


@pytest.fixture(scope="module")
def client(checkpoint):
    engine = Engine.from_pretrained(checkpoint, EngineConfig(max_slots=4, page_size=8, num_pages=128, max_model_len=512,
                                                       max_num_batched_tokens=128, dtype="float32"))
    client = EngineClient.in_thread(engine)
    yield client
    client.stop()


@pytest.fixture(scope="module")
def server(client):
    with ServerThread(create_app(client, tool_call_parser="hermes")) as s:
        yield s


def chat(server, reply: str, messages=MESSAGES, **kwargs):
    """A chat completion with the official client whose reply is forced to be `reply` (max_tokens: the
    rest of the context; the reply ends once it is written)."""
    api = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    return api.chat.completions.create(model=api.models.list().data[0].id, messages=messages,
                                       extra_body={"structured_outputs": {"choice": [reply]}}, **kwargs)


def test_auto_reads_the_calls_in_a_reply(server):
    completion = chat(server, REPLY, tools=[WEATHER])  # tool_choice absent: "auto"
    (choice,) = completion.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me look."
    calls = choice.message.tool_calls
    assert [(c.type, c.function.name, c.function.arguments) for c in calls] == [("function", *c) for c in CALLS]
    assert all(c.id.startswith("call_") for c in calls) and calls[0].id != calls[1].id
    plain = chat(server, "no call needed", tools=[WEATHER], tool_choice="auto")
    assert plain.choices[0].message.content == "no call needed" and plain.choices[0].message.tool_calls is None
    assert plain.choices[0].finish_reason == "stop"
    wait_idle(server)


def test_auto_streams_content_then_each_call(server):
    chunks = list(chat(server, REPLY, tools=[WEATHER], tool_choice="auto", stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert deltas[0].role == "assistant"
    assert "".join(d.content or "" for d in deltas) == "Let me look."
    streamed = [call for d in deltas for call in d.tool_calls or []]
    assert [(s.index, s.type, s.function.name, s.function.arguments) for s in streamed] == [
        (0, "function", *CALLS[0]), (1, "function", *CALLS[1])]
    assert all(s.id.startswith("call_") for s in streamed)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "tool_calls" and not any(finishes[:-1])
    # no content after the first call: the space between the calls is dropped, not sent
    first_call = next(i for i, d in enumerate(deltas) if d.tool_calls)
    assert not any(d.content for d in deltas[first_call:])


def test_tool_choice_none_shows_the_tools_and_reads_no_calls(server):
    none = chat(server, REPLY, tools=[WEATHER], tool_choice="none")
    assert none.choices[0].message.content == REPLY and none.choices[0].message.tool_calls is None
    assert none.choices[0].finish_reason == "stop"
    without_tools = chat(server, "ok", max_completion_tokens=4)
    assert none.usage.prompt_tokens > without_tools.usage.prompt_tokens + 50  # the tools are in the prompt


# The second turn of a tool call, as the OpenAI API sends it: the assistant's call (its arguments as
# JSON text, with text Jinja's own `tojson` would escape) and the tool's answer.
CITY = "Zürich <north> & 'old town'"
HISTORY = [*MESSAGES,
           {"role": "assistant", "content": None, "tool_calls": [{
               "id": "call_1", "type": "function",
               "function": {"name": "get_weather", "arguments": json.dumps({"city": CITY})}}]},
           {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "clear"}'}]


def test_a_tool_calls_history_renders_as_transformers_renders_it(server, checkpoint):
    """The calls and the tool's answer reach the chat template as Hugging Face's
    apply_chat_template gives them (the arguments as a mapping, written by its `tojson`): the
    prompt the server tokenizes is transformers' rendering, token for token."""
    from transformers import AutoTokenizer
    hf = AutoTokenizer.from_pretrained(checkpoint)
    as_hf = [{**m, "tool_calls": [{**c, "function": {"name": c["function"]["name"],
                                                       "arguments": json.loads(c["function"]["arguments"])}}
                                  for c in m["tool_calls"]]} if "tool_calls" in m else m for m in HISTORY]
    text = hf.apply_chat_template(as_hf, tools=[WEATHER], tokenize=False, add_generation_prompt=True)
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Zürich <north> & \'old town\'"}}' \
           '</tool_call>' in text and "<tool_response>" in text
    body = ChatCompletionRequest.model_validate({"messages": HISTORY, "tools": [WEATHER]})
    tokenizer = Tokenizer.from_dir(checkpoint)
    rendered, _ = ChatTemplates(tokenizer, "model").render(
        [template_message(m) for m in body.messages], variables={"tools": [WEATHER]})
    assert rendered == text
    answer = chat(server, "ok", messages=HISTORY, tools=[WEATHER])  # the prompt leaves a few positions
    assert answer.choices[0].message.content == "ok" and answer.choices[0].finish_reason == "stop"
    assert answer.usage.prompt_tokens == len(tokenizer.encode(text, add_special_tokens=False))
    wait_idle(server)


def test_calls_whose_arguments_are_not_a_json_object_go_to_the_template_as_written(checkpoint):
    """A model may write arguments that are not JSON, and the client sends back what it got: the
    template gets that text (and an empty one as no arguments), as the model wrote it."""
    calls = [{"id": f"call_{i}", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
             for i, arguments in enumerate(["paris", "", "[1]"])]
    body = ChatCompletionRequest.model_validate({"messages": [{"role": "assistant", "tool_calls": calls}]})
    rendered, _ = ChatTemplates(Tokenizer.from_dir(checkpoint), "model").render(
        [template_message(m) for m in body.messages], add_generation_prompt=False)
    assert rendered == ('<|im_start|>assistant\n<tool_call>{"name": "get_weather", "arguments": "paris"}</tool_call>'
                        '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>'
                        '<tool_call>{"name": "get_weather", "arguments": "[1]"}</tool_call><|im_end|>\n')


def test_llama3_json_parser(client):
    reply = '{"name": "get_weather", "parameters": {"city": "paris"}}; {"name": "get_weather", "parameters": ' \
            '{"city": "oslo"}}'
    with ServerThread(create_app(client, tool_call_parser="llama3_json")) as s:
        whole = chat(s, reply, tools=[WEATHER]).choices[0]
        chunks = list(chat(s, reply, tools=[WEATHER], stream=True))
    assert whole.finish_reason == "tool_calls" and whole.message.content is None
    assert [(c.function.name, c.function.arguments) for c in whole.message.tool_calls] == CALLS
    streamed = [call for c in chunks if c.choices for call in c.choices[0].delta.tool_calls or []]
    assert [(s.index, s.function.name, s.function.arguments) for s in streamed] == [(0, *CALLS[0]), (1, *CALLS[1])]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_auto_without_a_parser_is_a_400_naming_the_flag(client):
    with ServerThread(create_app(client)) as s:
        for choice in ({}, {"tool_choice": "auto"}):
            r = httpx.post(s.url + "/v1/chat/completions", timeout=30,
                           json={"messages": MESSAGES, "max_tokens": 4, "tools": [WEATHER], **choice})
            assert r.status_code == 400
            assert r.json() == {"error": {
                "message": 'tool_choice "auto" (the default with tools) needs a tool-call parser: start the server '
                           'with --tool-call-parser (hermes or llama3_json, the format the model writes its calls '
                           'in), or set tool_choice to "required", {"type": "function", "function": {"name": ...}} '
                           'or "none"',
                "type": "invalid_request_error", "param": "tool_choice", "code": None}}
        wait_idle(s)  # nothing was queued


def test_the_command_line_takes_the_parser():
    args = build_parser().parse_args(["serve", "--tool-call-parser", "hermes", "--enable-auto-tool-choice"])
    assert args.tool_call_parser == "hermes" and args.enable_auto_tool_choice
    with pytest.raises(SystemExit):  # argparse: not one of the choices
        build_parser().parse_args(["serve", "--tool-call-parser", "mistral"])
    alone = build_parser().parse_args(["serve", "--enable-auto-tool-choice"])
    with pytest.raises(ValueError, match="^--enable-auto-tool-choice needs --tool-call-parser: the format the model "
                                         r"writes its tool calls in \(hermes, llama3_json\)$"):
        serve(alone)  # refused before anything starts
    with pytest.raises(ValueError, match="tool_call_parser must be one of hermes, llama3_json, got 'mistral'"):
        ServerOptions(tool_call_parser="mistral")
