"""Each step's inputs, from the leader of a multi-host group (process 0) to the other processes.

    leader   Runner.dispatch ─► Leader.send_step: a JSON header + one frame per array ─► XPUB (TCP)
    follower SUB ─► Follower.receive() ─► ("step", StepBatch, logprobs) or ("stop", reason)

Why a ZMQ socket rather than `jax.experimental.multihost_utils.broadcast_one_to_all`: a step's
arrays change shape with its bucket, which a collective must know beforehand (so two broadcasts per
step: the shapes, then the arrays); each broadcast is a device program that the leader waits for;
and a process that dies leaves the others blocked in it. A socket carries any shapes in one
message, the leader does not wait for it, and a closed connection is seen at once.
`scripts/bench_broadcast.py` (at 0c7fb82) measured both (docs/scale-out.md has the figures).

Arrays travel as raw bytes under a JSON header, never pickled: the port is open to the group's
network, and a follower must not run code that arrives there.

A process that dies closes its connections. Each side watches its socket's connection events (a
ZMQ monitor, in a thread of its own: the main thread may be blocked in a collective that the dead
process will never join) and calls `fatal(why)`, which ends the process. ZMTP heartbeats turn a host
that vanished without closing its connections (power, network) into the same event.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import socket
import threading
import time
from typing import Callable

import numpy as np
import zmq
from zmq.utils.monitor import recv_monitor_message

from jaxserve.model.paged_attention import StepMetadata
from jaxserve.worker.sampling import SamplingBatch
from jaxserve.worker.step_batch import StepBatch

log = logging.getLogger(__name__)

HEARTBEAT_MS = 1_000
HEARTBEAT_TIMEOUT_MS = 10_000  # a peer silent this long is gone
STOP_WAIT_S = 10.0  # on stop, how long the leader waits for the followers to disconnect first
_NESTED = {"meta": StepMetadata, "sampling": SamplingBatch}  # StepBatch's fields that are dataclasses


# ---- encoding ----

def encode_step(batch: StepBatch, logprobs: bool) -> list:
    """[header, *arrays] of a step: the header names each field, and each array's frame, dtype and shape."""
    frames: list = [None]

    def fields(obj) -> dict:
        out = {}
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if dataclasses.is_dataclass(value):
                out[f.name] = fields(value)
            elif isinstance(value, np.ndarray):
                value = np.ascontiguousarray(value)
                out[f.name] = {"frame": len(frames), "dtype": value.dtype.str, "shape": value.shape}
                frames.append(value)
            else:  # an int or None
                out[f.name] = value
        return out
    frames[0] = json.dumps({"kind": "step", "logprobs": logprobs, "batch": fields(batch)}).encode()
    return frames


def encode_stop(reason: str) -> list:
    return [json.dumps({"kind": "stop", "reason": reason}).encode()]


def decode(frames: list) -> tuple:
    """("step", StepBatch, logprobs) or ("stop", reason) from the frames of one message."""
    header = json.loads(bytes(frames[0]))
    if header["kind"] == "stop":
        return "stop", header["reason"]

    def build(cls, values: dict):
        kwargs = {}
        for name, value in values.items():
            if name in _NESTED and cls is StepBatch:
                value = build(_NESTED[name], value)
            elif isinstance(value, dict):  # arrays are read-only views of the message's buffers
                value = np.frombuffer(frames[value["frame"]], np.dtype(value["dtype"])).reshape(value["shape"])
            kwargs[name] = value
        return cls(**kwargs)
    return "step", build(StepBatch, header["batch"]), header["logprobs"]


# ---- sockets ----

def _heartbeats(sock: zmq.Socket) -> None:
    sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
    sock.setsockopt(zmq.HEARTBEAT_TTL, HEARTBEAT_TIMEOUT_MS)


def _watch(sock: zmq.Socket, on_event: Callable[[int], bool], name: str) -> threading.Thread:
    """Calls `on_event(event)` in a thread for each connection event of `sock` until it returns False."""
    monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)

    def run():
        try:
            while on_event(recv_monitor_message(monitor)["event"]):
                pass
        except zmq.ZMQError:  # the context is ending
            pass
        finally:
            monitor.close(linger=0)
    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread


def bind_address(host: str) -> str:
    """The interface to bind for followers that reach the leader as `host` (the coordinator's host):
    that address if it is one of this machine's, else every interface (behind NAT or a Service)."""
    try:
        ip = socket.getaddrinfo(host.strip("[]"), None, type=socket.SOCK_STREAM)[0][4][0]
        with socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET) as probe:
            probe.bind((ip, 0))
        return f"[{ip}]" if ":" in ip else ip
    except OSError:
        return "*"


class Leader:
    """Process 0's end: sends each step to every follower. Its socket is used by one thread (the
    engine's); connection events are watched in another, which calls `fatal` when a follower goes."""

    def __init__(self, followers: int, host: str, fatal: Callable[[str], None]):
        self.followers, self.fatal = followers, fatal
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.XPUB)
        self.socket.setsockopt(zmq.SNDHWM, 0)  # never drop a step: a follower that lags still gets it
        self.socket.setsockopt(zmq.XPUB_VERBOSE, 1)  # every follower's subscription reaches us
        self.socket.setsockopt(zmq.IPV6, 1)
        _heartbeats(self.socket)
        interface = bind_address(host)
        self.port = self.socket.bind_to_random_port(f"tcp://{interface}")
        self.where = f"{interface}:{self.port}"
        self.stopping = False
        self._gone = threading.Semaphore(0)  # released once per follower that disconnects while stopping
        _watch(self.socket, self._on_event, "jaxserve-followers")

    def _on_event(self, event: int) -> bool:
        if event == zmq.EVENT_DISCONNECTED:
            if self.stopping:
                self._gone.release()
            else:
                who = "the follower (process 1)" if self.followers == 1 else f"a follower (of processes 1 to {self.followers})"
                self.fatal(f"{who} closed its connection to the leader: it died, was stopped, or its host is "
                           "unreachable (its own log says which); the group cannot run a step without it, so it stops")
                return False
        return True

    def wait_for_followers(self, timeout: float) -> None:
        """Returns once every follower has subscribed (so no step is lost); `fatal` past `timeout`."""
        deadline, subscribed = time.monotonic() + timeout, 0
        while subscribed < self.followers:
            if not self.socket.poll(max(1, int((deadline - time.monotonic()) * 1000))):
                self.fatal(f"{self.followers - subscribed} of {self.followers} follower(s) did not connect to the "
                           f"leader's step channel ({self.where}) within {timeout:g} s: is that port reachable "
                           "from their hosts?")
                return
            if self.socket.recv()[:1] == b"\x01":  # a subscription (b"\x00": its end)
                subscribed += 1

    def send_step(self, batch: StepBatch, logprobs: bool) -> None:
        self.socket.send_multipart(encode_step(batch, logprobs), copy=False)

    def stop(self, reason: str) -> None:
        """Tells the followers to stop, waits a moment for them to disconnect, and closes."""
        if self.stopping:
            return
        self.stopping = True
        self.socket.send_multipart(encode_stop(reason))
        deadline = time.monotonic() + STOP_WAIT_S
        for _ in range(self.followers):
            if not self._gone.acquire(timeout=max(0.0, deadline - time.monotonic())):
                break
        self.socket.close(linger=1000)
        self.context.term()


class Follower:
    """A follower's end: receives the leader's steps; `fatal` when the leader's connection closes."""

    def __init__(self, address: str, fatal: Callable[[str], None]):
        self.address, self.fatal = address, fatal
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.SUB)
        self.socket.setsockopt(zmq.RCVHWM, 0)
        self.socket.setsockopt(zmq.IPV6, 1)
        _heartbeats(self.socket)
        self.socket.setsockopt(zmq.SUBSCRIBE, b"")
        self.stopped = False
        self.connected = threading.Event()
        _watch(self.socket, self._on_event, "jaxserve-leader")
        self.socket.connect(address)

    def _on_event(self, event: int) -> bool:
        if event == zmq.EVENT_CONNECTED:
            self.connected.set()
        elif event == zmq.EVENT_DISCONNECTED:
            if not self.stopped:
                self.fatal(f"the leader (process 0, {self.address}) closed its connection without telling this "
                           "process to stop: it died or its host is unreachable, so the group stops")
            return False
        return True

    def wait_connected(self, timeout: float) -> None:
        if not self.connected.wait(timeout):
            self.fatal(f"could not connect to the leader's step channel at {self.address} within {timeout:g} s")

    def receive(self) -> tuple:
        message = decode(self.socket.recv_multipart(copy=False))
        if message[0] == "stop":
            self.stopped = True  # the leader closes next: that is no death
        return message

    def close(self) -> None:
        self.stopped = True
        self.socket.close(linger=0)
        self.context.term()
