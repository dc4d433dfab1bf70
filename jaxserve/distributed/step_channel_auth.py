"""Who may use the step channel: only the processes of the group, which hold its shared secret.

    every process   $JAXSERVE_STEP_SECRET (or the file $JAXSERVE_STEP_SECRET_FILE names) ─► read_secret
                    ─► leader_keys, follower_keys(process id): CURVE key pairs, the same in every process
    leader          XPUB with the leader's secret key (CURVE server) ─► each handshake ─► Gatekeeper:
                    admitted iff the peer's public key is a follower's, named by that follower's id
    follower        SUB with its own key pair, and the leader's public key

The step channel carries every prompt's token ids, so a peer that does not hold the secret must
receive nothing and change nothing. ZMQ's CURVE handshake proves both ends: the follower must know
the leader's public key and the gatekeeper accepts only the followers' keys, all of them derived
from the secret, so a stranger never completes it and never becomes a subscriber. After the
handshake every message is encrypted and authenticated (one forged or altered on the way closes the
connection instead of reaching the follower), in ZMQ's I/O threads: the engine's send does not wait.

Why CURVE rather than a challenge of our own (an HMAC over a fresh nonce): the XPUB socket only
broadcasts, so it cannot send each peer its own challenge; the steps would still cross the network
readable, and each would need an HMAC of its own; and the fewer protocols we write, the fewer we get
wrong. pyzmq's wheels carry CURVE; where a build lacks it, `require_curve` says so.

The secret never comes from a flag: a command line is visible to every user of the host. Without
one, a group refuses to start (a loopback test sets one in the environment of the processes it
starts).
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import os
from typing import Mapping

import zmq
from zmq.utils import z85

SECRET_ENV = "JAXSERVE_STEP_SECRET"
SECRET_FILE_ENV = "JAXSERVE_STEP_SECRET_FILE"
MIN_SECRET_BYTES = 16
MAKE_ONE = "python -c 'import secrets; print(secrets.token_hex(32))'"
ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # where libzmq asks about each handshake of a socket in its context


def read_secret(environ: Mapping[str, str] = os.environ) -> bytes:
    """The group's secret from the environment; ValueError, saying how to set one, if none is usable."""
    value, path = environ.get(SECRET_ENV, ""), environ.get(SECRET_FILE_ENV, "")
    if value and path:
        raise ValueError(f"set {SECRET_ENV} or {SECRET_FILE_ENV}, not both")
    if path:
        try:
            with open(path, "rb") as f:
                secret, source = f.read().strip(), f"the file {path} ({SECRET_FILE_ENV})"
        except OSError as e:
            raise ValueError(f"{SECRET_FILE_ENV} names {path!r}, which cannot be read: {e.strerror}") from None
    elif value:
        secret, source = value.strip().encode(), SECRET_ENV
    else:
        raise ValueError(
            f"a multi-host group needs a shared secret, so that only its own processes can join the leader's "
            f"step channel (it carries every prompt's token ids): set {SECRET_ENV} to the same value in every "
            f"process, or {SECRET_FILE_ENV} to a file that holds it; make one with `{MAKE_ONE}`. Never pass it "
            "as a flag: a command line is visible to every user of the host")
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"the step secret from {source} has {len(secret)} bytes; use at least {MIN_SECRET_BYTES} "
                         f"random ones, e.g. `{MAKE_ONE}`")
    return secret


def require_curve() -> None:
    if not zmq.has("curve"):
        raise ValueError(f"this pyzmq (libzmq {zmq.zmq_version()}) was built without CURVE, which a multi-host "
                         "group's step channel needs to keep strangers out: install pyzmq's own wheel "
                         "(pip install --force-reinstall pyzmq), whose libzmq has it")


@dataclasses.dataclass(frozen=True)
class Keys:
    public: bytes = dataclasses.field(repr=False)  # Z85 text, 40 bytes
    secret: bytes = dataclasses.field(repr=False)


def _keys(secret: bytes, role: str) -> Keys:
    # Any 32 bytes make a Curve25519 secret key; an HMAC of the role keeps each role's key apart.
    private = z85.encode(hmac.new(secret, f"jaxserve step channel: {role}".encode(), hashlib.sha256).digest())
    return Keys(zmq.curve_public(private), private)


def leader_keys(secret: bytes) -> Keys:
    return _keys(secret, "leader")


def follower_keys(secret: bytes, process_id: int) -> Keys:
    return _keys(secret, f"follower {process_id}")


class Gatekeeper:
    """The leader's ZAP handler (ZMQ RFC 27): libzmq asks it about each peer that completed the
    CURVE handshake. It admits the followers' keys only, and names each peer by its process id, the
    `User-Id` of that peer's messages. One thread at a time calls `answer` when its socket is readable."""

    def __init__(self, context: zmq.Context, secret: bytes, followers: int):
        self.members = {follower_keys(secret, i).public: str(i) for i in range(1, followers + 1)}
        self.socket = context.socket(zmq.REP)
        self.socket.bind(ZAP_ENDPOINT)

    def answer(self) -> None:
        frames = self.socket.recv_multipart()
        request_id, mechanism, credentials = frames[1], frames[5], frames[6:]
        who = None
        if mechanism == b"CURVE" and len(credentials) == 1:
            who = self.members.get(z85.encode(credentials[0]))
        status = [b"200", b"OK", who.encode()] if who else [b"400", b"not a process of this group", b""]
        self.socket.send_multipart([b"1.0", request_id, *status, b""])
