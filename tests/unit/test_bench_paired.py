"""bench/paired.py: steps grouped into recording and paused windows, and the paired
overhead with its interval, from made-up step logs (the real ones need a GPU)."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import paired  # noqa: E402
from paired import Window  # noqa: E402


def simulate(seed: int, overhead: float, drift: float, steps: int = 4000, every: int = 1,
             wander: float = 0.0, stalls: float = 0.0):
    """Marks of steps of 10 ms (CPU time 98% of it) under a host whose speed drifts by up
    to `drift` over the run and wanders slowly (a random walk pulled back to 1, each
    step's factor `wander`), `overhead` slower while recording, which is paused and
    resumed every `every` steps, as `suite.py --toggle-recording` does; a fraction
    `stalls` of the steps, at random, take 1.5 to 3 times as long."""
    rng = random.Random(seed)
    marks, t, c, paused, slow = [], 0.0, 0.0, False, 1.0
    for k in range(steps):
        if k and k % every == 0:
            paused = not paused
        marks.append((t, c, paused))
        slow = 1 + 0.9 * (slow - 1) + rng.gauss(0, wander)
        speed = (1 + drift * (k / steps)) * slow
        dt = 0.010 * speed * (1 + (0 if paused else overhead)) * (1 + rng.gauss(0, 0.03))
        if rng.random() < stalls:
            dt *= rng.uniform(1.5, 3)
        t, c = t + dt, c + dt * 0.98
    marks.append((t, c, paused))
    return marks


def test_windows_are_runs_of_steps_in_one_state():
    marks = [(0.0, 0.0, False), (0.1, 0.05, False), (0.3, 0.1, True), (0.4, 0.2, True),
             (0.6, 0.25, False), (0.9, 0.3, True)]
    wins = paired.windows(marks)
    # step i runs from mark i to i + 1 in the state mark i gives; the last mark's is unused
    assert [(w.paused, w.steps) for w in wins] == [(False, 2), (True, 2), (False, 1)]
    assert wins[0].wall == pytest.approx(0.3) and wins[1].cpu == pytest.approx(0.15)
    assert wins[2].wall == pytest.approx(0.3)


@pytest.mark.parametrize("every", [1, 5])
@pytest.mark.parametrize("overhead", [0.0, 0.01, 0.05])
def test_the_paired_estimate_finds_the_overhead_under_drift(overhead, every):
    p = paired.paired_overhead(paired.windows(simulate(seed=7, overhead=overhead, drift=0.4, every=every)))
    assert p["triplets"] > 200
    for k in ("wall", "cpu"):
        est, ci = p[k]["overhead_pct"], p[k]["ci95_pct"]
        assert abs(est - overhead * 100) <= max(ci, 0.3), (k, est, ci)
        assert ci < 1.0
    # and with the drift the other way
    p2 = paired.paired_overhead(paired.windows(simulate(seed=8, overhead=overhead, drift=-0.3, every=every)))
    assert abs(p2["wall"]["overhead_pct"] - overhead * 100) <= max(p2["wall"]["ci95_pct"], 0.3)


def test_switching_every_step_beats_slow_wander():
    """A host whose speed wanders over tens of steps (as measured on the VM): windows of one
    step cancel it far better than windows of ten."""
    ci = {}
    for every in (1, 10):
        p = paired.paired_overhead(paired.windows(simulate(seed=3, overhead=0.02, drift=0.0, every=every,
                                                           wander=0.03)))
        assert abs(p["wall"]["overhead_pct"] - 2.0) <= max(p["wall"]["ci95_pct"], 0.3)
        ci[every] = p["wall"]["ci95_pct"]
    assert ci[1] < ci[10] / 1.5, ci


@pytest.mark.parametrize("overhead", [0.0, 0.02])
def test_capping_steps_tames_random_stalls(overhead):
    """Stalls that come recording or not, as on the VM: the capped estimate still finds the
    overhead, with a much narrower interval than the plain mean."""
    p = paired.paired_overhead(paired.windows(simulate(seed=11, overhead=overhead, drift=0.2, stalls=0.05)))
    mean, capped = p["wall"], p["wall_capped"]
    assert capped["quantile"] == paired.CAP_QUANTILE and capped["cap_ms"] > 10
    for est in (mean, capped):
        assert abs(est["overhead_pct"] - overhead * 100) <= max(est["ci95_pct"], 0.3), est
    assert capped["ci95_pct"] < mean["ci95_pct"] / 1.5


def test_a_triplet_needs_three_windows():
    wins = [Window(False, 5, 0.06, 0.06), Window(True, 5, 0.05, 0.05), Window(False, 5, 0.07, 0.07)]
    p = paired.paired_overhead(wins)
    # recording 12 and 14 ms around paused 10 ms
    assert p["triplets"] == 1 and p["wall"]["overhead_pct"] == pytest.approx(30.0)
    assert p["steps"] == {"recording": 10, "paused": 5}
    assert "wall_capped" not in p  # these windows carry no step times
    assert paired.paired_overhead(wins[:2]) == {"triplets": 0}


def test_read_marks_wants_a_finished_run(tmp_path):
    log = tmp_path / "steps.jsonl"
    log.write_text(json.dumps({"pid": 5}) + "\n")
    with pytest.raises(ValueError):
        paired.read_marks(log)
    log.write_text(log.read_text() + json.dumps({"marks": [[1.0, 0.5, False], [2.0, 1.5, True]]}) + "\n")
    assert paired.read_marks(log) == [(1.0, 0.5, False), (2.0, 1.5, True)]


def test_the_kept_step_times_give_the_same_estimate():
    """The JSON keeps each step's times; the table is estimated from them again."""
    marks = simulate(seed=5, overhead=0.02, drift=0.1, steps=600)
    direct = paired.paired_overhead(paired.windows(marks))
    again = paired.paired_overhead(paired.windows(paired.marks_from({"step_times": paired.step_times(marks)})))
    for k in ("wall", "wall_capped", "cpu"):
        assert again[k]["overhead_pct"] == pytest.approx(direct[k]["overhead_pct"], abs=0.01)
    # the first results kept signed wall times only: no CPU estimate from them
    signed = [-w if p else w for w, _, p in paired.step_times(marks)]
    walls_only = paired.paired_overhead(paired.windows(paired.marks_from({"step_ms": signed})))
    assert walls_only["wall"]["overhead_pct"] == pytest.approx(direct["wall"]["overhead_pct"], abs=0.01)
    assert "cpu" not in walls_only
    assert paired.marks_from({"wall": {}}) is None
