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

Only the group's processes may connect (step_channel_auth.py: CURVE keys derived from a shared
secret). The leader knows each follower by its key, and learns the connection it came on from its
subscription; a stranger never completes the handshake, so it never subscribes, receives nothing,
and its connect, bytes and disconnect change nothing.

A process that dies closes its connections. Each side watches its socket's connection events (a
ZMQ monitor, in a thread of its own: the main thread may be blocked in a collective that the dead
process will never join) and calls `fatal(why)`, which ends the process, when the connection that
closed was a follower's (on the leader) or the leader's (on a follower). ZMTP heartbeats turn a host
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

from jaxserve.distributed import step_channel_auth
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


def _monitor(sock: zmq.Socket, events: int) -> zmq.Socket:
    """A socket that receives `sock`'s connection `events`, none dropped however many wait unread
    (a scan of the port must not push a follower's event out)."""
    address = f"inproc://monitor.{sock.underlying:x}"
    sock.monitor(address, events)
    monitor = sock.context.socket(zmq.PAIR)
    monitor.setsockopt(zmq.RCVHWM, 0)
    monitor.connect(address)
    return monitor


def _watch(sock: zmq.Socket, events: int, on_event: Callable[[int], bool], name: str) -> threading.Thread:
    """Calls `on_event(event)` in a thread for each of `events` on `sock` until it returns False."""
    monitor = _monitor(sock, events)

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
    engine's). Until every follower has subscribed, that thread also answers the gatekeeper and reads
    the connection events; then a thread of its own does, and calls `fatal` when a follower goes."""

    def __init__(self, followers: int, host: str, secret: bytes, fatal: Callable[[str], None]):
        step_channel_auth.require_curve()
        self.followers, self.fatal = followers, fatal
        self.context = zmq.Context()
        self.gatekeeper = step_channel_auth.Gatekeeper(self.context, secret, followers)  # before the port opens
        self.socket = self.context.socket(zmq.XPUB)
        self.socket.curve_server = True
        self.socket.curve_secretkey = step_channel_auth.leader_keys(secret).secret
        self.socket.zap_domain = b"jaxserve-step-channel"  # with a domain and this, no gatekeeper: no entry
        self.socket.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
        self.socket.setsockopt(zmq.SNDHWM, 0)  # never drop a step: a follower that lags still gets it
        self.socket.setsockopt(zmq.XPUB_VERBOSE, 1)  # every follower's subscription reaches us, with its id
        self.socket.setsockopt(zmq.IPV6, 1)
        _heartbeats(self.socket)
        self.connections = _monitor(self.socket, zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        self.open: set[int] = set()  # every connection open now (file descriptors), strangers' too
        self.members: dict[int, str] = {}  # a follower's connection -> its process id
        interface = bind_address(host)
        self.port = self.socket.bind_to_random_port(f"tcp://{interface}")
        self.where = f"{interface}:{self.port}"
        self.stopping = False
        self._gone = threading.Semaphore(0)  # released once per follower that disconnects while stopping
        self._watcher: threading.Thread | None = None

    def _on_connection_events(self) -> bool:
        """Reads every connection event queued; False once a follower's connection closed unasked."""
        while self.connections.poll(0):
            event = recv_monitor_message(self.connections)
            fd = event["value"]
            if event["event"] == zmq.EVENT_ACCEPTED:
                self.open.add(fd)
                continue
            self.open.discard(fd)
            who = self.members.pop(fd, None)
            if who is not None and not self._lost(who):  # None: a stranger, or a handshake never finished
                return False
        return True

    def _lost(self, who: str) -> bool:
        """A follower's connection closed: on stop, one fewer to wait for; else the group ends (False)."""
        if self.stopping:
            self._gone.release()
            return True
        which = "the follower (process 1)" if self.followers == 1 else f"the follower process {who}"
        self.fatal(f"{which} closed its connection to the leader: it died, was stopped, or its host is "
                   "unreachable (its own log says which); the group cannot run a step without it, so it stops")
        return False

    def _on_subscription(self, frame: zmq.Frame) -> bool:
        """Counts a subscription's sender if the gatekeeper named it (only followers have a
        `User-Id`); False if that follower is gone already."""
        try:
            who = frame.get("User-Id")
        except zmq.ZMQError:
            return True
        fd = frame.get(zmq.SRCFD)  # the connection it came on (a property of each connection's messages)
        # The events queued before this subscription first: a stranger's connection that closed may
        # have left its file descriptor to this follower's, and its end must not be taken for this one's.
        if not self._on_connection_events():
            return False
        if fd not in self.open:  # it closed before we read its subscription
            return self._lost(who)
        if who in self.members.values():
            log.warning("a second connection of follower process %s to the leader's step channel", who)
        self.members[fd] = who
        return True

    def wait_for_followers(self, timeout: float) -> None:
        """Returns once every follower has subscribed (so no step is lost); `fatal` past `timeout`."""
        deadline = time.monotonic() + timeout
        poller = zmq.Poller()
        for sock in (self.socket, self.gatekeeper.socket, self.connections):
            poller.register(sock, zmq.POLLIN)
        while len(set(self.members.values())) < self.followers:
            left = deadline - time.monotonic()
            ready = dict(poller.poll(max(1, int(left * 1000)))) if left > 0 else {}  # a flood does not delay it
            if not ready:
                missing = self.followers - len(set(self.members.values()))
                self.fatal(f"{missing} of {self.followers} follower(s) did not join the leader's step channel "
                           f"({self.where}) within {timeout:g} s: is that port reachable from their hosts, and "
                           f"does every process read the same {step_channel_auth.SECRET_ENV}?")
                return
            if self.gatekeeper.socket in ready:
                self.gatekeeper.answer()
            if not self._on_connection_events():
                return
            if self.socket in ready:
                frame = self.socket.recv(copy=False)
                # b"\x01": a subscription; b"\x00" its end, whose connection's end we see anyway
                if frame.bytes[:1] == b"\x01" and not self._on_subscription(frame):
                    return
        self._watcher = threading.Thread(target=self._watch, name="jaxserve-followers", daemon=True)
        self._watcher.start()

    def _watch(self) -> None:
        """From the group's start to its end, in a thread of its own: answers the gatekeeper (a
        stranger waits for no one) and ends the group when a follower's connection closes."""
        poller = zmq.Poller()
        poller.register(self.gatekeeper.socket, zmq.POLLIN)
        poller.register(self.connections, zmq.POLLIN)
        try:
            while True:
                ready = dict(poller.poll())
                if self.gatekeeper.socket in ready:
                    self.gatekeeper.answer()
                if self.connections in ready and not self._on_connection_events():
                    break
        except zmq.ZMQError:  # the context is ending
            pass
        finally:
            self.gatekeeper.socket.close(linger=0)
            self.connections.close(linger=0)

    def send_step(self, batch: StepBatch, logprobs: bool) -> None:
        self.socket.send_multipart(encode_step(batch, logprobs), copy=False)

    def stop(self, reason: str) -> None:
        """Tells the followers to stop, waits a moment for them to disconnect, and closes."""
        if self.stopping:
            return
        self.stopping, connected = True, len(self.members)
        self.socket.send_multipart(encode_stop(reason))
        deadline = time.monotonic() + STOP_WAIT_S
        for _ in range(connected):
            if not self._gone.acquire(timeout=max(0.0, deadline - time.monotonic())):
                break
        self.socket.close(linger=1000)
        if self._watcher is None:  # the group never formed: the watcher's sockets are still ours
            self.gatekeeper.socket.close(linger=0)
            self.connections.close(linger=0)
        self.context.term()


class Follower:
    """A follower's end: receives the leader's steps; `fatal` when the leader refuses this process
    (another secret) or its connection closes."""

    def __init__(self, address: str, secret: bytes, process_id: int, fatal: Callable[[str], None]):
        step_channel_auth.require_curve()
        self.address, self.process_id, self.fatal = address, process_id, fatal
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.SUB)
        keys = step_channel_auth.follower_keys(secret, process_id)
        self.socket.curve_serverkey = step_channel_auth.leader_keys(secret).public
        self.socket.curve_publickey, self.socket.curve_secretkey = keys.public, keys.secret
        self.socket.setsockopt(zmq.RCVHWM, 0)
        self.socket.setsockopt(zmq.IPV6, 1)
        _heartbeats(self.socket)
        self.socket.setsockopt(zmq.SUBSCRIBE, b"")
        self.stopped = False
        self.connected = threading.Event()
        _watch(self.socket, zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH |
               zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_DISCONNECTED,
               self._on_event, "jaxserve-leader")
        self.socket.connect(address)

    def _on_event(self, event: int) -> bool:
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self.connected.set()
            return True
        if not self.connected.is_set():  # the leader ended the handshake: it does not know our key
            self.fatal(f"the leader's step channel at {self.address} refused this process (process "
                       f"{self.process_id}): its step secret differs from the leader's. Every process of the group "
                       f"must read the same {step_channel_auth.SECRET_ENV} (or file named by "
                       f"{step_channel_auth.SECRET_FILE_ENV})")
            return False
        if event == zmq.EVENT_DISCONNECTED:
            if not self.stopped:
                self.fatal(f"the leader (process 0, {self.address}) closed its connection without telling this "
                           "process to stop: it died or its host is unreachable, so the group stops")
            return False
        return True

    def wait_connected(self, timeout: float) -> None:
        if not self.connected.wait(timeout):
            self.fatal(f"could not join the leader's step channel at {self.address} within {timeout:g} s")

    def receive(self) -> tuple:
        message = decode(self.socket.recv_multipart(copy=False))
        if message[0] == "stop":
            self.stopped = True  # the leader closes next: that is no death
        return message

    def close(self) -> None:
        self.stopped = True
        self.socket.close(linger=0)
        self.context.term()
