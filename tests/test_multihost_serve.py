"""`jaxserve serve` as a multi-host group on this machine: 2 processes of 2 simulated CPU devices
each (gloo collectives), a tiny Llama from disk split over a model=4 mesh that spans both. Process 0
serves HTTP and schedules; process 1 runs its steps. Greedy tokens over HTTP equal one device's; a
clean stop ends both; a process killed ends the other with a message that says so. And the step
channel's encoding, its death detection, its refusal of strangers, and the flags' errors, without jax."""

from __future__ import annotations

import dataclasses
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import numpy as np
import openai
import psutil
import pytest
import zmq
from conftest import TEST_XLA_FLAGS, build_checkpoint
from server_helpers import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Small buckets keep the warm-up short: 4 token buckets, 3 row buckets.
ENGINE = ("--mesh", "model=4", "--max-slots", "4", "--page-size", "8", "--num-pages", "64", "--max-model-len", "64",
          "--max-num-batched-tokens", "8", "--dtype", "float32")
PROMPTS = ["the quick brown fox", "paged attention keeps kv memory tight. a stitch", "jax", "over the lazy dog"]
MAX_TOKENS = 12
START_S = 240
SECRET = b"a step secret of the tests, 32 b"


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    # 4 kv heads: the pool and attention split over all 4 devices, so across the two processes.
    return build_checkpoint(str(tmp_path_factory.mktemp("llama-kv4")), "llama", num_key_value_heads=4)


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> str:
    """One compile cache for the module: the first group compiles, the later ones load."""
    return str(tmp_path_factory.mktemp("multihost-cache"))


class Group:
    """Process 0 (`jaxserve serve` on a free port) and process 1 of a 2-process group, started
    together; ready once process 0's /health says 200."""

    def __init__(self, model: str, cache: str, logs):
        self.port, coordinator = free_port(), f"127.0.0.1:{free_port()}"
        self.url = f"http://127.0.0.1:{self.port}"
        # A fresh secret for the group, in both processes' environment (as on one host a script would).
        env = dict(os.environ, JAX_PLATFORMS="cpu", JAXSERVE_CACHE=cache,
                   JAXSERVE_STEP_SECRET=secrets.token_hex(32),
                   XLA_FLAGS=f"--xla_force_host_platform_device_count=2 {TEST_XLA_FLAGS}")
        common = [sys.executable, "-m", "jaxserve.entrypoints.cli", "serve", "--model", model, *ENGINE, "--num-processes", "2",
                  "--coordinator", coordinator]
        self.logs = [logs / "process0.log", logs / "process1.log"]
        files = [open(p, "w") for p in self.logs]
        self.leader = subprocess.Popen(common + ["--process-id", "0", "--port", str(self.port)], cwd=ROOT, env=env,
                                       stdout=files[0], stderr=subprocess.STDOUT)
        # The follower's settings from the environment, as jax.distributed reads them.
        follower_env = dict(env, JAX_NUM_PROCESSES="2", JAX_PROCESS_ID="1", JAX_COORDINATOR_ADDRESS=coordinator)
        self.follower = subprocess.Popen(common[:-4], cwd=ROOT, env=follower_env, stdout=files[1],
                                         stderr=subprocess.STDOUT)
        for f in files:
            f.close()
        deadline = time.monotonic() + START_S
        while True:
            assert self.leader.poll() is None and self.follower.poll() is None, self.output()
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, f"the group did not start:\n{self.output()}"
            time.sleep(0.3)

    def output(self, i: int | None = None) -> str:
        return "".join(f"--- process {j}:\n{p.read_text()[-6000:]}\n" for j, p in enumerate(self.logs)
                       if i is None or i == j)

    def leader_engine(self) -> psutil.Process:
        return next(c for c in psutil.Process(self.leader.pid).children() if "spawn_main" in " ".join(c.cmdline()))

    def close(self) -> None:
        for proc in (self.leader, self.follower):
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


@pytest.fixture
def group(model, cache, tmp_path):
    g = Group(model, cache, tmp_path)
    yield g
    g.close()


def reference(model: str) -> list[str]:
    """The greedy completions of one device (this process: no mesh). Prompts run in one chunk here
    (greedy tokens do not depend on the chunking): 3 programs to compile rather than 7."""
    from jaxserve import Engine, EngineConfig, SamplingParams
    engine = Engine.from_pretrained(model, EngineConfig(max_slots=4, page_size=8, num_pages=64, max_model_len=64,
                                                        max_num_batched_tokens=64, dtype="float32"))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    return [o.text for o in engine.generate(PROMPTS, params)]


def test_two_processes_serve_one_devices_greedy_tokens_and_stop_together(group, model):
    expected = reference(model)  # while the group serves: this process has one device of its own
    client = openai.OpenAI(base_url=group.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    name = os.path.basename(model)
    one = client.completions.create(model=name, prompt=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0,
                                    extra_body={"ignore_eos": True}, logprobs=2)  # the logprobs program too
    assert one.choices[0].text == expected[1]
    assert len(one.choices[0].logprobs.tokens) == MAX_TOKENS
    # All four prompts in one payload, so that they run in the same steps.
    batch = client.completions.create(model=name, prompt=PROMPTS, max_tokens=MAX_TOKENS, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert [c.text for c in sorted(batch.choices, key=lambda c: c.index)] == expected
    group.leader.send_signal(signal.SIGTERM)
    assert group.leader.wait(60) == 0, group.output()
    assert group.follower.wait(30) == 0, group.output()
    assert "the leader's engine stopped" in group.output(1)


def test_a_killed_follower_ends_the_leader_with_a_message(group):
    group.follower.kill()
    assert group.leader.wait(30) != 0
    assert "error: the follower (process 1) closed its connection to the leader" in group.output(0)


def test_a_killed_leader_ends_the_follower_with_a_message(group):
    group.leader_engine().kill()
    assert group.follower.wait(30) != 0
    assert "the leader (process 0, tcp://127.0.0.1:" in group.output(1)
    assert "closed its connection without telling this process to stop" in group.output(1)
    assert group.leader.wait(30) != 0  # its API process has no engine left, and none can replace it


# ---- without processes ----

def fields(obj) -> dict:
    """A StepBatch's fields, nested, with each array as (dtype, shape, values)."""
    if dataclasses.is_dataclass(obj):
        return {f.name: fields(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    return (obj.dtype.str, obj.shape, obj.tolist()) if isinstance(obj, np.ndarray) else obj


def a_step(first_token: int = 5):
    """A StepBatch of 2 sequences with fields of every kind: arrays, nested dataclasses, ints, None."""
    from jaxserve.worker.sampling import SamplingBatch
    from jaxserve.worker.step_batch import ScheduledSeq, StepBuckets, StepSeqs, build_step, table_updates
    tables = np.arange(32, dtype=np.int32).reshape(4, 1, 8)
    sampling = SamplingBatch(np.full(2, 0.5, np.float32), np.arange(2, dtype=np.int32), np.ones(2, np.float32),
                             np.zeros(2, np.float32), np.arange(2, dtype=np.uint32))
    return build_step(StepSeqs.of([ScheduledSeq(0, 0, [first_token, 6, 7]), ScheduledSeq(2, 4, [9])]), 4, 8,
                      StepBuckets(16, 4), table_updates=table_updates(tables),
                      sampling_updates=(np.array([0, 2], np.int32), sampling), sampling_mode="cuts")


def test_a_step_crosses_the_channel_whole():
    from jaxserve.distributed import step_channel
    batch = a_step()
    assert batch.meta.block_tables is None and len(batch.table_updates) == 31  # every entry but the null page
    for allowed in (None, np.full((2, 3), -1, np.int32)):
        batch.allowed = allowed
        frames = [bytes(f) for f in step_channel.encode_step(batch, True)]
        kind, got, logprobs = step_channel.decode(frames)
        assert kind == "step" and logprobs is True and got.num_tokens == batch.num_tokens == 4
        assert fields(got) == fields(batch)
    assert step_channel.decode(step_channel.encode_stop("bye")) == ("stop", "bye")


def test_each_end_of_the_channel_hears_the_other_die():
    from jaxserve.distributed import step_channel
    for who_dies in ("follower", "leader"):
        deaths = {"leader": threading.Event(), "follower": threading.Event()}
        leader = step_channel.Leader(1, "127.0.0.1", SECRET, lambda why: deaths["leader"].set())
        follower = step_channel.Follower(f"tcp://127.0.0.1:{leader.port}", SECRET, 1,
                                         lambda why: deaths["follower"].set())
        leader.wait_for_followers(10)
        follower.wait_connected(10)
        if who_dies == "follower":
            follower.socket.close(linger=0)  # as a process's death closes it
            assert deaths["leader"].wait(5) and not deaths["follower"].is_set()
        else:
            leader.socket.close(linger=0)
            assert deaths["follower"].wait(5) and not deaths["leader"].is_set()
    # A stop is no death on either side.
    deaths = []
    leader = step_channel.Leader(1, "127.0.0.1", SECRET, deaths.append)
    follower = step_channel.Follower(f"tcp://127.0.0.1:{leader.port}", SECRET, 1, deaths.append)
    leader.wait_for_followers(10)
    follower.wait_connected(10)
    stopping = threading.Thread(target=leader.stop, args=("done",))
    stopping.start()
    assert follower.receive() == ("stop", "done")
    follower.close()
    stopping.join(10)
    time.sleep(0.2)
    assert deaths == []


def test_strangers_get_nothing_and_change_nothing():
    """Two followers and strangers: junk bytes over TCP, a ZMQ subscriber without keys, a follower
    with another secret. No stranger counts as a follower, receives a step or ends the group."""
    from jaxserve.distributed import step_channel
    deaths, refused = [], threading.Event()
    leader = step_channel.Leader(2, "127.0.0.1", SECRET, deaths.append)
    address = f"tcp://127.0.0.1:{leader.port}"

    def junk():
        with socket.create_connection(("127.0.0.1", leader.port)) as s:
            s.sendall(b"\xff" + bytes(range(256)) + b"GET / HTTP/1.1\r\n\r\n")
            time.sleep(0.05)
    context = zmq.Context()
    plain = context.socket(zmq.SUB)  # ZMQ without keys: it would receive every step of a plain XPUB
    plain.setsockopt(zmq.SUBSCRIBE, b"")
    plain.connect(address)
    junk()
    wrong = step_channel.Follower(address, b"another secret, of another group", 1,
                                  lambda why: refused.set() if "JAXSERVE_STEP_SECRET" in why else deaths.append(why))
    first = step_channel.Follower(address, SECRET, 1, deaths.append)
    leader.wait_for_followers(0.5)  # strangers count for nothing: one of two followers is no group
    assert len(deaths) == 1 and "1 of 2 follower(s) did not join" in deaths.pop()
    first.wait_connected(10)
    second = step_channel.Follower(address, SECRET, 2, deaths.append)
    leader.wait_for_followers(10)
    second.wait_connected(10)
    assert refused.wait(10)
    junk()  # after the group formed too

    steps = [a_step(token) for token in (11, 12, 13)]
    for batch in steps:
        leader.send_step(batch, False)
    for follower in (first, second):
        for batch in steps:
            kind, got, logprobs = follower.receive()
            assert kind == "step" and fields(got) == fields(batch)
    assert plain.poll(100) == 0 and wrong.socket.poll(0) == 0  # not a step, not a byte of one
    plain.close(linger=0)
    wrong.close()
    late = context.socket(zmq.SUB)  # connects and leaves while the group runs
    late.setsockopt(zmq.SUBSCRIBE, b"")
    late.connect(address)
    leader.send_step(steps[0], True)
    assert late.poll(200) == 0
    late.close(linger=0)
    assert [f.receive()[0] for f in (first, second)] == ["step", "step"]
    stopping = threading.Thread(target=leader.stop, args=("done",))
    stopping.start()
    for follower in (first, second):
        assert follower.receive() == ("stop", "done")
        follower.close()
    stopping.join(10)
    time.sleep(0.2)
    assert deaths == []
    context.term()


def test_a_group_needs_its_secret_from_the_environment(tmp_path):
    from jaxserve.distributed.multihost import group_from
    env = {"JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1", "JAX_COORDINATOR_ADDRESS": "leader:6379"}
    with pytest.raises(ValueError, match="set JAXSERVE_STEP_SECRET to the same value in every process"):
        group_from(environ=env)
    with pytest.raises(ValueError, match="has 5 bytes; use at least 16"):
        group_from(environ={**env, "JAXSERVE_STEP_SECRET": "short"})
    (tmp_path / "secret").write_bytes(SECRET + b"\n")
    from_file = group_from(environ={**env, "JAXSERVE_STEP_SECRET_FILE": str(tmp_path / "secret")})
    assert from_file.secret == SECRET and SECRET.decode() not in repr(from_file)
    with pytest.raises(ValueError, match="cannot be read"):
        group_from(environ={**env, "JAXSERVE_STEP_SECRET_FILE": str(tmp_path / "none")})
    with pytest.raises(ValueError, match="not both"):
        group_from(environ={**env, "JAXSERVE_STEP_SECRET_FILE": str(tmp_path / "secret"),
                            "JAXSERVE_STEP_SECRET": SECRET.decode()})


@pytest.mark.parametrize("args, message", [
    (["--num-processes", "2"], "needs --process-id"),
    (["--num-processes", "2", "--process-id", "0"], "needs --coordinator HOST:PORT"),
    (["--num-processes", "2", "--process-id", "2", "--coordinator", "h:1"], "--process-id must be 0 to 1"),
    (["--num-processes", "2", "--process-id", "-1", "--coordinator", "h:1"], "--process-id must be 0 to 1"),
    (["--num-processes", "2", "--process-id", "1", "--coordinator", "h"], "--coordinator must be HOST:PORT"),
    (["--process-id", "1"], "--process-id needs --num-processes"),
    (["--num-processes", "0"], "--num-processes must be >= 1"),
    (["--num-processes", "2", "--process-id", "0", "--coordinator", "h:1"], "needs --mesh"),
    (["--num-processes", "2", "--process-id", "0", "--coordinator", "h:1", "--mesh", "model=2", "--replicas", "2"],
     "--replicas and --num-processes do not go together"),
])
def test_bad_group_settings_get_a_clear_error(args, message):
    code = f"from jaxserve.entrypoints.cli import main; main(['serve', *{args!r}])"
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX")}
    env["JAXSERVE_STEP_SECRET"] = SECRET.decode()
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode != 0 and message in run.stderr, run.stderr[-2000:]
    assert "Traceback" not in run.stderr


def test_settings_from_the_environment():
    from jaxserve.distributed.multihost import Group, group_from
    env = {"JAX_NUM_PROCESSES": "3", "JAX_PROCESS_ID": "2", "JAX_COORDINATOR_ADDRESS": "leader:6379",
           "JAXSERVE_STEP_SECRET": SECRET.decode()}
    assert group_from(environ=env) == Group(3, 2, "leader:6379", SECRET)
    assert group_from(process_id=1, environ=env) == Group(3, 1, "leader:6379", SECRET)  # a flag wins
    assert group_from(environ={"JAX_COORDINATOR_ADDRESS": "leader:6379"}) is None  # for another program
    with pytest.raises(ValueError, match="JAX_PROCESS_ID must be an integer"):
        group_from(environ={**env, "JAX_PROCESS_ID": "one"})
