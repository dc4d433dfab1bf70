"""The host-cost benchmark's phase breakdown: every phase of a decoding step is timed, and the
phases account for the step's CPU time; and its bookkeeping-only mode."""

import time

import pytest

from jaxserve.bench import host_cost


def test_the_breakdown_times_every_phase_of_a_step():
    engine = host_cost.tiny_engine(sequences=2, context=20, steps=3, max_model_len=256, layers=1, hidden=32)
    row = host_cost.measure(engine, sequences=2, context=20, steps=3, breakdown=True)
    phases = row["phases"]
    assert list(phases) == [label for label, _, _ in host_cost.PHASES] + ["other"]
    for label in ("schedule", "build inputs", "dispatch", "  pack inputs", "advance", "collect tokens", "commit"):
        assert phases[label] > 0, label  # each wrapped method ran in every timed step
    assert phases["other"] >= 0  # the timed phases are parts of the step, none counted twice
    assert row["tokens_per_call"] == 1.0


def test_a_sliding_window_gives_gemma3s_groups_and_steps():
    engine = host_cost.tiny_engine(sequences=2, context=20, steps=3, max_model_len=256, layers=6, hidden=32,
                                   sliding_window=16)
    assert engine.core.runner.kv_groups.windows == (None,) + (16,) * 5  # five sliding layers in six, one group each
    row = host_cost.measure(engine, sequences=2, context=20, steps=3)
    assert row["tokens_per_call"] == 1.0


@pytest.mark.parametrize("idle_ms", [0, 20])
def test_the_bookkeeping_alone_times_each_phase_and_leaks_no_page(idle_ms, monkeypatch):
    engine = host_cost.tiny_engine(sequences=2, context=20, steps=5, max_model_len=256, layers=1, hidden=32)
    sleeps, sleep = [], time.sleep
    monkeypatch.setattr(time, "sleep", lambda s: (sleeps.append(s), sleep(s)))
    phases = host_cost.measure_bookkeeping(engine, sequences=2, context=20, steps=5, idle_ms=idle_ms)
    assert sleeps.count(0.02) == (5 if idle_ms else 0)  # with idle_ms, one sleep before each step
    assert list(phases) == ["schedule", "build inputs", "advance", "commit", "all"]
    for label, (low, median) in phases.items():
        assert 0 < low <= median, label
    stats = engine.stats()
    assert stats["running"] == stats["waiting"] == stats["used_pages"] == 0
