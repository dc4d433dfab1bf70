"""jaxserve: a JAX/XLA inference engine for decoder-only language models."""

from jaxserve.batching import RequestOutput, SamplingParams
from jaxserve.config import EngineConfig
from jaxserve.engine import Engine, QueueFullError

__all__ = ["Engine", "EngineConfig", "QueueFullError", "RequestOutput", "SamplingParams"]
