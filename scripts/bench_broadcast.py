"""What it costs to get one step's inputs from the leader of a multi-host group to a follower, two
ways: jaxserve's ZMQ channel (jaxserve/distributed/step_channel.py) and jax's own
`multihost_utils.broadcast_one_to_all` (two collectives per step: the shapes, then the arrays).

    python scripts/bench_broadcast.py                     # starts both processes itself, on loopback

Two processes of `--devices-per-process` CPU devices each (gloo collectives) join one group. Each
step is a StepBatch of the default engine config's shapes (32 slots, 256-token budget, 2048
context in pages of 16): a decode step of 32 rows and a 256-token prefill chunk. Steps go out
`--gap-ms` apart, so each is timed alone. Figures (ms, p50 / mean over `--steps`):

- zmq send: what the leader's step pays (encode and hand to ZMQ's I/O thread);
- zmq one-way: from before the send until the follower holds the decoded StepBatch (both
  processes on this machine read the same monotonic clock);
- jax broadcast: the leader's wait for both collectives (the follower's is the same), with the
  step's arrays as they are, and packed into one byte array (fewer, larger transfers).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SLOTS, BUDGET, PAGE, CONTEXT = 32, 256, 16, 2048


def batches() -> dict:
    """{name: StepBatch} of the default config's shapes."""
    from jaxserve.worker.sampling import SamplingBatch
    from jaxserve.worker.step_batch import ScheduledSeq, StepBuckets, build_step
    width = CONTEXT // PAGE
    tables = np.arange(SLOTS * width, dtype=np.int32).reshape(SLOTS, 1, width) % 4096
    sampling = SamplingBatch(np.zeros(SLOTS, np.float32), np.zeros(SLOTS, np.int32), np.ones(SLOTS, np.float32),
                             np.zeros(SLOTS, np.float32), np.arange(SLOTS, dtype=np.uint32))
    buckets = StepBuckets(BUDGET, SLOTS)
    decode = [ScheduledSeq(s, 300 + s, [7]) for s in range(SLOTS)]
    prefill = [ScheduledSeq(0, 0, list(range(BUDGET)))]
    return {"decode 32 rows": build_step(decode, tables, sampling, PAGE, buckets),
            "prefill 256 tokens": build_step(prefill, tables, sampling, PAGE, buckets)}


def arrays_of(batch) -> list[np.ndarray]:
    import dataclasses
    out = []
    for f in dataclasses.fields(batch):
        v = getattr(batch, f.name)
        out += arrays_of(v) if dataclasses.is_dataclass(v) else [v] if isinstance(v, np.ndarray) else []
    return out


def run(process_id: int, port: int, steps: int, gap: float) -> dict:
    import jax
    from jax.experimental import multihost_utils

    from jaxserve.distributed import step_channel
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", 2, process_id)
    leader = process_id == 0
    die = lambda why: os._exit(f"{why}")  # noqa: E731
    channel = step_channel.Leader(1, "127.0.0.1", die) if leader else None
    data_port = int(multihost_utils.broadcast_one_to_all(np.int32(channel.port if leader else 0)))
    if leader:
        channel.wait_for_followers(30)
    else:
        channel = step_channel.Follower(f"tcp://127.0.0.1:{data_port}", die)
        channel.wait_connected(30)
    results = {}
    for name, batch in batches().items():
        arrays = arrays_of(batch)
        header = np.zeros(64, np.int32)  # what a follower would need first: dtypes and shapes, encoded
        # jax's broadcast: every process passes arrays of the same shapes (the follower's are zeros).
        multihost_utils.sync_global_devices(name)
        packed = np.concatenate([a.view(np.uint8).ravel() for a in arrays])
        jax_ms, packed_ms = [], []
        for _ in range(steps + 3):
            start = time.perf_counter()
            multihost_utils.broadcast_one_to_all(header)
            multihost_utils.broadcast_one_to_all(arrays if leader else [np.zeros_like(a) for a in arrays])
            jax_ms.append((time.perf_counter() - start) * 1e3)
            time.sleep(gap)
            start = time.perf_counter()
            multihost_utils.broadcast_one_to_all(header)
            np.asarray(multihost_utils.broadcast_one_to_all(packed if leader else np.zeros_like(packed))).view(np.int32)
            packed_ms.append((time.perf_counter() - start) * 1e3)
            time.sleep(gap)
        multihost_utils.sync_global_devices(name + " zmq")
        sends, stamps = [], []
        for _ in range(steps + 3):
            if leader:
                start = time.perf_counter()
                channel.send_step(batch, False)
                sends.append((time.perf_counter() - start) * 1e3)
                stamps.append(start)
                time.sleep(gap)
            else:
                channel.receive()
                stamps.append(time.perf_counter())
        results[name] = {"jax": jax_ms[3:], "packed": packed_ms[3:], "send": sends[3:], "stamps": stamps[3:],
                         "bytes": sum(a.nbytes for a in arrays)}
    if leader:
        channel.stop("done")
    else:
        channel.receive()
        channel.close()
    return results


def summary(ms: list[float]) -> str:
    return f"{np.percentile(ms, 50):.3f} / {np.mean(ms):.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--gap-ms", type=float, default=5.0)
    parser.add_argument("--devices-per-process", type=int, default=2)
    parser.add_argument("--process-id", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.process_id is not None:
        print(json.dumps(run(args.process_id, args.port, args.steps, args.gap_ms / 1e3)), flush=True)
        return
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={args.devices_per_process}")
    procs = [subprocess.Popen([sys.executable, __file__, "--process-id", str(i), "--port", str(port), "--steps",
                               str(args.steps), "--gap-ms", str(args.gap_ms)], env=env, stdout=subprocess.PIPE,
                              text=True) for i in range(2)]
    out = [json.loads(p.communicate(timeout=600)[0].strip().splitlines()[-1]) for p in procs]
    print(f"2 processes x {args.devices_per_process} CPU devices, gloo, loopback; {args.steps} steps {args.gap_ms:g} ms "
          "apart; ms p50 / mean")
    print(f"{'step':<20} {'bytes':>7} {'zmq send (leader)':>18} {'zmq one-way':>14} {'jax broadcast x2':>17} "
          f"{'same, packed':>15}")
    for name, lead in out[0].items():
        one_way = [(r - s) * 1e3 for s, r in zip(lead["stamps"], out[1][name]["stamps"])]
        print(f"{name:<20} {lead['bytes']:>7} {summary(lead['send']):>18} {summary(one_way):>14} "
              f"{summary(lead['jax']):>17} {summary(lead['packed']):>15}")


if __name__ == "__main__":
    main()
