"""A real `jaxserve serve` (API process + engine process) on a tiny Llama, driven by the clients
people use: GuideLLM (a short concurrent run, zero errors) and Schemathesis (every check against
the OpenAPI document); and the guarantees that cross the process boundary: a disconnect frees its
pages, 64 concurrent streams lose nothing, and /health turns 503 when the engine process dies."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import time
from xml.etree import ElementTree

import httpx
import pytest
from server_helpers import MAX_MODEL_LEN, Serve, metrics, wait_idle

HERE = os.path.dirname(__file__)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """The module's compile cache: empty for `serve`, then holding its programs for later servers."""
    return str(tmp_path_factory.mktemp("cold-cache"))


@pytest.fixture(scope="module")
def serve(checkpoints, tmp_path_factory, cache_dir):
    # An empty compile cache: every step program compiles while /health reports the progress.
    # Schemathesis sends hundreds of chat requests without max_tokens: 16 tokens each, not the rest
    # of the context, is the same answer to check against the schema in a fraction of the time.
    s = Serve(checkpoints("llama"), str(tmp_path_factory.mktemp("serve") / "serve.log"),
              cache_dir=cache_dir, args=("--default-max-tokens", "16"))
    # Compile the shapes the runs below use, so no request waits for XLA.
    for stream in (False, True):
        httpx.post(s.url + "/v1/completions", timeout=120, json={
            "prompt": "the quick brown fox " * 8, "max_tokens": 32, "stream": stream, "logprobs": 2})
    yield s
    s.close()


def test_health_reports_the_start_up_until_the_engine_is_ready(serve):
    """The port answers from the start: 503 in the OpenAI envelope with the start-up's phase and
    the compile's progress (never going back), then 200 once every program is ready."""
    compiling = [b["startup"] for b in serve.starting if b["startup"]["phase"] == "compiling"]
    assert compiling, serve.starting[:3]
    assert all(b["error"]["code"] == "engine_starting" and b["error"]["type"] == "server_error"
               for b in serve.starting)
    done = [s["done"] for s in compiling]
    assert done == sorted(done) and all(0 <= s["done"] <= s["total"] for s in compiling)
    assert httpx.get(serve.url + "/health").json() == {"status": "ok"}
    assert metrics(serve)["jaxserve_num_compiles_total"] == compiling[-1]["total"]



def _loads_jax(pid: int) -> bool:
    """Whether a process has jaxlib's native code mapped, which `import jax` always does."""
    with open(f"/proc/{pid}/maps") as f:
        return "jaxlib" in f.read()


def test_the_api_process_never_loads_jax_while_it_serves(serve):
    """After real requests of each kind (completions, streamed, chat, /v1/engine/state and the
    dashboard's files), jax lives in the engine process only."""
    assert httpx.post(serve.url + "/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}).status_code == 200
    for path in ("/v1/engine/state", "/dashboard", "/metrics", "/v1/models"):
        assert httpx.get(serve.url + path, timeout=30).status_code == 200, path
    assert _loads_jax(serve.engine_process().pid)
    assert not _loads_jax(serve.proc.pid)


def offline_env(**extra) -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "NO_COLOR": "1", **extra}


def test_guidellm_concurrent_run_has_no_errors(serve, checkpoints, tmp_path):
    out = tmp_path / "guidellm.json"
    guidellm = os.path.join(os.path.dirname(sys.executable), "guidellm")
    run = subprocess.run(
        [guidellm, "run", "--backend", f"kind=openai_http,target={serve.url}",
         "--profile", "kind=concurrent,streams=4",
         "--data", "kind=synthetic_text,prompt_tokens=32,output_tokens=16",
         "--tokenizer", f"kind=hf_auto,model={checkpoints('llama')}",
         "--constraint", "kind=max_requests,count=16", "--output", f"kind=json,path={out}",
         "--disable-progress"], env=offline_env(), capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    bench = json.loads(out.read_text())["benchmarks"][0]
    state = bench["scheduler_state"]
    assert state["successful_requests"] == 16 and state["errored_requests"] == 0, state
    assert bench["metrics"]["output_token_count"]["successful"]["mean"] > 0
    wait_idle(serve, timeout=30)


def test_schemathesis_all_checks_pass(serve, tmp_path):
    schemathesis = os.path.join(os.path.dirname(sys.executable), "schemathesis")
    env = offline_env(SCHEMATHESIS_HOOKS="schemathesis_hooks", PYTHONPATH=HERE,
                      JAXSERVE_TEST_MAX_MODEL_LEN=str(MAX_MODEL_LEN))
    run = subprocess.run(
        [schemathesis, "run", f"{serve.url}/openapi.json", "--checks", "all", "--max-examples", "10",
         "--max-response-time", "60", "--request-timeout", "120", "--seed", "1", "--no-color",
         "--report", "junit", "--report-junit-path", str(tmp_path / "junit.xml")],
        env=env, capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    # /v1/engine/state was run, not skipped: its answers were checked against its schema too
    cases = {case.get("name"): case for case in ElementTree.parse(tmp_path / "junit.xml").iter("testcase")}
    state = cases.get("GET /v1/engine/state")
    assert state is not None and state.find("skipped") is None, sorted(cases)
    assert httpx.get(serve.url + "/health").status_code == 200
    wait_idle(serve, timeout=30)


def test_disconnect_frees_pages_across_processes(serve):
    before = metrics(serve).get('jaxserve_requests_finished_total{finish_reason="abort"}', 0)
    body = {"prompt": "the quick brown fox", "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=serve.url, timeout=60) as c:
        with c.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
    m = wait_idle(serve, timeout=30)
    assert m['jaxserve_requests_finished_total{finish_reason="abort"}'] == before + 1


def test_64_concurrent_streams_lose_nothing(serve):
    async def one(c, i):
        body = {"prompt": f"the lazy dog {i}", "max_tokens": 8 + i % 5, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
        text, usage = "", None
        async with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunk = json.loads(line[6:])
                    assert chunk["usage"] is not None  # continuous usage: in every chunk
                    usage = chunk["usage"]
                    text += "".join(ch["text"] for ch in chunk["choices"])
        return usage["completion_tokens"] == body["max_tokens"] and bool(text)

    async def go():
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(base_url=serve.url, limits=limits, timeout=300) as c:
            return await asyncio.gather(*(one(c, i) for i in range(64)))
    assert all(asyncio.run(go()))
    assert wait_idle(serve, timeout=30)["jaxserve_kv_pages_used"] == 0


def test_engine_process_death_makes_health_503(checkpoints, tmp_path, serve, cache_dir):
    s = Serve(checkpoints("llama"), str(tmp_path / "serve.log"), cache_dir=cache_dir, args=("--engine-restarts", "0"))
    try:
        s.engine_process().kill()
        deadline = time.monotonic() + 20
        while httpx.get(s.url + "/health").status_code != 503:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "hi"})
        assert r.status_code == 503 and "engine" in r.json()["error"]["message"]
    finally:
        s.close()


def test_both_processes_keep_their_start_up_objects_out_of_the_collectors_passes(serve):
    """The API process and the engine process each freeze what start-up left (jaxserve/heap.py), so
    that no full collection walks it while they serve."""
    with open(serve.log_path) as f:
        log = f.read()
    for process in ("jaxserve.entrypoints.api_server", "jaxserve.engine.core_process"):
        frozen = re.search(process + r": (\d+) start-up objects frozen out of the garbage collector's passes", log)
        assert frozen and int(frozen[1]) > 10_000, (process, log[-3000:])
