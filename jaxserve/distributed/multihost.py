"""One engine spread over several processes (hosts) with jax.distributed: a multi-host group.

    process 0, the leader   `jaxserve serve`'s API process (HTTP) and its engine process, which
                            schedules; its runner sends each step's inputs to the followers
                            (step_channel.py), then runs the step itself
    processes 1..N-1        no HTTP, no scheduler: `follow` receives each step and runs the same
                            compiled programs on its devices' shards of the weights and KV pool

Every process builds the same engine from the same flags. `start`, in every process: join
(jax.distributed.initialize), open the step channel (the leader's port reaches the followers by a
broadcast over the new group), build the engine and warm up, check that every process resolved the
same engine, then meet at a barrier. The leader then serves; the followers follow until told to stop.

A group cannot replace one of its processes, nor recover from a step that ran in some processes and
not in others (those that ran it would wait in its collectives for the rest). So a process that
dies, or a step that fails once sent, ends every process with a message that says so: the
followers exit when the leader's connection closes, the leader when a follower's does. An
orchestrator restarts the group together (deploy/kubernetes/leader-worker-set.yaml). A step that
fails on the host before it is sent has touched no device, and the engine goes on as on one host.

Settings: --num-processes, --process-id, --coordinator HOST:PORT, or else JAX_NUM_PROCESSES,
JAX_PROCESS_ID and JAX_COORDINATOR_ADDRESS (the last is the one jax.distributed.initialize reads
itself; jax 0.10 takes the other two only from cluster environments such as SLURM). Every process
also reads the group's secret, which keeps strangers off the step channel: $JAXSERVE_STEP_SECRET, or
the file $JAXSERVE_STEP_SECRET_FILE names (step_channel_auth.py); without it the group refuses to start.
"""

from __future__ import annotations

import atexit
import dataclasses
import hashlib
import logging
import os
import sys
from typing import Any, Callable, Mapping

import numpy as np

from jaxserve.heap import freeze_startup_objects

log = logging.getLogger(__name__)

ENV = {"num_processes": "JAX_NUM_PROCESSES", "process_id": "JAX_PROCESS_ID", "coordinator": "JAX_COORDINATOR_ADDRESS"}
FLAGS = {"num_processes": "--num-processes", "process_id": "--process-id", "coordinator": "--coordinator"}
CONNECT_TIMEOUT_S = 120.0  # for the followers to reach the leader's step channel


@dataclasses.dataclass(frozen=True)
class Group:
    """This process's place in a group of `num_processes`, whose process 0 runs the coordination
    service at `coordinator` (HOST:PORT, reachable from every process). Only holders of `secret`
    may join its step channel."""

    num_processes: int
    process_id: int
    coordinator: str
    secret: bytes = dataclasses.field(repr=False, compare=False)  # the step channel's (step_channel_auth.py)

    def __post_init__(self):
        if self.num_processes < 2:
            raise ValueError(f"a multi-host group has at least 2 processes, got {self.num_processes}")
        if not 0 <= self.process_id < self.num_processes:
            raise ValueError(f"--process-id must be 0 to {self.num_processes - 1} for {self.num_processes} "
                             f"processes, got {self.process_id}")
        host, _, port = self.coordinator.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"--coordinator must be HOST:PORT (process 0's address and a free port), "
                             f"got {self.coordinator!r}")

    @property
    def is_leader(self) -> bool:
        return self.process_id == 0

    @property
    def host(self) -> str:
        return self.coordinator.rpartition(":")[0]


def group_from(num_processes: int | None = None, process_id: int | None = None, coordinator: str | None = None,
               environ: Mapping[str, str] = os.environ) -> Group | None:
    """The group the flags (or, for those not given, the environment) ask for; None for one process.
    Raises ValueError on an incomplete or inconsistent setting, or without the group's secret (read
    from the environment only: a flag would show it to every user of the host)."""
    flags = {"num_processes": num_processes, "process_id": process_id, "coordinator": coordinator}
    values = dict(flags)
    for name, var in ENV.items():
        if values[name] is None and environ.get(var, "") != "":
            text = environ[var]
            if name != "coordinator":
                try:
                    text = int(text)
                except ValueError:
                    raise ValueError(f"{var} must be an integer, got {text!r}") from None
            values[name] = text
    n = values["num_processes"]
    if n is None:
        given = [FLAGS[name] for name in ("process_id", "coordinator") if flags[name] is not None]
        if given:
            raise ValueError(f"{' and '.join(given)} {'needs' if len(given) == 1 else 'need'} --num-processes "
                             f"(or {ENV['num_processes']})")
        return None  # e.g. JAX_COORDINATOR_ADDRESS set for another program: one process here
    if n < 1:
        raise ValueError(f"--num-processes must be >= 1, got {n}")
    if n == 1:
        if values["process_id"] not in (None, 0):
            raise ValueError(f"--process-id must be 0 for one process, got {values['process_id']}")
        return None
    if values["process_id"] is None:
        raise ValueError(f"a group of {n} processes needs --process-id (or {ENV['process_id']}): 0 for the "
                         f"leader, which serves HTTP, 1 to {n - 1} for the others")
    if values["coordinator"] is None:
        raise ValueError(f"a group of {n} processes needs --coordinator HOST:PORT (or {ENV['coordinator']}): "
                         "process 0's address as every process reaches it, and a free port there")
    from jaxserve.distributed import step_channel_auth  # here: one process needs neither zmq nor a secret
    step_channel_auth.require_curve()
    return Group(n, values["process_id"], values["coordinator"], step_channel_auth.read_secret(environ))


# ---- start-up, in every process ----

def start(group: Group, build: Callable[[], Any], fatal: Callable[[str], None]) -> tuple[Any, Any]:
    """Joins the group, builds the engine with `build()`, checks it against the others'; returns
    (engine, channel). `fatal(why)` ends this process (from any thread)."""
    import jax
    from jax.experimental import multihost_utils

    from jaxserve.distributed import step_channel  # here: the API process reads `Group` without importing jax
    # CPU devices of different processes reach each other through gloo; accelerators use their own links.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(group.coordinator, group.num_processes, group.process_id)
    log.info("process %d of %d joined the group at %s: %d local devices of %d", group.process_id,
             group.num_processes, group.coordinator, jax.local_device_count(), jax.device_count())
    channel = step_channel.Leader(group.num_processes - 1, group.host, group.secret, fatal) if group.is_leader else None
    port = int(multihost_utils.broadcast_one_to_all(np.int32(channel.port if channel else 0)))
    if channel is not None:
        channel.wait_for_followers(CONNECT_TIMEOUT_S)
    else:
        channel = step_channel.Follower(f"tcp://{group.host}:{port}", group.secret, group.process_id, fatal)
        channel.wait_connected(CONNECT_TIMEOUT_S)
    engine = build()
    if engine.core.drafter is not None:  # its steps would run in this process alone, not mirrored to the others
        raise ValueError("speculative decoding with a draft model does not run in a multi-host group yet")
    _check_same_engine(group, engine, fatal)
    multihost_utils.sync_global_devices("jaxserve: every process of the group is ready")
    if group.is_leader:
        engine.runner.mirror = Mirror(channel, fatal)
        # At the engine process's exit, the followers are told to stop (jax's own atexit shutdown,
        # registered earlier, runs after this and waits for them at its barrier).
        atexit.register(channel.stop, "the leader's engine stopped")
    return engine, channel


def _check_same_engine(group: Group, engine, fatal: Callable[[str], None]) -> None:
    """Every process must compile the same programs over the same shapes, or their collectives
    would not line up: compares a digest of what each resolved (dtypes, pages, buckets, mesh)."""
    from jax.experimental import multihost_utils
    text = engine.runner.describe_programs()
    digest = np.frombuffer(hashlib.sha256(text.encode()).digest(), np.uint8)
    every = np.asarray(multihost_utils.process_allgather(digest)).reshape(group.num_processes, -1)
    differ = [i for i in range(group.num_processes) if not np.array_equal(every[i], every[0])]
    if differ:
        fatal(f"process(es) {differ} resolved another engine than process 0 (a different model, flags, "
              f"environment or machine); every process of a group must run the same programs. This one's:\n{text}")


class Mirror:
    """The leader's `Runner.mirror`: each step goes to the followers just before it runs here, and a
    step that fails once sent ends the group."""

    def __init__(self, channel, fatal: Callable[[str], None]):
        self.channel, self.fatal = channel, fatal

    def step(self, batch, logprobs: bool) -> None:
        self.channel.send_step(batch, logprobs)

    def run(self, fn: Callable, *args):
        try:
            return fn(*args)
        except Exception as e:
            self.fatal(f"a step failed on the leader after the group was sent it ({type(e).__name__}: {e}); "
                       "the other processes may be waiting for it in a collective, so the group stops")
            raise


# ---- the followers ----

def follow(group: Group, build: Callable[[], Any]) -> None:
    """A follower's life: start, then run each step the leader sends until it says stop."""
    import jax

    def fatal(why: str) -> None:  # any thread: the main one may be blocked in a collective
        log.critical("process %d of %d: %s", group.process_id, group.num_processes, why)
        sys.stderr.flush()
        os._exit(1)
    engine, channel = start(group, build, fatal)
    freeze_startup_objects()  # a collection's pause here would hold up every process's collectives
    log.info("process %d of %d ready: following the leader", group.process_id, group.num_processes)
    runner, in_flight, steps = engine.runner, None, 0
    try:
        while True:
            message = channel.receive()
            if message[0] == "stop":
                break
            _, batch, logprobs = message
            launched = runner.dispatch(batch, logprobs)
            if in_flight is not None:
                runner.collect(in_flight)  # the step before: keeps this process at most one step ahead
            in_flight, steps = launched, steps + 1
        if in_flight is not None:
            runner.collect(in_flight)
    except KeyboardInterrupt:
        fatal("interrupted")
    except Exception as e:  # noqa: BLE001 — the group cannot go on without this process
        log.exception("step %d failed", steps + 1)
        fatal(f"a step failed here ({type(e).__name__}: {e}), so the group stops")
    channel.close()
    log.info("process %d of %d: %s after %d steps; exiting", group.process_id, group.num_processes, message[1], steps)
    jax.distributed.shutdown()
