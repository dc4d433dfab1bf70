"""What the server accepts and says, on a tiny Llama (engine core in a thread): every OpenAI and
vLLM field by name, no-op defaults, clear 400s for what it cannot honour, continuous usage,
the chat template it used, the OpenAPI document, and command-line options -> EngineConfig."""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys

import httpx
import pytest

from jaxserve import Engine, EngineConfig
from jaxserve.entrypoints.chat_template import ChatTemplates
from jaxserve.entrypoints.engine_client import EngineClient
from jaxserve.entrypoints.api_server import create_app
from server_helpers import ServerThread, wait_idle

CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "the quick brown fox"}]


@pytest.fixture(scope="module")
def client(checkpoints):
    engine = Engine.from_pretrained(checkpoints("llama"), EngineConfig(
        max_slots=8, page_size=8, num_pages=128, max_model_len=128))
    client = EngineClient.in_thread(engine)
    yield client
    client.stop()


@pytest.fixture(scope="module")
def server(client):
    with ServerThread(create_app(client)) as s:
        yield s


def post(server, path, body, **kwargs):
    return httpx.post(server.url + path, json=body, timeout=60, **kwargs)


def sse(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]


def test_guidellm_style_stream_has_usage_in_every_chunk(server):
    body = {"prompt": "the quick brown fox", "max_tokens": 5, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    chunks = sse(post(server, "/v1/completions", body).text)
    assert all(c["usage"] for c in chunks)
    done = [c["usage"]["completion_tokens"] for c in chunks if c["choices"] and c["choices"][0]["text"]]
    assert done == sorted(done) and chunks[-1]["usage"]["completion_tokens"] == 5
    plain = sse(post(server, "/v1/completions", {**body, "stream_options": {"include_usage": True}}).text)
    assert all(c["usage"] is None for c in plain[:-1]) and plain[-1]["usage"]["completion_tokens"] == 5


NO_OPS = {"tool_choice": "none", "tools": [], "parallel_tool_calls": True, "user": "u-1", "metadata": {"k": "v"},
          "store": False, "service_tier": "auto", "stop": None, "response_format": {"type": "text"},
          "logit_bias": {}, "presence_penalty": 0, "frequency_penalty": 0.0, "repetition_penalty": 1,
          "n": 1, "seed": 3, "top_k": -1, "min_tokens": 0, "skip_special_tokens": True, "functions": [],
          "modalities": ["text"], "prompt_cache_key": "k", "safety_identifier": "s", "include_reasoning": False,
          "add_generation_prompt": True, "chat_template_kwargs": {}, "best_of": None, "priority": 0,
          "stream_options": None, "max_completion_tokens": 3, "logprobs": False, "echo": False}


def test_no_op_defaults_are_accepted(server):
    chat = post(server, CHAT, {"messages": MESSAGES, **NO_OPS})
    assert chat.status_code == 200, chat.text
    completion = {k: v for k, v in NO_OPS.items() if k not in (
        "tool_choice", "tools", "parallel_tool_calls", "metadata", "store", "service_tier", "functions",
        "modalities", "prompt_cache_key", "safety_identifier", "include_reasoning", "add_generation_prompt",
        "chat_template_kwargs", "max_completion_tokens", "logprobs")}
    r = post(server, "/v1/completions", {"prompt": "the quick", "max_tokens": 3, "best_of": 1, "suffix": "",
                                          "logprobs": None, "add_special_tokens": True, **completion})
    assert r.status_code == 200, r.text


REFUSED = [
    (CHAT, {"tools": [{"type": "function", "function": {"name": "f"}}]}, 'tool_choice "auto"'),
    (CHAT, {"tool_choice": "required"}, "needs tools"),
    (CHAT, {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 5}}}}, "is invalid"),
    (CHAT, {"logit_bias": {"5": 10}}, "logit_bias is not implemented"),
    (CHAT, {"presence_penalty": 0.5}, "presence_penalty is not implemented"),
    (CHAT, {"store": True}, "does not store"),
    (CHAT, {"service_tier": "flex"}, "one service tier"),
    (CHAT, {"reasoning_effort": "low"}, "does not reason"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "content part type 'image_url' is not supported"),
    (CHAT, {"max_tokenz": 3}, "unknown field 'max_tokenz' (did you mean 'max_tokens'?)"),
    ("/v1/completions", {"max_token": 3}, "unknown field 'max_token' (did you mean 'max_tokens'?)"),
    ("/v1/completions", {"best_of": 3}, "best_of > 1"),
    ("/v1/completions", {"suffix": "end"}, "suffix"),
    ("/v1/completions", {"min_tokens": 2}, "min_tokens is not implemented"),
    ("/v1/completions", {"guided_json": {}}, "use structured_outputs"),
    ("/v1/completions", {"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
]


@pytest.mark.parametrize("path, extra, message", REFUSED, ids=[r[2][:30] for r in REFUSED])
def test_values_that_cannot_be_honoured_are_400(server, path, extra, message):
    base = {"messages": MESSAGES} if path == CHAT else {"prompt": "hi"}
    r = post(server, path, {**base, "max_tokens": 2, **extra})
    assert r.status_code == 400, r.text
    assert message in r.json()["error"]["message"], r.json()


def test_honoured_vllm_fields(server):
    base = {"prompt": "the quick brown fox jumps", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    text = post(server, "/v1/completions", base).json()["choices"][0]["text"]
    stop = text.strip()[1:3]
    cut = post(server, "/v1/completions", {**base, "stop": stop, "include_stop_str_in_output": True}).json()
    assert cut["choices"][0]["text"].endswith(stop) and cut["choices"][0]["finish_reason"] == "stop"
    r = post(server, "/v1/completions", {**base, "truncate_prompt_tokens": 2, "request_id": "mine"}).json()
    assert r["usage"]["prompt_tokens"] == 2 and r["id"] == "mine"
    with_bos = post(server, "/v1/completions", base).json()["usage"]["prompt_tokens"]
    no_bos = post(server, "/v1/completions", {**base, "add_special_tokens": False}).json()["usage"]["prompt_tokens"]
    assert no_bos == with_bos - 1
    wait_idle(server)


def test_chat_names_its_template(server, tmp_path, client):
    r = post(server, CHAT, {"messages": MESSAGES, "max_tokens": 2})
    assert r.headers["x-chat-template"] == "model"
    own = {"messages": MESSAGES, "max_tokens": 2, "chat_template": "{{ messages[0]['content'] }} =>"}
    refused = post(server, CHAT, own)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "chat_template"
    assert "--trust-request-chat-template" in refused.json()["error"]["message"]
    with ServerThread(create_app(client, trust_request_chat_template=True)) as trusting:
        r = post(trusting, CHAT, own)
        assert r.headers["x-chat-template"] == "request" and r.json()["usage"]["prompt_tokens"] == 7
    path = tmp_path / "turns.jinja"
    path.write_text("{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }}\n{% endfor %}")
    with ServerThread(create_app(client, chat_template=str(path))) as other:
        r = post(other, CHAT, {"messages": MESSAGES, "max_tokens": 2, "stream": True})
        assert r.headers["x-chat-template"] == "file:turns.jinja" and r.text.endswith("data: [DONE]\n\n")


def test_a_slow_request_template_fails_its_request_and_stalls_nothing(client, monkeypatch):
    """A trusted request template that renders for seconds: /health answers meanwhile, and the
    request fails with a 400 once past the time limit (here 0.5 s). (The issue's 100 ms p99 is a
    benchmark's target; a loaded test machine only shows the loop was not held.)"""
    import threading
    import time
    from jaxserve.entrypoints import offload
    monkeypatch.setattr(offload, "TIME_LIMIT_S", 0.5)
    slow = "{% for i in range(5000) %}{% for j in range(5000) %}{% endfor %}{% endfor %}{{ messages[0]['content'] }}"
    app = create_app(client, trust_request_chat_template=True)
    with ServerThread(app) as trusting:
        got = {}
        sender = threading.Thread(target=lambda: got.update(r=post(trusting, CHAT, {
            "messages": MESSAGES, "max_tokens": 2, "chat_template": slow})))
        sender.start()
        time.sleep(0.1)
        health = []
        while sender.is_alive():
            t = time.perf_counter()
            assert httpx.get(f"{trusting.url}/health").status_code == 200
            health.append(time.perf_counter() - t)
        # The loop answered while the template rendered (on the loop, it would have held every
        # answer for the whole render, seconds): several times, each in well under a second.
        assert len(health) >= 3 and max(health) < 1.0, health
        assert got["r"].status_code == 400 and "took over 0.5 s" in got["r"].json()["error"]["message"]
        assert got["r"].json()["error"]["param"] == "chat_template"
        # The render ran in a worker process, killed at the limit (a thread would render on)
        deadline = time.monotonic() + 5
        while app.state.model.templates.sandbox.killed < 1:
            assert time.monotonic() < deadline, "the slow template's worker was not killed"
            time.sleep(0.05)
        quick = post(trusting, CHAT, {"messages": MESSAGES, "max_tokens": 2,
                                      "chat_template": "{{ messages[0]['content'] }} =>"})
        assert quick.status_code == 200 and quick.headers["x-chat-template"] == "request"
        refusing = post(trusting, CHAT, {"messages": MESSAGES, "max_tokens": 2,
                                         "chat_template": "{{ raise_exception('no system role') }}"})
        assert refusing.status_code == 400 and "no system role" in refusing.json()["error"]["message"]


def test_a_large_answer_is_built_off_the_loop_and_equals_the_one_built_on_it(server, monkeypatch):
    import threading
    from jaxserve.entrypoints import offload, serving
    body = {"prompt": "a b c", "max_tokens": 6, "n": 2, "temperature": 0, "logprobs": 2, "ignore_eos": True}
    on_loop = post(server, "/v1/completions", body).json()
    built_in, encode = [], serving._json
    monkeypatch.setattr(serving, "_json", lambda *a: built_in.append(threading.current_thread().name) or encode(*a))
    monkeypatch.setattr(offload, "LARGE_ANSWER_TOKENS", 11)  # 12 tokens: large
    off_loop = post(server, "/v1/completions", body).json()
    assert built_in[0].startswith("jaxserve-answer")
    assert [c["text"] for c in off_loop["choices"]] == [c["text"] for c in on_loop["choices"]]
    assert [c["logprobs"] for c in off_loop["choices"]] == [c["logprobs"] for c in on_loop["choices"]]
    assert off_loop["usage"] == on_loop["usage"]


def test_the_api_key_comes_from_the_environment(monkeypatch):
    from jaxserve.entrypoints.cli import build_parser, serve_api_key
    for env, flag, expected in [({"JAXSERVE_API_KEY": "a"}, [], "a"), ({"VLLM_API_KEY": "b"}, [], "b"),
                                ({"JAXSERVE_API_KEY": "a"}, ["--api-key", "c"], "c"), ({}, [], None)]:
        for name in ("JAXSERVE_API_KEY", "VLLM_API_KEY"):
            monkeypatch.delenv(name, raising=False)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        assert serve_api_key(build_parser().parse_args(["serve", *flag])) == expected, (env, flag)


def test_a_model_without_a_template_chats_with_a_builtin_one_and_warns(client, caplog):
    tokenizer = client.info.tokenizer
    bare = type(tokenizer)(tokenizer._tok, None, tokenizer.bos_token, tokenizer.eos_token)
    with caplog.at_level(logging.WARNING, logger="jaxserve.entrypoints.chat_template"):
        templates = ChatTemplates(bare, None)
        text, source = templates.render(MESSAGES)
    assert source == "builtin:plain" and text == "user: the quick brown fox\nassistant:"
    assert "no chat template of its own" in caplog.text
    gemma = ChatTemplates(tokenizer, "builtin:gemma3")
    assert gemma.builtin and gemma.render(MESSAGES)[1] == "builtin:gemma3"


def test_openapi_describes_bodies_responses_and_errors(server):
    doc = httpx.get(server.url + "/openapi.json").json()
    schemas = doc["components"]["schemas"]
    for path, model in (("/v1/completions", "CompletionRequest"), (CHAT, "ChatCompletionRequest")):
        op = doc["paths"][path]["post"]
        assert op["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith(model)
        assert {"prompt", "stream_options", "tool_choice"} & set(schemas[model]["properties"])
        assert {"200", "400", "404", "413", "429", "503"} <= set(op["responses"])
        error = op["responses"]["429"]
        assert error["content"]["application/json"]["schema"]["$ref"].endswith("ErrorResponse")
        assert "Retry-After" in error["headers"]
        assert {"application/json", "text/event-stream"} <= set(op["responses"]["200"]["content"])
    assert "continuous_usage_stats" in schemas["StreamOptions"]["properties"]
    assert schemas["CompletionRequest"]["properties"]["max_tokens"]["maximum"] == 127
    assert set(doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}
    assert "503" in doc["paths"]["/health"]["get"]["responses"]
    assert httpx.get(server.url + "/docs").status_code == 200


def test_engine_args_make_the_engine_config():
    from jaxserve.entrypoints.engine_args import add_engine_args, engine_config_from_args
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--max-slots", "4", "--kv-cache-mb", "64", "--mesh", "data=2,model=1",
                              "--strategy", "dynamic", "--max-batch-delay-ms", "5"])
    config = engine_config_from_args(args, max_waiting=7)
    assert config == EngineConfig(max_slots=4, kv_cache_bytes=64 << 20, mesh={"data": 2, "model": 1},
                                  strategy="dynamic", max_batch_delay_ms=5.0, max_waiting=7)
    assert engine_config_from_args(parser.parse_args([])) == EngineConfig()
    vllm = parser.parse_args(["--max-num-seqs", "8", "--block-size", "32", "--num-gpu-blocks-override", "100"])
    assert engine_config_from_args(vllm) == EngineConfig(max_slots=8, page_size=32, num_pages=100)
    assert engine_config_from_args(parser.parse_args(["--quantization", "int8"])).quantization == "int8"
    assert engine_config_from_args(parser.parse_args(["--quantization", "none"])).quantization is None
    with pytest.raises(SystemExit):
        parser.parse_args(["--quantization", "int4"])



def test_serve_without_the_server_extras_says_what_to_install():
    code = "import sys; sys.modules['fastapi'] = None; from jaxserve.entrypoints.cli import main; main(['serve'])"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 1
    assert run.stderr.strip() == ("error: serving needs the server extras (fastapi is missing): "
                                  "pip install 'jaxserve[server]'")


def test_replicas_without_the_ray_extra_say_what_to_install():
    code = "import sys; sys.modules['ray'] = None; from jaxserve.entrypoints.cli import main; main(['serve', '--replicas', '2'])"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 1
    assert run.stderr.strip() == ("error: --replicas runs engine replicas behind Ray Serve, which needs the ray "
                                  "extra (ray is missing): pip install 'jaxserve[ray]'")


def test_only_ray_serve_imports_ray():
    code = ("import sys, jaxserve, jaxserve.entrypoints.cli, jaxserve.entrypoints.api_server, jaxserve.entrypoints.engine_client, jaxserve.engine.core_process; "
            "print('ray' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split() \
        == ["False"]


def test_api_process_imports_neither_the_cli_nor_jax():
    """Imports point one way (cli -> server -> engine_args), and the API process never starts jax."""
    code = "import sys, jaxserve.entrypoints.api_server; print('jaxserve.entrypoints.cli' in sys.modules, 'jax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def test_max_tokens_defaults_to_16_for_completions_the_context_for_chat_or_the_servers_default(server, client):
    def usage(srv, path, body):
        r = post(srv, path, {**body, "ignore_eos": True})
        assert r.status_code == 200, r.text
        return r.json()["usage"]
    completion = {"prompt": "the quick brown fox"}
    chat = {"messages": MESSAGES}
    context = client.info.max_model_len
    assert usage(server, "/v1/completions", completion)["completion_tokens"] == 16
    chat_usage = usage(server, CHAT, chat)
    assert chat_usage["completion_tokens"] == context - chat_usage["prompt_tokens"]
    with ServerThread(create_app(client, default_max_tokens=3)) as capped:
        assert usage(capped, "/v1/completions", completion)["completion_tokens"] == 3
        assert usage(capped, CHAT, chat)["completion_tokens"] == 3
        assert usage(capped, CHAT, {**chat, "max_tokens": 5})["completion_tokens"] == 5
    with ServerThread(create_app(client, default_max_tokens=context)) as roomy:  # past what the prompt leaves
        for path, body in (("/v1/completions", completion), (CHAT, chat)):
            got = usage(roomy, path, body)
            assert got["completion_tokens"] == context - got["prompt_tokens"], path
    with pytest.raises(ValueError, match="default_max_tokens"):
        create_app(client, default_max_tokens=0)
    wait_idle(server)
