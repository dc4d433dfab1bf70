"""The errors a caller of the engine, in process or through its client, may catch (no jax here:
the API process imports them too)."""


class QueueFullError(RuntimeError):
    """The engine's waiting queue is at its bound (`max_waiting`); retry later."""


class EngineDeadError(RuntimeError):
    """The engine core has stopped; nothing more can be served."""
