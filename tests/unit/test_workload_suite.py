"""gpuos.workloads.suite without a GPU: the step log's marks and the recording switch
that the paired benchmark flips between steps (--toggle-recording)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from gpuos.workloads import suite


class FakeSwitch:
    """Stands in for gpuos.intercept.ring.OpsPause (a real one needs a libgpuos ring:
    test_libgpuos.py flips a real one through `gpuos trace pause|resume`)."""

    def __init__(self):
        self.states: list[bool] = []
        self.closed = False

    def set(self, paused: bool) -> bool:
        self.states.append(paused)
        return False

    def close(self) -> None:
        self.closed = True


def test_marks_switch_between_steps_every_k(monkeypatch):
    switch = FakeSwitch()
    monkeypatch.setattr(suite.StepMarks, "_open", staticmethod(lambda: switch))
    marks = suite.StepMarks(toggle_every=2)
    for _ in range(7):  # the start and after each of 6 steps
        marks.mark()
    rows = marks.finish()
    # steps 0-1 recorded, 2-3 paused, 4-5 recorded; the last mark starts no step
    assert [paused for _, _, paused in rows] == [False, False, True, True, False, False, True]
    assert switch.states == [False, True, False, True, False] and switch.closed  # resumed at the end
    times = [t for t, _, _ in rows]
    assert times == sorted(times)


def test_marks_without_toggling_touch_no_switch(monkeypatch):
    monkeypatch.setattr(suite.StepMarks, "_open", staticmethod(lambda: pytest.fail("opened a switch")))
    marks = suite.StepMarks()
    marks.mark()
    marks.mark()
    assert [paused for _, _, paused in marks.finish()] == [False, False]


def test_toggling_outside_gpuos_run_is_a_clear_error():
    # in a fresh process: this one may hold a ring of its own (other tests write rings)
    code = ("from gpuos.workloads import suite\n"
            "try:\n    suite.StepMarks(toggle_every=1).mark()\n"
            "except suite.ToggleError as e:\n    print(e)\n    raise SystemExit(3)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 3, r.stderr
    assert "needs this process to run under `gpuos run`" in r.stdout


@pytest.mark.parametrize("args", [["--toggle-recording", "1"],
                                  ["--toggle-recording", "-1", "--step-log", "x"]])
def test_toggle_recording_wants_a_step_log_and_a_positive_k(args, capsys):
    with pytest.raises(SystemExit) as exc:
        suite.parse(["resnet50-train", *args])
    assert exc.value.code == 2
    assert "--toggle-recording K wants K >= 1 and --step-log" in capsys.readouterr().err


def test_the_timed_steps_begin_when_the_gate_opens(tmp_path):
    """--start-gate: ready-PID is there once the warmup is done, and no step is timed
    before DIR/go appears."""
    steps: list[float] = []
    opened: list[float] = []

    def opener() -> None:
        while not (tmp_path / f"ready-{os.getpid()}").exists():
            time.sleep(0.005)
        time.sleep(0.2)
        opened.append(time.monotonic())
        (tmp_path / "go").touch()

    t = threading.Thread(target=opener)
    t.start()
    seconds, _, out = suite.timed(lambda: steps.append(time.monotonic()) or len(steps), 2, 3,
                                  lambda: None, gate=str(tmp_path))
    t.join()
    assert out == [3, 4, 5] and len(steps) == 5
    assert steps[1] < opened[0] <= steps[2]  # the warmup before, every timed step after
    assert seconds < 0.2


def test_a_gate_that_stays_shut_times_the_steps_anyway(tmp_path, capsys):
    assert suite.wait_at_gate(str(tmp_path), timeout_s=0.05) is False
    assert "did not appear within" in capsys.readouterr().err
    assert suite.wait_at_gate(None) is True


def test_processes_in_turns_run_k_steps_each_in_the_order_given(tmp_path):
    """--turns: two members (threads here) run their steps in turns of 2, in the order
    DIR/order lists, once DIR/turn says 0; each one's seconds are its turns' windows."""
    order: list[str] = []
    got: dict = {}

    def member(name: str, index: int) -> None:
        turns = suite.Turns(str(tmp_path), index, 2, 2, timeout_s=10)
        seconds, _, out = suite.timed(lambda: order.append(name) or time.sleep(0.01), 1, 6, lambda: None,
                                      turns=turns)
        got[name] = (seconds, turns.windows)

    threads = [threading.Thread(target=member, args=(n, i)) for i, n in enumerate("ab")]
    for t in threads:
        t.start()
    while len(list(tmp_path.glob("ready-*"))) < 2:
        time.sleep(0.005)
    assert order == ["a", "b"]  # the warmups: nothing timed before the turns begin
    (tmp_path / "order").write_text("0 1 1 0 0 1")
    (tmp_path / "turn").write_text("0")
    for t in threads:
        t.join()
    assert order[2:] == list("aabbbbaaaabb")
    for name in "ab":
        seconds, windows = got[name]
        assert len(windows) == 3 and seconds == pytest.approx(sum(e - s for s, e in windows))
        assert 0.015 < seconds / 3 < 0.2
    assert got["a"][1][0][1] <= got["b"][1][0][0]  # b's first turn after a's


def test_a_turn_that_does_not_come_is_an_error(tmp_path):
    turns = suite.Turns(str(tmp_path), 1, 2, 1, timeout_s=0.05)
    (tmp_path / "order").write_text("0 1")
    (tmp_path / "turn").write_text("0")
    with pytest.raises(suite.TurnError, match="did not come within"):
        turns.wait()
    (tmp_path / "abort").touch()
    turns.timeout_s = 10
    t0 = time.monotonic()
    with pytest.raises(suite.TurnError, match="the ring was ended"):
        turns.wait()
    assert time.monotonic() - t0 < 1


@pytest.mark.parametrize("args", [["--turns", "D", "0", "2", "7"],  # 20 steps, not a multiple of 7
                                  ["--turns", "D", "2", "2", "1"],  # index out of the ring
                                  ["--turns", "D", "0", "x", "1"],
                                  ["--turns", "D", "0", "2", "1", "--start-gate", "D"],
                                  ["--turns", "missing", "0", "2", "1"]])
def test_turns_arguments_are_checked(args, tmp_path, capsys):
    args = [str(tmp_path) if x == "D" else x for x in args]
    with pytest.raises(SystemExit) as exc:
        suite.parse(["resnet50-train", *args])
    assert exc.value.code == 2 and "--turns" in capsys.readouterr().err


def test_noop_launch_cannot_take_turns(tmp_path, capsys):
    with pytest.raises(SystemExit):
        suite.parse(["noop-launch", "--turns", str(tmp_path), "0", "2", "1000"])
    assert "not noop-launch" in capsys.readouterr().err
    a = suite.parse(["resnet50-train", "--turns", str(tmp_path), "1", "3", "5"])
    assert (a.turns.index, a.turns.count, a.turns.steps) == (1, 3, 5)
