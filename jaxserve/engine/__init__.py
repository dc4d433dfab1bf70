"""The engine process: the engine core and its loop, input and output processing, grammars, and
the scheduler with its KV managers (`batching/`).

Nothing here is imported on package import: the API process imports `batching` (sampling
parameters, request types) and `core_process` (to start the engine process) without jax.
"""
