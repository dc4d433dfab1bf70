"""jaxserve: a JAX/XLA inference engine for decoder-only language models.

The public names load lazily, so `import jaxserve.engine.batching` (pure Python) never pulls in jax.
"""

import importlib

_EXPORTS = {
    "Engine": "jaxserve.engine.llm_engine",
    "QueueFullError": "jaxserve.errors",
    "EngineConfig": "jaxserve.config",
    "SamplingParams": "jaxserve.engine.batching.sampling_params",
    "StructuredOutputs": "jaxserve.engine.batching.structured_outputs",
    "RequestOutput": "jaxserve.engine.batching.request",
}
__all__ = list(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'jaxserve' has no attribute {name!r}")
