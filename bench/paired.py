"""Recording versus not recording, inside one process: the paired overhead measurement.

Separate runs of a CPU-bound workload on the GPU VM differ by up to 40% from each other
(measured: the same ResNet-50 training at 34 to 53 ms per step, with and without
libgpuos alike), far more than the overhead we must resolve.  Within one run the speed
drifts slowly, so we compare neighbours in time instead: the workload runs once under
`gpuos run` with `--step-log`; a thread here pauses and resumes the recording of its
operations (`gpuos.intercept.ring.set_ops_paused`, what `gpuos trace pause|resume`
does) every `period` seconds; each triplet of neighbouring windows (recording, paused,
recording, or the reverse) gives the ratio of mean step times recording / paused (wall
and CPU), the outer windows averaged so that a steady drift cancels.  The overhead is
the mean of those ratios less one, with its 95% confidence interval.

What this leaves out: being interposed at all (a paused wrapper still loads two words
and calls through) and tracking allocations, which stay on while paused; noop-launch
across processes bounds the first, the second happens outside the steady state.
"""

from __future__ import annotations

import json
import math
import statistics
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpuos.intercept import ring as R


@dataclass
class Switch:
    before: float  # CLOCK_MONOTONIC just before the store
    after: float   # ... and just after it
    paused: bool   # the state from `after` on


@dataclass
class Toggler:
    """Pauses and resumes the process named in `step_log` every `period` seconds until
    stop() (or until it exits)."""

    step_log: Path
    period: float
    switches: list[Switch] = field(default_factory=list)
    error: str | None = None

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> "Toggler":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _pid(self) -> int | None:
        while not self._stop.wait(0.05):
            try:
                first = self.step_log.read_text().split("\n", 1)[0]
                return json.loads(first)["pid"]
            except (OSError, ValueError, KeyError):
                continue
        return None

    def _set(self, pid: int, paused: bool) -> None:
        before = time.monotonic()
        R.set_ops_paused(pid, paused)
        self.switches.append(Switch(before, time.monotonic(), paused))

    def _run(self) -> None:
        pid = self._pid()
        if pid is None:
            return
        while not self._stop.is_set():  # the ring appears at the first CUDA call
            try:
                self._set(pid, False)
                break
            except LookupError:
                self._stop.wait(0.05)
            except (OSError, R.RingError) as exc:
                self.error = f"cannot control process {pid}: {exc}"
                return
        paused = False
        while not self._stop.wait(self.period):
            paused = not paused
            try:
                self._set(pid, paused)
            except (OSError, LookupError):  # it exited
                return


def read_marks(step_log: Path) -> list[tuple[float, float]]:
    """The (time, CPU time) marks a suite run wrote at its end."""
    for line in reversed(step_log.read_text().splitlines()):
        rec = json.loads(line)
        if "marks" in rec:
            return [tuple(m) for m in rec["marks"]]
    raise ValueError(f"{step_log}: no marks (the run did not finish)")


@dataclass
class Window:
    paused: bool
    steps: int = 0
    wall: float = 0.0
    cpu: float = 0.0


def windows(marks: list[tuple[float, float]], switches: list[Switch]) -> list[Window]:
    """The steps that lie wholly inside one state, window by window (a step that spans a
    switch belongs to neither neighbour)."""
    out = [Window(s.paused) for s in switches]
    j = 0
    for (t0, c0), (t1, c1) in zip(marks, marks[1:]):
        while j + 1 < len(switches) and switches[j + 1].before <= t0:
            j += 1
        if j >= len(switches) or t0 < switches[j].after:
            continue
        if j + 1 < len(switches) and t1 > switches[j + 1].before:
            continue
        w = out[j]
        w.steps += 1
        w.wall += t1 - t0
        w.cpu += c1 - c0
    return out


def _ci(ratios: list[float]) -> dict[str, float]:
    mean = statistics.fmean(ratios)
    half = 1.96 * statistics.stdev(ratios) / math.sqrt(len(ratios)) if len(ratios) > 1 else math.inf
    return {"overhead_pct": (mean - 1) * 100, "ci95_pct": half * 100,
            "median_pct": (statistics.median(ratios) - 1) * 100}


def paired_overhead(wins: list[Window], min_steps: int = 2) -> dict[str, Any]:
    """Triplets of neighbouring windows in alternating states (recording, paused,
    recording or the reverse), each window used once, in time order; per triplet the
    ratio of the mean step time while recording to that while paused, the outer two
    averaged, so that a drift that is linear over the triplet cancels.  Windows with
    fewer than min_steps steps are dropped and break the sequence there."""
    def mean(w: Window, what: str) -> float:
        return getattr(w, what) / w.steps

    def ratio(a: Window, mid: Window, b: Window, what: str) -> float:
        outer = (mean(a, what) + mean(b, what)) / 2
        return mean(mid, what) / outer if not mid.paused else outer / mean(mid, what)

    triplets = []
    i = 1
    while i + 1 < len(wins):
        a, mid, b = wins[i - 1], wins[i], wins[i + 1]
        if (min(a.steps, mid.steps, b.steps) >= min_steps and a.paused == b.paused != mid.paused):
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
