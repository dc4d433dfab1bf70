"""The API process: the CLI, the HTTP server (OpenAI and vLLM protocol, routes), chat templates,
tool and response-format parsing, the dashboard, Ray Serve replicas, and the engine client that
starts and talks to the engine process.

Nothing in this package imports jax (tests/test_layers.py checks it): the engine process does
the computing, so the API process starts fast and stays responsive.
"""
