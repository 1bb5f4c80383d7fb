"""bench/paired.py: steps assigned to recording and paused windows, and the paired
overhead with its interval, from made-up step logs (the real ones need a GPU)."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import paired  # noqa: E402
from paired import Switch, Window  # noqa: E402


def simulate(seed: int, overhead: float, drift: float, steps: int = 4000, period: float = 0.5):
    """Steps of 10 ms (CPU time the same) under a host whose speed drifts by up to `drift`
    over the run, `overhead` slower while recording, switching every `period` s."""
    rng = random.Random(seed)
    switches, marks, t, c, paused = [Switch(0.0, 0.001, False)], [(0.0, 0.0)], 0.0, 0.0, False
    next_switch = period
    for k in range(steps):
        speed = 1 + drift * (k / steps)  # slow drift: the run gets slower
        dt = 0.010 * speed * (1 + (0 if paused else overhead)) * (1 + rng.gauss(0, 0.03))
        t, c = t + dt, c + dt * 0.98
        marks.append((t, c))
        if t >= next_switch:
            paused = not paused
            switches.append(Switch(t + 0.0001, t + 0.0002, paused))
            next_switch = t + period
    return marks, switches


def test_steps_spanning_a_switch_belong_to_no_window():
    sw = [Switch(0.0, 0.1, False), Switch(1.0, 1.1, True)]
    marks = [(0.05, 0), (0.2, 0.1), (0.5, 0.3), (1.05, 0.6), (1.2, 0.7), (1.4, 0.8)]
    wins = paired.windows(marks, sw)
    # (0.05, 0.2) starts before the first switch is complete; (0.5, 1.05) spans the second
    assert [(w.paused, w.steps) for w in wins] == [(False, 1), (True, 1)]
    assert wins[0].wall == pytest.approx(0.3) and wins[1].cpu == pytest.approx(0.1)


@pytest.mark.parametrize("overhead", [0.0, 0.01, 0.05])
def test_the_paired_estimate_finds_the_overhead_under_drift(overhead):
    marks, sw = simulate(seed=7, overhead=overhead, drift=0.4)
    p = paired.paired_overhead(paired.windows(marks, sw))
    assert p["triplets"] > 30
    for k in ("wall", "cpu"):
        est, ci = p[k]["overhead_pct"], p[k]["ci95_pct"]
        assert abs(est - overhead * 100) <= max(ci, 0.3), (k, est, ci)
        assert ci < 1.0
    # and with the drift the other way
    marks2, sw2 = simulate(seed=8, overhead=overhead, drift=-0.3)
    p2 = paired.paired_overhead(paired.windows(marks2, sw2))
    assert abs(p2["wall"]["overhead_pct"] - overhead * 100) <= max(p2["wall"]["ci95_pct"], 0.3)


def test_short_windows_break_the_sequence():
    wins = [Window(False, 5, 0.05, 0.05), Window(True, 1, 0.01, 0.01), Window(False, 5, 0.06, 0.06),
            Window(True, 5, 0.05, 0.05), Window(False, 5, 0.07, 0.07)]
    p = paired.paired_overhead(wins)
    # only (2, 3, 4): recording 12 and 14 ms around paused 10 ms
    assert p["triplets"] == 1 and p["wall"]["overhead_pct"] == pytest.approx(30.0)
    assert paired.paired_overhead(wins[:3]) == {"triplets": 0}


def test_read_marks_wants_a_finished_run(tmp_path):
    log = tmp_path / "steps.jsonl"
    log.write_text(json.dumps({"pid": 5}) + "\n")
    with pytest.raises(ValueError):
        paired.read_marks(log)
    log.write_text(log.read_text() + json.dumps({"marks": [[1.0, 0.5], [2.0, 1.5]]}) + "\n")
    assert paired.read_marks(log) == [(1.0, 0.5), (2.0, 1.5)]
