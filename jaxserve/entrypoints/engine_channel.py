"""The two ZMQ sockets between the API process and its engine core: commands out (PUSH), one
message per engine step in (PULL), bound on IPC paths in a folder only this user can enter.
Messages are pickled: whoever can reach these paths can already run code as this user."""

from __future__ import annotations

import pickle
import shutil
import tempfile
import threading
import weakref

import zmq


class EngineChannel:
    def __init__(self, owner):
        """`owner`: the object whose collection closes the channel if `close` is never called."""
        folder = tempfile.mkdtemp(prefix="jaxserve-")
        self.addrs = (f"ipc://{folder}/commands", f"ipc://{folder}/outputs")
        self.context = zmq.Context()
        self._commands = self.context.socket(zmq.PUSH)
        self.outputs = self.context.socket(zmq.PULL)
        for sock, addr in zip((self._commands, self.outputs), self.addrs):
            sock.setsockopt(zmq.SNDHWM, 0)  # never drop nor block: the 429 bound limits the queue
            sock.setsockopt(zmq.RCVHWM, 0)
            sock.bind(addr)
        # Closes the channel when the owner is dropped without close() (an app whose lifespan
        # never ran): left to zmq's own finalizers, the context may be finalized before its sockets
        # and then waits for them forever. Holds no reference to the owner.
        self.close = weakref.finalize(owner, _close, self.context, (self._commands, self.outputs), folder)
        self.close.atexit = False  # at exit an engine thread may still hold sockets of the context
        self._send_lock = threading.Lock()

    def send(self, command: tuple) -> None:
        """Sends a command without blocking (zmq.Again, zmq.ZMQError when the channel is closed)."""
        data = pickle.dumps(command, protocol=pickle.HIGHEST_PROTOCOL)
        with self._send_lock:
            self._commands.send(data, zmq.NOBLOCK)

    def receive(self, timeout_ms: int):
        """The next message from the engine, or None after `timeout_ms`."""
        return pickle.loads(self.outputs.recv()) if self.outputs.poll(timeout_ms) else None


def _close(context: zmq.Context, sockets: tuple[zmq.Socket, ...], folder: str) -> None:
    """Closes the sockets and the context and removes the folder of their addresses."""
    for sock in sockets:
        sock.close(linger=0)
    context.term()
    shutil.rmtree(folder, ignore_errors=True)
