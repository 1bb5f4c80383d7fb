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
the difference of mean step times recording - paused (wall and CPU), the outer windows
averaged so that a steady drift cancels.  The overhead is the mean of those
differences over the mean paused step, with its 95% confidence interval.  On the steps
of a 280 s ResNet-50 run the interval was 3 times narrower with K = 1 than with the
windows of 0.5 s (9 steps) that an outside process switching on a timer gave.

The VM also stalls a step now and then (one run: 2.4% of ResNet-50 training steps took
over twice the median, up to 3 times), as often recording as paused (9.7% and 9.0% of
steps over 1.3 times the median, and the same time lost in them), so stalls only add
noise, and a few of them decide the mean.  The same triplets are therefore also compared
with every step capped at the run's 95th percentile (`wall_capped`): stalls still
count, as the slowest normal step.  On the same data its interval was half as wide
(ResNet-50 training: +1.5 ± 1.0% capped, +1.2 ± 2.1% not).

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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


def read_marks(step_log: Path) -> list[tuple[float, float, bool]]:
    """The (time, CPU time, paused) marks a suite run wrote at its end."""
    for line in reversed(step_log.read_text().splitlines()):
        rec = json.loads(line)
        if "marks" in rec:
            return [(t, cpu, bool(paused)) for t, cpu, paused in rec["marks"]]
    raise ValueError(f"{step_log}: no marks (the run did not finish)")


CAP_QUANTILE = 0.95  # wall_capped: every step at most the run's 95th percentile


@dataclass
class Window:
    paused: bool
    steps: int = 0
    wall: float = 0.0
    cpu: float = 0.0
    walls: list[float] = field(default_factory=list)  # each step's wall time


def step_times(marks: list[tuple[float, float, bool]]) -> list[list]:
    """Each step's [wall ms, CPU ms, 1 if paused], as the benchmark's JSON keeps them."""
    return [[round((t1 - t0) * 1e3, 3), round((c1 - c0) * 1e3, 3), int(paused)]
            for (t0, c0, paused), (t1, c1, _) in zip(marks, marks[1:])]


def marks_from(paired_run: dict[str, Any]) -> list[tuple[float, float, bool]] | None:
    """Marks rebuilt from a paired run's JSON: from step_times, or from the signed wall
    times (step_ms, negative while paused; no CPU time) of the first results kept."""
    if "step_times" in paired_run:
        rows = [(w, c, bool(p)) for w, c, p in paired_run["step_times"]]
    elif "step_ms" in paired_run:
        rows = [(abs(w), 0.0, w < 0) for w in paired_run["step_ms"]]
    else:
        return None
    marks, t, c = [], 0.0, 0.0
    for wall, cpu, paused in rows:
        marks.append((t, c, paused))
        t, c = t + wall / 1e3, c + cpu / 1e3
    return marks + [(t, c, False)]


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
        w.walls.append(t1 - t0)
    return out


def _estimate(diffs: list[float], paused_mean: float) -> dict[str, float]:
    """The overhead from the triplets' differences (recording less paused) relative to
    the mean paused step, with its 95% interval.  Not a mean of per-triplet ratios: a
    ratio of single noisy steps is biased upwards (the mean of 1/x exceeds 1/mean x),
    by several percent at the VM's noise."""
    mean = statistics.fmean(diffs)
    half = 1.96 * statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else math.inf
    return {"overhead_pct": mean / paused_mean * 100, "ci95_pct": half / paused_mean * 100,
            "median_pct": statistics.median(diffs) / paused_mean * 100}


# Two-sided 95% quantiles of Student's t, by degrees of freedom (beyond: the normal's).
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306,
       9: 2.262, 10: 2.228, 11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120,
       17: 2.110, 18: 2.101, 19: 2.093, 20: 2.086, 25: 2.060, 30: 2.042}


def t95(df: int) -> float:
    if df < 1:
        return math.inf
    return T95.get(df) or T95[max(k for k in T95 if k <= df)] if df <= 30 else 1.96


def rounds_overhead(base: list[float], other: list[float], blocks: int | None = None) -> dict[str, Any]:
    """Across processes: what `other` costs over `base` from rounds of short runs, one of
    each per round (base[i] and other[i] the time per step of round i's runs). Pairing by
    round takes out the host's slow drift; the overhead is the mean difference over the
    mean base time, with its 95% interval (Student's t over the rounds).

    With `blocks`, the rounds are not taken as independent: the interval is Student's t
    over the mean differences of that many blocks of neighbouring rounds (batch means).
    Rounds of turns between processes alive together need it: a process's own speed
    drifts over seconds (on the H200 VM, slow and fast stretches of about ten rounds of
    100 ms turns, each process its own), so neighbouring rounds share their error, and the
    interval over single rounds came out two to three times too narrow (the same code
    against itself differed by up to three of its intervals, bench/oversub.py)."""
    n = len(base)
    if n != len(other) or n < 2:
        return {"rounds": n}
    diffs = [o - b for b, o in zip(base, other)]
    mean_base = statistics.fmean(base)
    k = n if blocks is None else max(2, min(blocks, n))
    means = [statistics.fmean(diffs[i * n // k:(i + 1) * n // k]) for i in range(k)]
    half = t95(k - 1) * statistics.stdev(means) / math.sqrt(k)
    out = {"rounds": n, "overhead_pct": statistics.fmean(diffs) / mean_base * 100, "ci95_pct": half / mean_base * 100}
    if blocks is not None:
        out["blocks"] = k
    return out


def pooled(estimates: list[dict[str, Any]]) -> dict[str, Any]:
    """Independent estimates of one overhead (rounds_overhead's, from separate runs) as one:
    the mean weighted by the inverse of each one's variance (its half interval over 1.96),
    with its 95% interval; estimates without an interval are left out."""
    usable = [e for e in estimates if "overhead_pct" in e and 0 < e["ci95_pct"] < math.inf]
    if not usable:
        return {"runs": 0}
    weights = [(1.96 / e["ci95_pct"]) ** 2 for e in usable]
    mean = sum(w * e["overhead_pct"] for w, e in zip(weights, usable)) / sum(weights)
    return {"runs": len(usable), "overhead_pct": mean, "ci95_pct": 1.96 / math.sqrt(sum(weights))}


def paired_overhead(wins: list[Window]) -> dict[str, Any]:
    """Triplets of neighbouring windows in alternating states (recording, paused,
    recording or the reverse), each window used once, in time order; per triplet the
    difference between the mean step time while recording and that while paused, the
    outer two averaged, so that a drift that is linear over the triplet cancels; the
    overhead is the mean difference over the mean paused step.  "wall" and "cpu" from
    each window's mean step time, "wall_capped" with every step capped at the run's
    CAP_QUANTILE (see above)."""
    steps = sorted(t for w in wins for t in w.walls)
    cap = steps[min(len(steps) - 1, int(len(steps) * CAP_QUANTILE))] if steps else math.inf

    def total(w: Window, what: str) -> float:
        return sum(min(t, cap) for t in w.walls) if what == "capped" else getattr(w, what)

    def diff(a: Window, mid: Window, b: Window, what: str) -> float:
        outer = (total(a, what) / a.steps + total(b, what) / b.steps) / 2
        inner = total(mid, what) / mid.steps
        return inner - outer if not mid.paused else outer - inner

    def estimate(what: str) -> dict[str, float]:
        paused = [w for t in triplets for w in t if w.paused]
        paused_mean = sum(total(w, what) for w in paused) / sum(w.steps for w in paused)
        return _estimate([diff(*t, what) for t in triplets], paused_mean)

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
           "wall": estimate("wall")}
    if all(len(w.walls) == w.steps for t in triplets for w in t):
        out["wall_capped"] = {**estimate("capped"), "quantile": CAP_QUANTILE, "cap_ms": cap * 1e3}
    if all(w.cpu > 0 for t in triplets for w in t):
        out["cpu"] = estimate("cpu")
    return out
