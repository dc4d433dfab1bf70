"""Benchmark code that tests import as well as scripts run: the batching strategies side by side
(`batching`), per-step host and device time (`step_profile`) and slot timelines (`timeline`).
The engine never imports this package."""
