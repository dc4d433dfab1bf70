"""The engine's state snapshot (jaxserve/engine/state.py) and GET /v1/engine/state, on a tiny Llama:
it agrees with Engine.stats() and with the requests actually running at every step, names every
page's owner, holds no prompt or output text, answers 401 without the key; and /dashboard is
served from the package's own files, with nothing fetched from elsewhere."""

from __future__ import annotations

import asyncio
import fnmatch
import json
import os
import re
import threading
import tomllib
from types import SimpleNamespace

import httpx
import pytest

from jaxserve import Engine, EngineConfig, SamplingParams
from jaxserve.engine.batching import BlockManager
from jaxserve.entrypoints.dashboard import FILES
from jaxserve.entrypoints.engine_client import EngineClient
from jaxserve.engine.state import CACHED, FREE, SHARED, engine_state
from jaxserve.entrypoints.openapi import EngineState, EngineStats
from jaxserve.entrypoints.api_server import create_app
from server_helpers import ServerThread, response_validator, wait_idle

ROOT = os.path.dirname(os.path.dirname(__file__))
STATIC = os.path.join(ROOT, "jaxserve", "entrypoints", "static")
SHARED_PREFIX = "the quick brown fox jumps over the lazy dog. a stitch in time saves nine. "


@pytest.fixture(scope="module")
def engine(checkpoints):
    return Engine.from_pretrained(checkpoints("llama"), EngineConfig(
        max_slots=4, page_size=8, num_pages=64, max_model_len=128, max_num_batched_tokens=16))


def owners(state: dict) -> list[int]:
    """The owner of each page 1..total, decoded from the run-length pairs."""
    out = []
    for owner, count in state["pages"]["owners"]:
        out += [owner] * count
    return out


def check_against_engine(state: dict, engine) -> None:
    """Every value of the snapshot against stats() and the scheduler, taken at the same moment."""
    EngineState.model_validate(state)  # the documented schema, no field more or less
    stats, scheduler = engine.stats(), engine.scheduler
    busy = [s for s in state["slots"] if s["phase"] != "free"]
    assert len(state["slots"]) == engine.config.max_slots
    assert len(busy) == state["num_running"] == stats["running"] == len(scheduler.running)
    assert state["num_waiting"] == stats["waiting"]
    assert [w["request_id"] for w in state["waiting"]] == [r.request_id for r in scheduler.waiting]
    assert [w["num_tokens"] for w in state["waiting"]] == [r.num_tokens for r in scheduler.waiting]
    for r in scheduler.running:
        s = state["slots"][r.slot]
        assert (s["request_id"], s["num_tokens"], s["num_computed_tokens"], s["pages"]) == \
            (r.request_id, r.num_tokens, r.num_computed_tokens, len(r.pages[0]))
        assert s["phase"] == ("prefill" if r.num_uncomputed_tokens > 1 else "decode")
    pages = state["pages"]
    assert (pages["total"], pages["free"], pages["cached"], pages["used"]) == \
        (stats["total_pages"], stats["free_pages"], stats["cached_pages"], stats["used_pages"])
    owner = owners(state)
    assert pages["cell"] == 1 and len(owner) == pages["total"]
    assert owner.count(FREE) == pages["free"] and owner.count(CACHED) == pages["cached"]
    assert owner.count(SHARED) == pages["shared"]
    assert sum(1 for o in owner if o >= 0) + pages["shared"] == pages["used"]
    for r in scheduler.running:
        assert all(owner[p - 1] in (r.slot, SHARED) for p in r.pages[0])
    assert state["step"] == stats["num_steps"] == engine.num_steps
    if engine.num_steps:
        assert state["history"][-1]["step"] == engine.num_steps
        assert state["history"][-1]["used_pages"] == engine.history[-1].used_pages


def test_snapshot_agrees_with_stats_and_the_running_requests(engine):
    eng = engine.with_strategy("paged")
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    # 6 requests on 4 slots; two pairs start with the same full pages (shared through the prefix cache)
    prompts = [SHARED_PREFIX + "jax", SHARED_PREFIX + "paged", "a stitch", "jax compiles python functions to xla.",
               "paged attention keeps kv memory tight.", "the lazy dog"]
    for i, p in enumerate(prompts):  # the first one runs long, so the second shares its pages while it runs
        eng.add_request(p, params if i else SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    seen = set()
    check_against_engine(engine_state(eng), eng)
    while eng.has_unfinished():
        eng.step()
        state = engine_state(eng)
        check_against_engine(state, eng)
        seen |= {s["phase"] for s in state["slots"]}
        seen |= {"waiting"} if state["waiting"] else set()
        seen |= {"shared"} if state["pages"]["shared"] else set()
    assert seen == {"prefill", "decode", "free", "waiting", "shared"}
    state = engine_state(eng)
    assert all(s["phase"] == "free" and s["request_id"] is None for s in state["slots"])
    assert state["pages"]["used"] == 0 and state["pages"]["cached"] > 0  # the prefix cache keeps full pages
    json.dumps(state)


def test_history_since_a_step(engine):
    eng = engine.with_strategy("paged")
    eng.generate(["a stitch in time", "the lazy dog"], SamplingParams(max_tokens=5, ignore_eos=True))
    n = eng.num_steps
    assert [h["step"] for h in engine_state(eng)["history"]] == list(range(1, n + 1))
    assert [h["step"] for h in engine_state(eng, since=n - 2)["history"]] == [n - 1, n]
    assert engine_state(eng, since=n)["history"] == [] and engine_state(eng, since=10**9)["history"] == []
    last = eng.history[-1]
    assert engine_state(eng, since=n - 1)["history"] == [{
        "step": n, "time": last.time, "tokens": last.tokens, "decode_rows": last.decode_rows,
        "prefill_tokens": last.prefill_tokens, "running": last.running, "waiting": last.waiting,
        "used_pages": last.used_pages, "cached_pages": last.cached_pages}]


def test_a_large_pool_is_mapped_in_cells(monkeypatch):
    from jaxserve.engine import state as module
    blocks = BlockManager(3 * module.MAX_CELLS + 1, 16)  # cells of 3 pages
    a, b = blocks.allocate(5), blocks.allocate(4000)  # pages 1-5 and 6-4005
    blocks.share(a[:2])
    running = [SimpleNamespace(slot=1, pages=[a]), SimpleNamespace(slot=2, pages=[b]),
               SimpleNamespace(slot=7, pages=[a[:2]]), SimpleNamespace(slot=None, pages=[])]
    pages = module._pages(blocks, running)
    assert (pages["total"], pages["used"], pages["shared"], pages["cell"]) == (3 * module.MAX_CELLS, 4005, 2, 3)
    cells = owners({"pages": pages})
    assert len(cells) == module.MAX_CELLS
    # pages 1-3: shared, shared, slot 1 -> slot 1; 4-6: slot 1, slot 1, slot 2 -> the higher slot
    assert cells[:3] == [1, 2, 2] and cells[1335] == FREE and set(cells[2:1335]) == {2}
    blocks.free(b)
    monkeypatch.setattr(module, "REFRESH", 1e9)  # the map is kept, the counts are not
    kept = module._pages(blocks, running)
    assert kept["owners"] == pages["owners"] and kept["used"] == 5
    monkeypatch.setattr(module, "REFRESH", 0)
    assert owners({"pages": module._pages(blocks, running[:1] + running[2:])})[1:3] == [1, FREE]


def _leaves(value):
    """Every string and every list of numbers in a JSON value (keys excluded: the schema fixes them)."""
    if isinstance(value, dict):
        for v in value.values():
            yield from _leaves(v)
    elif isinstance(value, list):
        if value and all(isinstance(v, int) for v in value):
            yield value
        for v in value:
            yield from _leaves(v)
    elif isinstance(value, str):
        yield value


def test_snapshot_holds_no_text(engine):
    eng = engine.with_strategy("paged")
    prompts = ["jax compiles python functions to xla.", "paged attention keeps kv memory tight."]
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=3)
    ids = [eng.add_request(p, params) for p in prompts]
    states = []
    while eng.has_unfinished():
        eng.step()
        states.append(engine_state(eng))
    texts = [eng.output(i).text for i in ids]
    assert any(len(t) >= 8 for t in texts)
    words = {w for text in prompts + texts for w in re.findall(r"[a-z]{3,}", text)}
    for state in states:
        dump = json.dumps(state)
        assert not any(text.strip() in dump for text in prompts + texts)
        for leaf in _leaves(state):
            if isinstance(leaf, str):  # ids, the model's name, the strategy, phases: no word of a text
                assert leaf in ids or not words & set(re.findall(r"[a-z]{3,}", leaf)) - {"paged"}, leaf
            else:  # no token ids: the only lists of numbers are [owner, count] pairs
                assert len(leaf) == 2, leaf


# ---- over HTTP ----

@pytest.fixture(scope="module")
def client(engine):
    # after the tests above: the engine loop's clone shares the model and KV pool with theirs
    client = EngineClient.in_thread(engine.with_strategy("paged"))
    yield client
    client.stop()


@pytest.fixture(scope="module")
def server(client):
    with ServerThread(create_app(client)) as s:
        yield s


def _state_and_truth(engine):
    """The snapshot and what it must agree with, taken in one go on the engine's loop."""
    return engine_state(engine), engine.stats(), {r.request_id: r.slot for r in engine.scheduler.running}


def test_state_over_http_follows_the_requests_running(server, client):
    r = httpx.get(server.url + "/v1/engine/state")
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    conforms = response_validator(server, "/v1/engine/state")  # what /openapi.json promises
    conforms.validate(r.json())
    EngineState.model_validate(r.json())
    EngineStats.model_validate(r.json()["stats"], strict=True)  # every stat named, each of its documented type
    ids: dict[int, str] = {}  # completion ids, known from each stream's first chunk

    def stream(i):
        body = {"prompt": f"the lazy dog {i}", "max_tokens": 100, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    ids.setdefault(i, json.loads(line[6:])["id"])
    threads = [threading.Thread(target=stream, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    busy, queued, matched, over_http = 0, 0, False, 0
    for _ in range(500):
        state, stats, running = asyncio.run(client.call(_state_and_truth))
        slots = {s["request_id"]: s["slot"] for s in state["slots"] if s["phase"] != "free"}
        assert slots == running and state["num_running"] == stats["running"]
        assert state["pages"]["used"] == stats["used_pages"] and state["num_waiting"] == stats["waiting"]
        busy, queued = max(busy, len(slots)), max(queued, state["num_waiting"])
        # each engine request id is "<completion id>-<8 hex>-<choice>"
        matched |= bool(slots) and all(rid.rsplit("-", 2)[0] in set(ids.values()) for rid in slots)
        http = httpx.get(server.url + "/v1/engine/state").json()
        conforms.validate(http)  # with slots taken and requests waiting too
        over_http = max(over_http, http["num_running"])
        if busy == 4 and queued >= 2 and matched and over_http:
            break
    for t in threads:
        t.join(60)
    # 4 slots, 6 requests: 2 wait, or 3 in a snapshot taken after the last ones arrived and
    # before the step that admits one of them
    assert busy == 4 and queued in (2, 3) and matched and over_http > 0
    wait_idle(server)
    state = httpx.get(server.url + "/v1/engine/state").json()
    assert state["num_running"] == 0 and state["pages"]["used"] == 0
    assert {s["phase"] for s in state["slots"]} == {"free"}


def test_since_is_checked(server):
    step = httpx.get(server.url + "/v1/engine/state").json()["step"]
    r = httpx.get(server.url + "/v1/engine/state", params={"since": step})
    assert r.status_code == 200 and r.json()["history"] == []
    for bad in ("-1", "x", "1.5", "", " 3"):
        r = httpx.get(server.url + "/v1/engine/state", params={"since": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "since", bad


def test_state_needs_the_key_the_page_does_not(client):
    app = create_app(client, api_key="sekrit")

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
            r = await c.get("/v1/engine/state")
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
            assert (await c.get("/v1/engine/state", headers={"Authorization": "Bearer nope"})).status_code == 401
            ok = await c.get("/v1/engine/state", headers={"Authorization": "Bearer sekrit"})
            assert ok.status_code == 200 and ok.json()["max_slots"] == 4
            page = await c.get("/dashboard")
            assert page.status_code == 200 and '<meta name="jaxserve-auth" content="required">' in page.text
            doc = (await c.get("/openapi.json")).json()
            assert doc["paths"]["/v1/engine/state"]["get"]["security"] == [{"bearer": []}]
            assert "security" not in doc["paths"]["/dashboard"]["get"]
    asyncio.run(go())


def test_dashboard_is_served_from_the_package(server):
    page = httpx.get(server.url + "/dashboard")
    assert page.status_code == 200 and page.headers["content-type"] == "text/html; charset=utf-8"
    csp = page.headers["content-security-policy"]
    assert "default-src 'none'" in csp and "connect-src 'self'" in csp and "script-src 'self'" in csp
    assert '<meta name="jaxserve-auth" content="none">' in page.text
    shipped = sorted(os.listdir(STATIC))
    assert shipped == sorted(["dashboard.html", *FILES])
    for name, media_type in FILES.items():
        r = httpx.get(f"{server.url}/dashboard/{name}")
        assert r.status_code == 200 and r.headers["content-type"] == media_type
        assert r.content == open(os.path.join(STATIC, name), "rb").read()
    for name in shipped:  # no CDN, no outside URL, no fetch but the server's own relative paths
        text = open(os.path.join(STATIC, name)).read()
        assert not re.search(r"https?:|//[a-z0-9.-]+\.[a-z]{2,}/|@import", text), name
        for target in re.findall(r'from "\./([^"]+)"', text) + re.findall(r'(?:src|href)="dashboard/([^"]+)"', text):
            assert target in FILES, (name, target)
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        globs = tomllib.load(f)["tool"]["setuptools"]["package-data"]["jaxserve.entrypoints"]
    assert all(any(fnmatch.fnmatch(f"static/{name}", g) for g in globs) for name in shipped)


def test_openapi_documents_the_state_and_the_page(server):
    doc = httpx.get(server.url + "/openapi.json").json()
    op = doc["paths"]["/v1/engine/state"]["get"]
    assert op["parameters"][0]["name"] == "since" and {"200", "400", "503"} <= set(op["responses"])
    assert op["responses"]["200"]["content"]["application/json"]["schema"]["$ref"].endswith("EngineState")
    stats = doc["components"]["schemas"]["EngineStats"]  # each stat by name, no more and no fewer
    served = httpx.get(server.url + "/v1/engine/state").json()["stats"]
    assert set(stats["required"]) == set(stats["properties"]) == set(served) and not stats["additionalProperties"]
    assert stats["properties"]["structured_output_mask_seconds"]["type"] == "number"  # seconds: a float
    assert set(doc["paths"]["/dashboard"]["get"]["responses"]["200"]["content"]) == {"text/html"}
    assert set(doc["paths"]["/dashboard/dashboard.js"]["get"]["responses"]["200"]["content"]) == {"text/javascript"}
