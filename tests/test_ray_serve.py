"""Replicas behind Ray Serve (jaxserve/entrypoints/ray_serve.py): a local Ray cluster, 2 replicas of the tiny
Llama, requests through Serve's HTTP proxy. Prompts that share a prefix must reach the replica that
cached it (the `x-jaxserve-replica` header, and `cached_tokens` of the usage); a replica killed
under load loses nothing that was accepted."""

from __future__ import annotations

import asyncio
import json
import random
import time

import pytest

ray = pytest.importorskip("ray", reason="Ray Serve is the jaxserve[ray] extra: pip install 'jaxserve[ray]'")
pytest.importorskip("ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router",
                    reason="this Ray has no PrefixCacheAffinityRouter where jaxserve.entrypoints.ray_serve looks for it")

import httpx  # noqa: E402
from ray import serve  # noqa: E402

from jaxserve.config import EngineConfig  # noqa: E402
from jaxserve.engine.core_process import EngineFactory  # noqa: E402
from jaxserve.entrypoints.ray_serve import (REPLICA_HEADER, build, local_ray_options, routing_key, start_serve,  # noqa: E402
                                with_gpus)
from server_helpers import free_port  # noqa: E402

PAGE = 8
PREFIX = 8 * PAGE  # tokens every prompt of a group shares: 8 full pages
GROUPS, PER_GROUP = 4, 4


@pytest.fixture(scope="module")
def ray_url(checkpoints):
    config = EngineConfig(dtype="float32", max_slots=8, page_size=PAGE, num_pages=256, max_model_len=512)
    ray.init(**local_ray_options(num_cpus=2), num_gpus=2)  # GPUs in name only: jax here runs on the CPU
    try:
        port = free_port()
        start_serve("127.0.0.1", port)
        app = build(EngineFactory(checkpoints("llama"), config, warmup=False), replicas=2,
                    ray_actor_options={"num_cpus": 0})
        serve.run(app, name="jaxserve", route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def test_replicas_ask_for_the_engines_gpus_where_the_cluster_has_enough():
    assert with_gpus({"num_cpus": 1}, replicas=2, cluster_gpus=2) == {"num_cpus": 1, "num_gpus": 1}
    assert with_gpus({}, replicas=2, cluster_gpus=8, devices_per_engine=4) == {"num_gpus": 4}
    assert with_gpus({}, replicas=4, cluster_gpus=8) == {"num_gpus": 1}
    assert with_gpus({"num_gpus": 0.5}, replicas=2, cluster_gpus=1) == {"num_gpus": 0.5}  # named: kept
    assert with_gpus({}, replicas=2, cluster_gpus=1) == {}  # too few: they share, with a warning
    assert with_gpus({}, replicas=2, cluster_gpus=4, devices_per_engine=4) == {}
    assert with_gpus({"num_cpus": 0}, replicas=3, cluster_gpus=0) == {"num_cpus": 0}  # no GPUs


def test_routing_key():
    assert routing_key("/v1/completions", b'{"prompt": "abc"}') == ("abc", False)
    assert routing_key("/v1/completions", b'{"prompt": [12, 34], "stream": true}') == ("\U0001000c\U00010022", True)
    assert routing_key("/v1/completions", b'{"prompt": ["ab", [5, 262143]]}') == ("ab\U00010005\U0004ffff", False)
    assert routing_key("/v1/completions", b'{"prompt": [3, -1, 1048576, "x", 2.0]}') == ("\U00010003" + "\ufffd" * 4, False)
    assert routing_key("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}, '
                                               b'{"role": "user", "content": [{"type": "text", "text": "yo"}]}]}') \
        == ("hiyo", False)
    assert routing_key("/v1/models", b"") == ("", False)
    assert routing_key("/v1/completions", b"{not json") == ("", False)


def test_shared_prefixes_land_on_the_replica_that_cached_them(ray_url):
    rng = random.Random(0)
    prefixes = [[rng.randrange(10, 100) for _ in range(PREFIX)] for _ in range(GROUPS)]

    async def complete(client, prompt):
        r = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200, r.text
        return r.headers[REPLICA_HEADER], r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    async def workload():
        served = []
        async with httpx.AsyncClient(base_url=ray_url, timeout=120) as client:
            for prefix in prefixes:  # a group's first request caches the prefix; the others follow it
                first = await complete(client, prefix + [rng.randrange(10, 100) for _ in range(PAGE)])
                rest = await asyncio.gather(*(complete(client, prefix + [rng.randrange(10, 100) for _ in range(PAGE)])
                                              for _ in range(PER_GROUP - 1)))
                served.append((first, rest))
        return served

    served = asyncio.run(workload())
    for (replica, cached), rest in served:
        assert cached == 0
        assert rest == [(replica, PREFIX)] * (PER_GROUP - 1)  # the same replica, every prefix page from its cache
    firsts = [replica for (replica, _), _ in served]
    assert sorted(firsts.count(r) for r in set(firsts)) == [GROUPS // 2, GROUPS // 2]  # new prefixes spread


def test_same_routes_and_errors_through_the_proxy(ray_url):
    with httpx.Client(base_url=ray_url, timeout=60) as client:
        assert client.get("/health").json() == {"status": "ok"}
        assert client.get("/v1/models").json()["data"][0]["object"] == "model"
        bad = client.post("/v1/completions", json={"prompt": "the quick", "max_tokens": -1})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"
        assert client.post("/v1/completions", content=b"{not json").status_code == 400
        assert "jaxserve_" in client.get("/metrics").text
        with client.stream("POST", "/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "the quick brown fox"}], "max_tokens": 4, "stream": True,
                "temperature": 0}) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            events = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]" and len(events) >= 3


ENGINE_REPLICA = "ray::ServeReplica:jaxserve:engine"


def _processes(title: str) -> list:
    """This machine's processes whose title starts with `title` (Ray names its actors' processes)."""
    import psutil
    return [p for p in psutil.process_iter(["cmdline"]) if " ".join(p.info["cmdline"] or []).startswith(title)]


def _engine_processes() -> list:
    """The engine replicas' engine processes (multiprocessing's spawned children). A process that
    ends while being listed (around a replica's kill or start) is left out rather than raising."""
    import psutil

    def children(p):
        try:
            return [(c, " ".join(c.cmdline())) for c in p.children(recursive=True)]
        except psutil.Error:
            return []
    return [c for p in _processes(ENGINE_REPLICA) for c, title in children(p) if "spawn_main" in title]


def test_engine_replicas_and_their_engines_run_at_the_default_priority(ray_url):
    """Ray lowers its workers' priority (niceness 15); the engine replicas, and the engine processes
    they start, keep the priority the cluster was started with (ENGINE_REPLICA_ENV), while Ray's
    other workers stay lower."""
    import psutil
    base = psutil.Process().nice()  # the local cluster's processes start at this test's niceness
    niceness = {"replica": [p.nice() for p in _processes(ENGINE_REPLICA)],
                "engine": [p.nice() for p in _engine_processes()]}
    assert niceness == {"replica": [base] * 2, "engine": [base] * 2}
    ingress = [p.nice() for p in _processes("ray::ServeReplica:jaxserve:ingress")]
    assert len(ingress) == 1 and ingress[0] > base


def test_each_replica_engine_sees_its_own_gpu(ray_url):
    """The test cluster has 2 GPUs in name, and the replicas' options name none: each replica asks
    for one, and its engine process sees only that one (Ray sets CUDA_VISIBLE_DEVICES)."""
    assert sorted(str(p.environ().get("CUDA_VISIBLE_DEVICES")) for p in _engine_processes()) == ["0", "1"]




REPLACED_WITHIN_S = 300  # a new replica starts a worker and an engine: 19 s in the drill, more on a busy machine


def test_a_replica_killed_under_load_loses_nothing(ray_url):
    """Last in this module: it kills a replica. Streams in flight on the killed replica end with an
    error event and [DONE]; the survivor's end whole; every request sent after the kill is served
    by the survivor (or answered 503 in the OpenAI envelope while the router learns of the death);
    the killed replica's engine process exits; and Serve starts a new replica that serves."""
    import psutil
    tokens, rng = 420, random.Random(1)  # about 1 s of stream here: 180 (0.45 s) once ended before the kill landed

    async def complete(client, prompt):
        r = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})
        if r.status_code == 200:
            return r.headers[REPLICA_HEADER]
        assert r.status_code == 503 and r.json()["error"]["type"] == "server_error", r.text
        return None

    async def stream(client, prompt, started: asyncio.Event, out: dict):
        body = {"prompt": prompt, "max_tokens": tokens, "ignore_eos": True, "stream": True}
        out["events"] = []
        async with client.stream("POST", "/v1/completions", json=body) as r:
            out["replica"] = r.headers[REPLICA_HEADER]
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    out["events"].append(line[6:])
                    started.set()

    async def drill():
        async with httpx.AsyncClient(base_url=ray_url, timeout=120) as client:
            homes = {}  # replica -> a prompt it has cached: streams that extend it go there
            for _ in range(8):
                prompt = [rng.randrange(10, 100) for _ in range(PREFIX)]
                homes.setdefault(await complete(client, prompt), prompt)
                if len(homes) == 2:
                    break
            assert len(homes) == 2
            engines = _engine_processes()
            victim = next(iter(homes))
            outs = [{} for _ in range(4)]
            starts = [asyncio.Event() for _ in outs]
            prompts = [home + [rng.randrange(10, 100) for _ in range(PAGE)]
                       for home in homes.values() for _ in range(2)]
            tasks = [asyncio.create_task(stream(client, p, s, o)) for p, s, o in zip(prompts, starts, outs)]
            await asyncio.wait_for(asyncio.gather(*(s.wait() for s in starts[:2])), 60)  # the victim's streams
            ray.kill(ray.get_actor(f"SERVE_REPLICA::jaxserve#engine#{victim}", namespace="serve"), no_restart=True)
            await asyncio.gather(*tasks)
            after, deadline = [], time.monotonic() + REPLACED_WITHIN_S
            while time.monotonic() < deadline:  # until a new replica serves, 0.5 s apart
                after.append(await complete(client, [rng.randrange(10, 100) for _ in range(PAGE)]))
                if after[-1] not in (None, victim, *homes):
                    break
                await asyncio.sleep(0.5)
            return victim, homes, outs, engines, after

    victim, homes, outs, engines, after = asyncio.run(drill())
    assert [out["replica"] for out in outs] == [victim, victim, *[r for r in homes if r != victim] * 2]
    for out in outs:
        assert out["events"][-1] == "[DONE]", out
        chunks = [json.loads(e) for e in out["events"][:-1]]
        if out["replica"] == victim:  # cut short: an error event last
            assert chunks[-1]["error"]["type"] == "server_error", out["events"][-3:]
        else:  # whole: every token
            assert chunks[-1]["choices"][0]["finish_reason"] == "length", out["events"][-3:]
    survivor = next(r for r in homes if r != victim)
    assert victim not in after and survivor in after, after
    assert after[-1] not in (None, victim, survivor), f"no new replica served in {REPLACED_WITHIN_S} s"
    gone = psutil.wait_procs(engines, timeout=30)[0]  # the victim's engine process ended with it
    assert len(gone) == 1 and len(_engine_processes()) == 2
