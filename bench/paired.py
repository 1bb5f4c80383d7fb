"""Recording versus not recording, inside one process: the paired overhead measurement.

Separate runs of a CPU-bound workload on the GPU VM differ by up to 40% from each other
(measured: the same ResNet-50 training at 34 to 53 ms per step, with and without
libgpuos alike), far more than the overhead we must resolve.  Within one run the speed
wanders too, but slowly: on one machine a step's time correlated with the next one's at
0.75 and with the one 20 steps later still at 0.27.  So we compare neighbouring steps:
the workload runs once under `gpuos run` with `--step-log` and `--toggle-recording K`,
and pauses and resumes the recording of its own operations every K steps, between two
steps (the ring header's ops_paused, what `gpuos trace pause|resume` sets); each triplet
of neighbouring windows of K steps (recording, paused, recording or the reverse) gives
the ratio of mean step times recording / paused (wall and CPU), the outer windows
averaged so that a steady drift cancels.  The overhead is the mean of those ratios less
one, with its 95% confidence interval.  On the steps of a 280 s ResNet-50 run the
interval was 3 times narrower with K = 1 than with the windows of 0.5 s (9 steps) that
an outside process switching on a timer gave.

What this leaves out: being interposed at all (a paused wrapper still loads two words
and calls through) and tracking allocations, which stay on while paused; noop-launch
across processes bounds the first, the second happens outside the steady state.  The
recording thread records a step's last operations at the start of the next (within a
millisecond), whatever that step's state.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def read_marks(step_log: Path) -> list[tuple[float, float, bool]]:
    """The (time, CPU time, paused) marks a suite run wrote at its end."""
    for line in reversed(step_log.read_text().splitlines()):
        rec = json.loads(line)
        if "marks" in rec:
            return [(t, cpu, bool(paused)) for t, cpu, paused in rec["marks"]]
    raise ValueError(f"{step_log}: no marks (the run did not finish)")


@dataclass
class Window:
    paused: bool
    steps: int = 0
    wall: float = 0.0
    cpu: float = 0.0


def windows(marks: list[tuple[float, float, bool]]) -> list[Window]:
    """Runs of neighbouring steps in one state: step i lasts from mark i to mark i + 1
    and ran in the state mark i gives."""
    out: list[Window] = []
    for (t0, c0, paused), (t1, c1, _) in zip(marks, marks[1:]):
        if not out or out[-1].paused != paused:
            out.append(Window(paused))
        w = out[-1]
        w.steps += 1
        w.wall += t1 - t0
        w.cpu += c1 - c0
    return out


def _ci(ratios: list[float]) -> dict[str, float]:
    mean = statistics.fmean(ratios)
    half = 1.96 * statistics.stdev(ratios) / math.sqrt(len(ratios)) if len(ratios) > 1 else math.inf
    return {"overhead_pct": (mean - 1) * 100, "ci95_pct": half * 100,
            "median_pct": (statistics.median(ratios) - 1) * 100}


def paired_overhead(wins: list[Window]) -> dict[str, Any]:
    """Triplets of neighbouring windows in alternating states (recording, paused,
    recording or the reverse), each window used once, in time order; per triplet the
    ratio of the mean step time while recording to that while paused, the outer two
    averaged, so that a drift that is linear over the triplet cancels."""
    def mean(w: Window, what: str) -> float:
        return getattr(w, what) / w.steps

    def ratio(a: Window, mid: Window, b: Window, what: str) -> float:
        outer = (mean(a, what) + mean(b, what)) / 2
        return mean(mid, what) / outer if not mid.paused else outer / mean(mid, what)

    triplets = []
    i = 1
    while i + 1 < len(wins):
        a, mid, b = wins[i - 1], wins[i], wins[i + 1]
        if a.paused == b.paused != mid.paused:
            triplets.append((a, mid, b))
            i += 3
        else:
            i += 1
    if not triplets:
        return {"triplets": 0}
    out = {"triplets": len(triplets),
           "steps": {"recording": sum(w.steps for w in wins if not w.paused),
                     "paused": sum(w.steps for w in wins if w.paused)},
           "wall": _ci([ratio(*t, "wall") for t in triplets])}
    if all(w.cpu > 0 for t in triplets for w in t):
        out["cpu"] = _ci([ratio(*t, "cpu") for t in triplets])
    return out
