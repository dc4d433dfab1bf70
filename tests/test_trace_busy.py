"""The device's busy share read from a profiler trace (`jaxserve.bench.trace_busy`), on a trace
written by hand: kernels on two streams, overlapping once, with a gap the device sat idle."""

from jax.profiler import ProfileData

from jaxserve.bench.trace_busy import device_busy, host_top

MS = 10**9  # picoseconds


def event(offset_ms, duration_ms, metadata=1):
    return f"events {{ metadata_id: {metadata} offset_ps: {offset_ms * MS} duration_ps: {duration_ms * MS} }}"


TRACE = f"""
planes {{
  name: "/device:GPU:0"
  lines {{ name: "Stream #13(Compute)" timestamp_ns: 1000000 {event(0, 2)} {event(5, 5)} }}
  lines {{ name: "Stream #14(MemcpyH2D)" timestamp_ns: 1000000 {event(1, 2)} }}
  lines {{ name: "XLA Modules" timestamp_ns: 1000000 {event(0, 10)} }}
  event_metadata {{ key: 1 value {{ id: 1 name: "fusion" }} }}
}}
planes {{
  name: "/host:CPU"
  lines {{ name: "python" timestamp_ns: 0 {event(0, 4, 1)} {event(4, 1, 2)} {event(6, 3, 1)} }}
  event_metadata {{ key: 1 value {{ id: 1 name: "PjitFunction(_forward)" }} }}
  event_metadata {{ key: 2 value {{ id: 2 name: "schedule" }} }}
}}
"""


def test_busy_is_the_union_of_the_streams_kernels_over_their_window():
    trace = ProfileData.from_text_proto(TRACE)
    (row,) = device_busy([trace])
    assert row["device"] == "/device:GPU:0" and row["kernels"] == 3
    assert row["window_ms"] == 10 and row["busy_ms"] == 8  # [0, 3] and [5, 10]: the module line is not a kernel
    assert row["busy_share"] == 0.8
    assert host_top([trace], 2) == [("PjitFunction(_forward)", 7.0, 2), ("schedule", 1.0, 1)]
