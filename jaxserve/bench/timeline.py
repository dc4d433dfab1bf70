"""Slot timelines of benchmark runs (`bench_batching.py --timeline PNG`): which request held which
slot when, its prompt chunks told apart from its decoding, and the KV pool's use underneath; one
panel per strategy run.

    TimelineRecorder.before_step(engine)   each running request's slot and phase: prefill while more
                                           than one token is left to compute (as the dashboard says),
                                           else decode; a request admitted by the step is in prefill
    engine.step()
    TimelineRecorder.after_step(...)       a bar piece per request over the step; KV pages used and
                                           cached after it
    plot_timelines([Timeline, ...], path)  matplotlib: a Gantt chart of slots over a KV area chart

A step's interval runs from the end of the step before it (when the loop did not sleep between
them), so a request's bar is continuous from its admission to its last token.
"""

from __future__ import annotations

import dataclasses

GAP_S = 0.1  # a pause longer than this between two steps is idle time, left blank


@dataclasses.dataclass
class Timeline:
    label: str
    max_slots: int
    total_pages: int
    segments: list[list] = dataclasses.field(default_factory=list)  # [slot, request number, phase, start, end]
    kv: list[tuple[float, int, int]] = dataclasses.field(default_factory=list)  # (time, used, cached pages)

    @property
    def makespan(self) -> float:
        return max((s[4] for s in self.segments), default=0.0)


class TimelineRecorder:
    """Builds a Timeline from a benchmark's step loop; times are seconds after `start`."""

    def __init__(self, label: str, engine, start: float, numbers: dict[str, int]):
        self.timeline = Timeline(label, engine.config.max_slots, engine.blocks.total_pages)
        self.start = start
        self.numbers = numbers  # request id -> its number in the workload (its colour)
        self._before: dict = {}
        self._last_end: float | None = None
        self._open: dict[int, list] = {}  # slot -> its latest segment

    def before_step(self, engine) -> None:
        self._before = {r: (r.slot, r.num_uncomputed_tokens > 1) for r in engine.scheduler.running}

    def after_step(self, engine, t0: float, t1: float, done) -> None:
        t0, t1 = t0 - self.start, t1 - self.start
        begin = self._last_end if self._last_end is not None and t0 - self._last_end < GAP_S else t0
        self._last_end = t1
        for r in list(engine.scheduler.running) + list(done):
            slot, prefill = self._before.get(r, (r.slot, True))
            if slot is None:
                continue  # admitted and finished within this step
            self._extend(slot, self.numbers.get(r.request_id, -1), "prefill" if prefill else "decode", begin, t1)
        blocks = engine.blocks
        self.timeline.kv.append((t1, blocks.used_pages, blocks.cached_pages))

    def _extend(self, slot: int, number: int, phase: str, begin: float, end: float) -> None:
        last = self._open.get(slot)
        if last is not None and last[1] == number and last[2] == phase and last[4] == begin:
            last[4] = end
            return
        segment = [slot, number, phase, begin, end]
        self.timeline.segments.append(segment)
        self._open[slot] = segment


def plot_timelines(timelines: list[Timeline], path: str) -> None:
    """One panel per run: slots over time (a colour per request, prompt chunks hatched and pale),
    and under it the KV pool's used and cached pages, in percent."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch
    from matplotlib.ticker import MaxNLocator

    fig = plt.figure(figsize=(13, 3.8 * len(timelines)), layout="constrained")
    panels = fig.subfigures(len(timelines), 1, squeeze=False)[:, 0]
    colors = plt.get_cmap("tab20")
    for k, (tl, panel) in enumerate(zip(timelines, panels)):
        gantt, kv = panel.subplots(2, 1, sharex=True, height_ratios=[3, 1])
        for slot, number, phase, begin, end in tl.segments:
            color = colors(number % 20) if number >= 0 else "grey"
            prefill = phase == "prefill"
            gantt.barh(slot, end - begin, left=begin, height=0.85, color=color, alpha=0.4 if prefill else 1.0,
                       hatch="////" if prefill else None, edgecolor="black" if prefill else color, linewidth=0)
        gantt.set_ylim(tl.max_slots - 0.5, -0.5)
        gantt.yaxis.set_major_locator(MaxNLocator(integer=True))
        gantt.set_ylabel("slot")
        busiest = max((sum(1 for s in tl.segments if s[3] < t <= s[4]) for t, _, _ in tl.kv), default=0)
        peak_kv = max((u for _, u, _ in tl.kv), default=0) / max(1, tl.total_pages)
        gantt.set_title(f"{tl.label}: {len({s[1] for s in tl.segments})} requests in {tl.makespan:.1f} s, "
                        f"up to {busiest} of {tl.max_slots} slots busy, KV use peak {peak_kv:.0%}",
                        loc="left", fontsize=10)
        if k == 0:  # above the panel, right of its title
            gantt.legend(handles=[Patch(facecolor="tab:blue", label="decode (a colour per request)"),
                                  Patch(facecolor="tab:blue", alpha=0.4, hatch="////", edgecolor="black",
                                        label="prompt (prefill)")], loc="lower right", bbox_to_anchor=(1, 1),
                         ncol=2, fontsize=8, frameon=False)
        times = [t for t, _, _ in tl.kv]
        used = [100 * u / max(1, tl.total_pages) for _, u, _ in tl.kv]
        cached = [100 * c / max(1, tl.total_pages) for _, _, c in tl.kv]
        kv.stackplot(times, used, cached, step="pre", colors=["tab:blue", "lightgrey"],
                     labels=["KV pages used", "cached"])
        kv.set_ylim(0, 100)
        kv.set_ylabel("KV %")
        kv.set_xlim(0, max(tl.makespan, 1e-3) * 1.01)
        if k == 0:
            kv.legend(loc="upper left", ncol=2, fontsize=7, framealpha=0.7)
        kv.set_xlabel("seconds since the run started")
    fig.savefig(path, dpi=100)
    plt.close(fig)
