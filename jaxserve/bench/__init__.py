"""Benchmark code that tests import as well as scripts run: the batching strategies side by side
(`batching`, with llama.cpp as a peer in `llamacpp_peer`), per-step host and device time
(`step_profile`), slot timelines (`timeline`), and for the load scripts a `jaxserve serve`
subprocess (`server_process`) and an OpenAI HTTP client (`http_load`). The engine never imports
this package."""
