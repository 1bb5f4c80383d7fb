"""Bundled workloads (torchjob.py runs as a script, in its own process) and their logs.

A torchjob log line is ``<step> <what> <value> [t <unix time>]``; the time
differs between runs, the rest must not.
"""

from __future__ import annotations

from pathlib import Path

TORCHJOB = Path(__file__).with_name("torchjob.py")


def results(log: Path) -> list[str]:
    """The lines that must be identical between runs (times stripped)."""
    out = []
    for line in log.read_text().splitlines():
        out.append(line.split(" t ", 1)[0])
    return out


def step_times(log: Path) -> dict[int, float]:
    """step -> unix time at which the step finished."""
    times = {}
    for line in log.read_text().splitlines():
        head, sep, t = line.partition(" t ")
        if sep:
            times[int(head.split()[0])] = float(t)
    return times


def steps_done(log: Path) -> int:
    try:
        return sum(1 for line in log.read_text().splitlines() if " t " in line)
    except FileNotFoundError:
        return 0
