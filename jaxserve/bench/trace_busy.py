"""How busy the device was, read from a `jax.profiler` trace rather than from the host's clocks:
the share of the time between its first and last kernel in which some kernel ran, and what the
host's threads spent most time in.

    python -m jaxserve.bench.trace_busy TRACE_DIR

A gap between kernels is time the device waited (on the host, a copy or a predicate). The
batching benchmark's own "device idle" figure comes from host timestamps (`step_profile`); when
the host's dispatch itself waits for the device, only a trace tells the two apart.
"""

from __future__ import annotations

import argparse
import collections
import glob
import os

from jax.profiler import ProfileData


def _union_ns(intervals: list[tuple[int, int]]) -> int:
    total, end = 0, None
    for start, stop in sorted(intervals):
        if end is None or start > end:
            total, end = total + stop - start, stop
        elif stop > end:
            total, end = total + stop - end, stop
    return total


def _kernel_lines(plane) -> list:
    """A device plane's lines of kernels: its streams where the trace has them, else all of them."""
    lines = list(plane.lines)
    streams = [line for line in lines if line.name.startswith("Stream")]
    ops = [line for line in lines if line.name == "XLA Ops"]
    return streams or ops or lines


def load(trace_dir: str) -> list[ProfileData]:
    return [ProfileData.from_file(path)
            for path in sorted(glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True))]


def device_busy(traces: list[ProfileData]) -> list[dict]:
    """Per device plane: the window from its first kernel to its last (ms), the time some kernel
    ran in it (ms, overlaps counted once) and their ratio."""
    out = []
    for plane in (plane for data in traces for plane in data.planes if plane.name.startswith("/device:")):
        intervals = [(e.start_ns, e.end_ns) for line in _kernel_lines(plane) for e in line.events]
        if not intervals:
            continue
        window = max(end for _, end in intervals) - min(start for start, _ in intervals)
        busy = _union_ns(intervals)
        out.append({"device": plane.name, "window_ms": window / 1e6, "busy_ms": busy / 1e6,
                    "busy_share": busy / window if window else float("nan"), "kernels": len(intervals)})
    return out


def host_top(traces: list[ProfileData], n: int = 10) -> list[tuple[str, float, int]]:
    """The n event names the host planes spent most time in: (name, ms in all, count)."""
    spent, count = collections.Counter(), collections.Counter()
    for plane in (plane for data in traces for plane in data.planes if plane.name.startswith("/host:")):
        for line in plane.lines:
            for e in line.events:
                spent[e.name] += e.duration_ns
                count[e.name] += 1
    return [(name, ns / 1e6, count[name]) for name, ns in spent.most_common(n)]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace_dir")
    p.add_argument("--top", type=int, default=10, help="host events to list")
    args = p.parse_args(argv)
    traces = load(args.trace_dir)
    rows = device_busy(traces)
    print("| device | window ms | busy ms | busy | kernels |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['device']} | {r['window_ms']:.1f} | {r['busy_ms']:.1f} | {r['busy_share']:.1%} | {r['kernels']} |")
    if not rows:
        print("| (no device plane: on a CPU, XLA's work is on the host's threads) | | | | |")
    print("\n| host event | ms | count |\n|---|---|---|")
    for name, ms, count in host_top(traces, args.top):
        print(f"| {name[:80]} | {ms:.1f} | {count} |")


if __name__ == "__main__":
    main()
