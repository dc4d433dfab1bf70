"""`scripts/bench_batching.py --timeline PNG` on a tiny Llama: a short run of every strategy writes
one panel per run, and each run's timeline is what its strategy does (one slot at a time for
`none`, fixed batches for `static`, slots refilled as requests finish for `paged`)."""

from __future__ import annotations

import matplotlib.image
import pytest

from jaxserve.bench import batching as bench_batching

STRATEGIES = ["none", "static", "dynamic", "continuous", "paged"]
REQUESTS = 6


@pytest.fixture(scope="module")
def run(checkpoints, tmp_path_factory):
    path = tmp_path_factory.mktemp("timeline") / "timeline.png"
    rows, timelines = bench_batching.main([
        "--model", checkpoints("llama"), "--num-requests", str(REQUESTS), "--input-len", "8:30",
        "--output-len", "4:10", "--max-slots", "2", "--max-model-len", "64", "--kv-cache-mb", "1",
        "--batch-size", "2", "--max-batch-delay-ms", "5", "--max-num-batched-tokens", "16",
        "--strategies", ",".join(STRATEGIES), "--timeline", str(path)])
    return path, rows, timelines


def busy_at(timeline, t: float) -> int:
    return sum(1 for slot, _, _, begin, end in timeline.segments if begin < t <= end)


def test_a_panel_per_strategy_run(run):
    path, rows, timelines = run
    assert [t.label for t in timelines] == [r["strategy"] for r in rows] == STRATEGIES
    image = matplotlib.image.imread(path)
    assert image.shape[0] >= 300 * len(STRATEGIES) and image.shape[1] >= 1000
    assert image[..., :3].std() > 0.05  # something is drawn


@pytest.mark.parametrize("index", range(len(STRATEGIES)), ids=STRATEGIES)
def test_each_timeline_follows_its_requests(run, index):
    timeline = run[2][index]
    assert {s[1] for s in timeline.segments} == set(range(REQUESTS))  # every request, by workload index
    assert {s[2] for s in timeline.segments} == {"prefill", "decode"}
    for slot in range(timeline.max_slots):  # a slot holds one request at a time
        pieces = sorted((b, e) for s, _, _, b, e in timeline.segments if s == slot)
        assert all(e1 <= b2 for (_, e1), (b2, _) in zip(pieces, pieces[1:]))
    for number in range(REQUESTS):  # a request prefills, then decodes
        phases = [s[2] for s in sorted(timeline.segments, key=lambda s: s[3]) if s[1] == number]
        assert phases[0] == "prefill" and phases[-1] == "decode"
    assert timeline.kv[-1][1] == 0  # no page used once the run is over
    peak = max(busy_at(timeline, t) for t, _, _ in timeline.kv)
    assert peak == (1 if timeline.label == "none" else 2)


def test_rounds_alternate_the_engines_and_print_ratios_within_each_round(checkpoints, capsys):
    """`--rounds 2`: each engine runs once per round, in turn, and the summary's ratio of two runs is
    the median of their per-round ratios."""
    rows, _ = bench_batching.main([
        "--model", checkpoints("llama"), "--num-requests", "2", "--input-len", "8:12", "--output-len", "4:4",
        "--max-slots", "2", "--max-model-len", "64", "--kv-cache-mb", "1", "--max-num-batched-tokens", "16",
        "--strategies", "paged", "--quantizations", "none,int8", "--rounds", "2"])
    assert [r["strategy"] for r in rows] == ["paged #1", "paged (int8 weights) #1", "paged #2",
                                             "paged (int8 weights) #2"]
    ratios = [rows[i + 1]["output_tokens_per_s"] / rows[i]["output_tokens_per_s"] for i in (0, 2)]
    line = next(l for l in capsys.readouterr().out.splitlines() if l.startswith("  paged (int8 weights):"))
    assert f"{sum(ratios) / 2:.2f}x paged ({min(ratios):.2f}-{max(ratios):.2f})" in line
