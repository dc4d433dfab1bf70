"""The OpenAI-compatible server on a tiny Llama: a real uvicorn server on loopback, checked with the
official `openai` client (completions, chat, streaming, n > 1, list prompts, logprobs) and httpx
(every bad input, 401, 413, 429, disconnects, /health, /metrics, 200 concurrent requests).

The engine core runs in a thread here (`EngineClient.in_thread`): the same loop and the same ZMQ
channel as the engine process of `jaxserve serve`, which tests/test_server_clients.py runs for
real. Functions run on the engine (`call`) are module-level, because calls are pickled."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time

import httpx
import openai
import pytest

from jaxserve import Engine, EngineConfig, SamplingParams
from jaxserve.entrypoints.engine_client import EngineClient
from jaxserve.entrypoints.api_server import create_app
from jaxserve.faults import faults
from server_helpers import ServerThread, metrics, wait_idle

MAX_BODY = 16 << 10


@pytest.fixture(scope="module")
def engine(checkpoints):
    return Engine.from_pretrained(checkpoints("llama"), EngineConfig(
        max_slots=16, page_size=8, num_pages=256, max_model_len=128))


@pytest.fixture(scope="module")
def loop_engine(engine):
    client = EngineClient.in_thread(engine)
    yield client
    client.stop()


@pytest.fixture(scope="module")
def server(loop_engine):
    with ServerThread(create_app(loop_engine, max_body_bytes=MAX_BODY)) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model(engine):
    return engine.model_name


def on_loop(loop_engine, fn, *args):
    """fn(engine, *args) run on the engine's loop (the only thread that may touch the engine)."""
    return asyncio.run(loop_engine.call(fn, *args))


def _generate(engine, prompt, params):
    return engine.generate(prompt, params)[0]


def _set_config(engine, config):
    engine.config = config


_BLOCK_STARTED, _BLOCK_RELEASE = threading.Event(), threading.Event()


def _block(engine, fn=None, *args):
    """Holds the engine's loop until _BLOCK_RELEASE is set (the core runs in this process here)."""
    if fn is not None:
        fn(engine, *args)
    _BLOCK_STARTED.set()
    _BLOCK_RELEASE.wait(30)


GREEDY = dict(temperature=0, extra_body={"ignore_eos": True})


# ---- the openai client ----

def test_completion_matches_engine_and_counts_usage(client, model, loop_engine, server):
    out = client.completions.create(model=model, prompt="the quick brown fox", max_tokens=6, **GREEDY)
    ref = on_loop(loop_engine, _generate, "the quick brown fox", SamplingParams(
        max_tokens=6, temperature=0, ignore_eos=True))
    choice = out.choices[0]
    assert choice.finish_reason == "length" and choice.index == 0
    assert choice.text == ref.text and choice.text
    assert out.usage.completion_tokens == 6 and out.usage.prompt_tokens == ref.num_prompt_tokens
    assert out.usage.total_tokens == out.usage.prompt_tokens + 6
    assert out.model == model and out.object == "text_completion"
    echoed = client.completions.create(model=model, prompt="the quick brown fox", max_tokens=6, echo=True, **GREEDY)
    assert echoed.choices[0].text == "the quick brown fox" + choice.text
    wait_idle(server)


def test_chat_completion(client, model, engine):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the quick brown fox"}]
    out = client.chat.completions.create(model=model, messages=messages, max_tokens=5, **GREEDY)
    assert out.object == "chat.completion" and out.choices[0].message.role == "assistant"
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 5
    rendered = "system: be brief\nuser: the quick brown fox\nassistant:"
    assert out.usage.prompt_tokens == len(engine.tokenizer.encode(rendered, add_special_tokens=False))
    # max_tokens defaults to the rest of the context
    parts = client.chat.completions.create(model=model, messages=messages[1:], max_tokens=None, temperature=0,
                                           seed=3, extra_body={"ignore_eos": True, "max_completion_tokens": 4})
    assert parts.usage.completion_tokens == 4


def test_streaming_matches_non_streaming_and_reports_usage(client, model):
    full = client.completions.create(model=model, prompt="jax compiles", max_tokens=8, **GREEDY)
    chunks = list(client.completions.create(model=model, prompt="jax compiles", max_tokens=8, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    chat = list(client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=4, stream=True, stream_options={"include_usage": True},
                                               **GREEDY))
    assert chat[0].choices[0].delta.role == "assistant"
    assert chat[-2].choices[0].finish_reason == "length" and chat[-1].usage.completion_tokens == 4


def test_n_choices_and_list_prompts(client, model):
    sampled = dict(model=model, prompt="a stitch in time", max_tokens=6, n=3, temperature=1.0, seed=7,
                   extra_body={"ignore_eos": True})
    first, again = client.completions.create(**sampled), client.completions.create(**sampled)
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]  # seeds seed + i
    assert len({c.text for c in first.choices}) > 1
    assert first.usage.completion_tokens == 18
    prompts = ["the lazy dog", "paged attention", "jax"]
    batch = client.completions.create(model=model, prompt=prompts, max_tokens=5, **GREEDY)
    alone = [client.completions.create(model=model, prompt=p, max_tokens=5, **GREEDY).choices[0].text
             for p in prompts]
    assert [c.text for c in batch.choices] == alone
    tokens = client.completions.create(model=model, prompt=[[5, 6, 7], [9, 10]], max_tokens=3, n=2, **GREEDY)
    assert len(tokens.choices) == 4 and tokens.usage.prompt_tokens == 5


def test_logprobs(client, model):
    out = client.completions.create(model=model, prompt="the quick brown", max_tokens=5, logprobs=3, **GREEDY)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert "".join(lp.tokens) == out.choices[0].text
    assert all(x <= 0 for x in lp.token_logprobs) and all(1 <= len(t) <= 3 for t in lp.top_logprobs)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    # greedy: the chosen token is the most likely one
    assert all(abs(max(t.values()) - x) < 1e-4 for t, x in zip(lp.top_logprobs, lp.token_logprobs))
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                          logprobs=True, top_logprobs=2, **GREEDY)
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(c.top_logprobs) == 2 and c.logprob <= 0 for c in content)


def test_stop_strings_cut_text_also_when_streaming(client, model):
    base = client.completions.create(model=model, prompt="the quick", max_tokens=10, **GREEDY).choices[0].text
    stop = base.strip()[3:5] if len(base.strip()) >= 5 else base.strip()[-1:]
    out = client.completions.create(model=model, prompt="the quick", max_tokens=10, stop=stop, **GREEDY)
    assert out.choices[0].finish_reason == "stop" and stop not in out.choices[0].text
    assert base.startswith(out.choices[0].text)
    chunks = client.completions.create(model=model, prompt="the quick", max_tokens=10, stop=[stop], stream=True,
                                       **GREEDY)
    assert "".join(c.choices[0].text for c in chunks) == out.choices[0].text


# ---- errors ----

BAD_REQUESTS = [
    ("/v1/completions", b'{"prompt": "hi", ', 400, "malformed JSON"),
    ("/v1/completions", b'["hi"]', 400, "JSON object"),
    ("/v1/completions", {"prompt": "hi", "frobnicate": 1}, 400, "unknown field 'frobnicate'"),
    ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "5"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": [1, "a"]}, 400, "prompt must be a string"),
    ("/v1/completions", {"max_tokens": 5}, 400, "'prompt' is required"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt must not be empty"),
    ("/v1/completions", {"prompt": []}, 400, "prompt must not be empty"),
    ("/v1/completions", {"prompt": ["ok", ""]}, 400, "prompt must not be empty"),
    ("/v1/completions", {"prompt": [5, 999]}, 400, "token ids must be in [0, 160)"),
    ("/v1/completions", {"prompt": [5] * 100, "max_tokens": 40}, 400, "prompt (100 tokens) plus max_tokens (40)"),
    ("/v1/completions", {"prompt": [5] * 200, "max_tokens": 1}, 400, "200 tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens must be"),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, 400, "temperature must be >= 0"),
    ("/v1/completions", {"prompt": "hi", "top_p": 2}, 400, "top_p must be in (0, 1]"),
    ("/v1/completions", {"prompt": "hi", "top_k": -2}, 400, "top_k"),
    ("/v1/completions", {"prompt": "hi", "seed": -1}, 400, "seed"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 9}, 400, "logprobs must be"),
    ("/v1/completions", {"prompt": "hi", "n": 1000}, 400, "less than or equal to 16"),
    ("/v1/completions", {"prompt": ["hi"] * 20, "n": 16}, 400, "choices per request"),
    ("/v1/completions", {"prompt": "hi", "presence_penalty": 0.5}, 400, "presence_penalty is not implemented"),
    ("/v1/completions", {"prompt": "hi", "frequency_penalty": 1}, 400, "frequency_penalty is not implemented"),
    ("/v1/completions", {"prompt": "hi", "repetition_penalty": 1.2}, 400, "repetition_penalty is not implemented"),
    ("/v1/completions", {"prompt": "hi", "stop": [1]}, 400, "stop must be a string"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [5000]}, 400, "stop_token_ids"),
    ("/v1/completions", {"prompt": "hi", "echo": True, "logprobs": 1}, 400, "echo with logprobs"),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-9"}, 404, "'gpt-9' does not exist"),
    ("/v1/chat/completions", {"model": None}, 400, "'messages' is required"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages.0.role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400, "message content must be"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400, "logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 500}, 400,
     "max_model_len=128"),
    ("/v1/nothing", {"prompt": "hi"}, 404, "Not Found"),
]


@pytest.mark.parametrize("path, body, status, message", BAD_REQUESTS, ids=[f"{b[2]}-{b[3][:24]}" for b in BAD_REQUESTS])
def test_bad_requests_get_openai_errors(server, path, body, status, message):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(server.url + path, content=content, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert message in error["message"], error
    assert set(error) == {"message", "type", "param", "code"} and error["type"]


def test_body_too_large_is_413(server):
    big = json.dumps({"prompt": "x" * MAX_BODY}).encode()
    r = httpx.post(server.url + "/v1/completions", content=big)
    assert r.status_code == 413 and "exceeds the limit" in r.json()["error"]["message"]

    def chunks():  # no Content-Length: the size is counted while reading
        yield b'{"prompt": "'
        for _ in range(MAX_BODY // 1024 + 1):
            yield b"y" * 1024
        yield b'"}'
    r = httpx.post(server.url + "/v1/completions", content=chunks())
    assert r.status_code == 413


def test_api_key(loop_engine, model):
    app = create_app(loop_engine, api_key="sekrit")

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
            assert (await c.get("/v1/models")).status_code == 401
            bad = await c.post("/v1/completions", json={"prompt": "hi"}, headers={"Authorization": "Bearer nope"})
            assert bad.status_code == 401 and bad.json()["error"]["code"] == "invalid_api_key"
            assert (await c.get("/health")).status_code == 200
            ok = await c.get("/v1/models", headers={"Authorization": "Bearer sekrit"})
            assert ok.status_code == 200 and ok.json()["data"][0]["id"] == model
            out = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                               headers={"Authorization": "Bearer sekrit"})
            assert out.status_code == 200 and out.json()["usage"]["completion_tokens"] <= 2
    asyncio.run(go())


@contextlib.contextmanager
def blocked_loop(loop_engine, *fn_and_args):
    """Holds the engine's loop inside fn(engine, *args) (then waiting) so that commands pile up."""
    _BLOCK_STARTED.clear()
    _BLOCK_RELEASE.clear()
    thread = threading.Thread(target=on_loop, args=(loop_engine, _block, *fn_and_args))
    thread.start()
    assert _BLOCK_STARTED.wait(30)
    try:
        yield
    finally:
        _BLOCK_RELEASE.set()
        thread.join(30)


MAX_WAITING = 2
BURST = 4 * MAX_WAITING


def test_a_burst_past_the_queue_gets_429_with_retry_after_and_the_rest_is_served(server, loop_engine, engine):
    config = engine.config
    body = {"prompt": "hi", "max_tokens": 2, "ignore_eos": True}

    async def go():
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as c:
            with blocked_loop(loop_engine, _set_config, config.replace(max_waiting=MAX_WAITING)):
                sends = [asyncio.ensure_future(c.post("/v1/completions", json=body)) for _ in range(BURST)]
                deadline = time.monotonic() + 20
                while len(loop_engine.subscribers) < BURST:  # the whole burst is queued behind the blocked loop
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.01)
            return await asyncio.gather(*sends)
    try:
        results = asyncio.run(go())
    finally:
        on_loop(loop_engine, _set_config, config)
    served = [r for r in results if r.status_code == 200]
    busy = [r for r in results if r.status_code == 429]
    assert len(served) == MAX_WAITING and len(busy) == BURST - MAX_WAITING, [r.text for r in results]
    assert all(r.json()["choices"][0]["finish_reason"] == "length" for r in served)
    for r in busy:
        assert r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "queue_full" and "waiting queue is full" in r.json()["error"]["message"]
    wait_idle(server)
    assert httpx.post(server.url + "/v1/completions", json=body, timeout=30).status_code == 200


def test_disconnects_abort_and_free_pages(server, model, loop_engine):
    before = metrics(server).get('jaxserve_requests_finished_total{finish_reason="abort"}', 0)
    body = {"model": model, "prompt": "the quick brown fox", "max_tokens": 100, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server.url) as c:
        with c.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            got = [next(lines) for _ in range(4)]  # two events and their blank lines
            assert got[0].startswith("data: ")
        with blocked_loop(loop_engine), pytest.raises(httpx.ReadTimeout):  # a non-streaming client gives up
            c.post("/v1/completions", json={**body, "stream": False}, timeout=0.3)
    m = wait_idle(server)
    assert m['jaxserve_requests_finished_total{finish_reason="abort"}'] == before + 2


def test_concurrent_requests_all_succeed_and_free_everything(server, model):
    async def one(c, i):
        body = {"model": model, "prompt": f"the lazy dog {i % 7}", "max_tokens": 3 + i % 3, "temperature": 0.5,
                "stream": i % 4 == 0}
        r = await c.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        return r.text.endswith("data: [DONE]\n\n") if body["stream"] else r.json()["choices"][0]["finish_reason"]

    async def go():
        limits = httpx.Limits(max_connections=200, max_keepalive_connections=200)
        async with httpx.AsyncClient(base_url=server.url, limits=limits, timeout=120) as c:
            return await asyncio.gather(*(one(c, i) for i in range(200)))
    assert all(asyncio.run(go()))
    m = wait_idle(server)
    assert m["jaxserve_kv_pages_total"] == 255


def test_health_and_metrics(server):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    r = httpx.get(server.url + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    for name in ("jaxserve_num_requests_running", "jaxserve_num_requests_waiting", "jaxserve_kv_cache_usage_percent",
                 "jaxserve_prompt_tokens_total", "jaxserve_generation_tokens_total", "jaxserve_num_preemptions_total",
                 "jaxserve_num_compiles_total", "jaxserve_time_to_first_token_seconds_bucket",
                 "jaxserve_time_per_output_token_seconds_bucket", "jaxserve_e2e_request_latency_seconds_bucket",
                 "jaxserve_request_queue_time_seconds_bucket", "jaxserve_requests_rejected_total"):
        assert name in r.text, name
    m = metrics(server)
    assert m["jaxserve_generation_tokens_total"] > 0 and m["jaxserve_num_compiles_total"] > 0
    assert m["jaxserve_time_to_first_token_seconds_count"] > 0
    # a request reaches the engine loop (every one), then the scheduler admits it, then it samples a token
    handoff, queue, ttft = (m[f"jaxserve_{name}_sum"] / m[f"jaxserve_{name}_count"] for name in (
        "request_handoff_seconds", "request_queue_time_seconds", "time_to_first_token_seconds"))
    assert m["jaxserve_request_handoff_seconds_count"] >= m["jaxserve_request_queue_time_seconds_count"] > 0
    assert 0 < handoff < ttft and queue < ttft


def test_a_prompt_sampled_n_times_counts_its_tokens_once(server):
    """The counter adds what usage.prompt_tokens says: each prompt once, however many choices."""
    def counted(path, body):
        before = metrics(server)["jaxserve_prompt_tokens_total"]
        r = httpx.post(server.url + path, json=body, timeout=60).json()
        return r, metrics(server)["jaxserve_prompt_tokens_total"] - before
    r, added = counted("/v1/completions", {"prompt": [5, 6, 7, 8, 9], "n": 3, "max_tokens": 2})
    assert r["usage"]["prompt_tokens"] == added == 5 and len(r["choices"]) == 3
    r, added = counted("/v1/completions", {"prompt": [[5, 6, 7, 8, 9], [10, 11]], "n": 3, "max_tokens": 2})
    assert r["usage"]["prompt_tokens"] == added == 7 and len(r["choices"]) == 6
    r, added = counted("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 2,
                                                "max_tokens": 2})
    assert r["usage"]["prompt_tokens"] == added > 0 and len(r["choices"]) == 2


class _BrokenEngine:
    """Dies on its first step, as a bug in the engine loop would."""
    model_name, max_model_len, tokenizer = "broken", 128, None

    def __init__(self):
        self.work = False

    def has_unfinished(self):
        return self.work

    idle = False

    def add_request(self, prompt, params, request_id=None, group=None, arrival_time=None, cache_salt=None):
        self.work = True
        self.prompt = prompt
        raise ValueError("never added")  # so the payload fails first ...

    def step(self):
        raise RuntimeError("boom")

    def stats(self):
        return dict(running=0, waiting=0, free_pages=1, cached_pages=0, used_pages=0, total_pages=1)


def test_dead_engine_loop_makes_health_503():
    broken = _BrokenEngine()
    app = create_app(broken)

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
            assert (await c.get("/health")).status_code == 200
            chat = await c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
            assert chat.status_code == 400 and "no tokenizer" in chat.json()["error"]["message"]
            r = await c.post("/v1/completions", json={"prompt": [1, 2]})  # ... then the loop steps and dies
            assert r.status_code == 400
            for _ in range(100):  # the death is seen first, its cause a moment later
                health = await c.get("/health")
                if health.status_code == 503 and "boom" in health.text:
                    break
                await asyncio.sleep(0.01)
            assert health.status_code == 503 and "boom" in health.json()["error"]["message"]
            r = await c.post("/v1/completions", json={"prompt": [1, 2]})
            assert r.status_code == 503
    asyncio.run(go())


@pytest.fixture
def own_client(checkpoints):
    """An engine loop of its own, in a thread: these tests break its receiver."""
    client = EngineClient.in_thread(Engine.from_pretrained(checkpoints("llama"), EngineConfig(
        max_slots=4, page_size=8, num_pages=64, max_model_len=128)))
    yield client
    client.stop()


def _post_and_health(app, body, steps):
    """POSTs `body`; meanwhile `steps()` breaks something; returns (the response, /health after)."""
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test",
                                     timeout=60) as c:
            r = await c.post("/v1/completions", json=body)
            for _ in range(200):
                health = await c.get("/health")
                if health.status_code == 503 or not steps():
                    break
                await asyncio.sleep(0.01)
            return r, health, await c.post("/v1/completions", json={**body, "max_tokens": 2})
    return asyncio.run(go())


def test_a_failure_delivering_outputs_ends_those_requests_and_the_server_goes_on(own_client, monkeypatch):
    real, failures = own_client.subscribers.deliver, []

    def deliver_fails_once(outputs):
        if outputs and not failures:
            failures.append(outputs)
            raise RuntimeError("a bug in delivering outputs")
        return real(outputs)
    monkeypatch.setattr(own_client.subscribers, "deliver", deliver_fails_once)
    r, health, after = _post_and_health(create_app(own_client), {"prompt": [5, 6, 7], "max_tokens": 8},
                                        lambda: False)
    assert failures and r.status_code == 503 and r.json()["error"]["type"] == "server_error"
    assert "failed to deliver" in r.json()["error"]["message"]
    assert health.status_code == 200 and after.status_code == 200  # the receiver goes on


def test_a_request_whose_output_cannot_be_delivered_ends_alone(server, loop_engine, engine):
    """The receiver fails on one request's output: that request ends with `error` (and is aborted
    in the engine, freeing its pages); the one beside it gets a fault-free run's tokens; /health
    stays 200, as the receiver goes on."""
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    alone = on_loop(loop_engine, _generate, [5, 6, 7], params).token_ids

    async def run(prefix):
        (request_id,), deltas = await loop_engine.submit([[5, 6, 7]], [params], prefix)
        tokens = []
        while True:
            for d in await asyncio.wait_for(deltas.get(), 30):
                tokens += d.token_ids
                if d.finish_reason is not None:
                    return tokens, d.finish_reason, d.error

    async def go():
        return await asyncio.gather(run("undelivered"), run("delivered"))
    faults.arm("receive", "undelivered-0")
    try:
        bad, good = asyncio.run(go())
    finally:
        faults.clear()
    assert bad == ([], "error", "the server failed to deliver this request's output")
    assert good == (alone, "length", None)
    assert httpx.get(server.url + "/health").status_code == 200
    wait_idle(server)


def test_a_receiver_that_dies_turns_health_503_and_ends_what_was_in_flight(own_client, monkeypatch):
    from jaxserve.entrypoints import engine_channel
    real, calls = engine_channel.pickle.loads, []

    def loads(data, *args, **kwargs):  # pickle's own: only the receiver's third message fails
        if threading.current_thread().name == "jaxserve-receiver":
            calls.append(1)
            if len(calls) == 3:  # a few messages in: the request is in flight
                raise MemoryError("the receiver cannot go on")
        return real(data, *args, **kwargs)
    monkeypatch.setattr(engine_channel.pickle, "loads", loads)
    r, health, after = _post_and_health(create_app(own_client), {"prompt": [5, 6, 7], "max_tokens": 60,
                                                                 "ignore_eos": True}, lambda: True)
    assert r.status_code == 503 and "stopped receiving" in r.json()["error"]["message"]
    assert health.status_code == 503 and after.status_code == 503


def test_usage_counts_prompt_tokens_served_from_the_prefix_cache(client, model, engine):
    """usage.prompt_tokens_details.cached_tokens: the full pages (8 tokens) of a prompt that an
    earlier prompt computed, in JSON bodies, in a stream's usage chunk and for chat."""
    shared = list(range(100, 116))  # two full pages, in no other test's prompt
    first = client.completions.create(model=model, prompt=shared + [3, 4, 5], max_tokens=2, **GREEDY)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    second = client.completions.create(model=model, prompt=shared + [6, 7, 8, 9], max_tokens=2, **GREEDY)
    assert second.usage.prompt_tokens_details.cached_tokens == 16 and second.usage.prompt_tokens == 20
    streamed = list(client.completions.create(model=model, prompt=shared + [11, 12], max_tokens=2, stream=True,
                                              stream_options={"include_usage": True}, **GREEDY))
    assert streamed[-1].usage.prompt_tokens_details.cached_tokens == 16

    system = {"role": "system", "content": "paged attention keeps kv memory tight. " * 3}
    questions = ["the quick brown fox", "a stitch in time"]
    ids = [engine.tokenizer.encode(f"system: {system['content']}\nuser: {q}\nassistant:", add_special_tokens=False)
           for q in questions]
    common = next(i for i, (a, b) in enumerate(zip(*ids)) if a != b)
    expected = min(common, len(ids[1]) - 1) // 8 * 8  # full pages of the shared prefix, last token computed
    assert expected >= 16
    chats = [client.chat.completions.create(model=model, messages=[system, {"role": "user", "content": q}],
                                            max_tokens=2, **GREEDY) for q in questions]
    assert chats[1].usage.prompt_tokens == len(ids[1])
    assert chats[1].usage.prompt_tokens_details.cached_tokens == expected


def test_vllm_named_gauges_follow_the_engine(server, loop_engine, model):
    """The gauges llm-d's router reads, under vLLM's names: 20 long requests on 16 slots leave 4
    waiting while the others hold KV pages, and every gauge is back to 0 once they are done."""
    before = metrics(server)["jaxserve_generation_tokens_total"]

    async def go():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as c:
            with blocked_loop(loop_engine):  # all 20 reach the scheduler together
                sends = [asyncio.ensure_future(c.post("/v1/completions", json={
                    "model": model, "prompt": [20 + i, 50 + i, 40], "max_tokens": 100, "ignore_eos": True}))
                    for i in range(20)]
                deadline = time.monotonic() + 20
                while len(loop_engine.subscribers) < 20:
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.01)
            while metrics(server)["jaxserve_generation_tokens_total"] == before:  # their first step ran ...
                await asyncio.sleep(0.01)
            with blocked_loop(loop_engine):  # ... so hold the loop within the 100 steps of the first 16
                busy = metrics(server)
            return busy, await asyncio.gather(*sends)
    busy, responses = asyncio.run(go())
    assert all(r.status_code == 200 for r in responses)
    assert busy["vllm:num_requests_waiting"] == 4 and busy["vllm:num_requests_running"] == 16
    usage = busy["jaxserve_kv_pages_used"] / busy["jaxserve_kv_pages_total"]
    assert usage > 0 and busy["vllm:kv_cache_usage_perc"] == busy["vllm:gpu_cache_usage_perc"] == pytest.approx(usage)
    idle = wait_idle(server)
    for name in ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
                 "vllm:gpu_cache_usage_perc"):
        assert idle[name] == 0, name


def test_n_siblings_compute_their_prompt_once_and_salts_separate(server, model, client):
    prompt = list(range(10, 42))  # 32 tokens: 3 full pages before the last token (page size 8)
    before = metrics(server)
    out = client.completions.create(model=model, prompt=prompt, n=4, max_tokens=3, temperature=0)
    assert len({c.text for c in out.choices}) == 1  # greedy siblings agree
    m = wait_idle(server)
    hits = m["jaxserve_prefix_cache_hits_total"] - before["jaxserve_prefix_cache_hits_total"]
    assert hits == 3 * 24  # the 3 siblings after the first took its 3 full pages from the cache
    salted = client.completions.create(model=model, prompt=prompt, max_tokens=3, temperature=0,
                                       extra_body={"cache_salt": "tenant-b"})
    m2 = wait_idle(server)
    assert m2["jaxserve_prefix_cache_hits_total"] == m["jaxserve_prefix_cache_hits_total"]  # another tenant: no hit
    assert salted.choices[0].text == out.choices[0].text
    bad = httpx.post(server.url + "/v1/completions", json={"model": model, "prompt": "x", "cache_salt": 5})
    assert bad.status_code == 400 and "cache_salt" in bad.json()["error"]["message"]
