"""Any process a user points at checkpoints and restores, however it was started (real criu).

A shell's background job (not a session leader), nohup, setsid, a supervisor's child
(session leader without a terminal), a session leader whose controlling terminal is a
pty, and a shell job on a pty: each counter is checkpointed, killed, restored and must
go on counting without a gap. A terminal that is gone at restore is refused before
anything is restored, and --tty names another.
"""

from __future__ import annotations

import fcntl
import json
import os
import pty
import subprocess
import sys
import termios
from dataclasses import dataclass
from pathlib import Path

import pytest

from gpuos import procs

from helpers import (COUNTER, Processes, assert_consecutive, counted, gpuos, gpuos_env,
                     gpuos_json, journals, wait_for)

pytestmark = pytest.mark.criu


@dataclass
class Started:
    pid: int
    log: Path
    tty: str | None  # the pty it has open, if any
    parent: subprocess.Popen


def _take_ctty() -> None:
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


def launch(style: str, processes: Processes, tmp: Path, slave: int | None = None) -> Started:
    script = tmp / "counter.py"
    script.write_text(COUNTER)
    log = tmp / f"{style}.log"
    pidfile = tmp / f"{style}.pid"
    counter = f"{sys.executable} {script} {log} 0 0"
    quiet = "</dev/null >/dev/null 2>&1"
    shell = {
        "shell-background": f"{counter} {quiet} & echo $! > {pidfile}; wait",
        "nohup": f"nohup {counter} {quiet} & echo $! > {pidfile}; wait",
        "setsid": f"setsid {counter} {quiet} & echo $! > {pidfile}; wait",
        "terminal-shell-job": f"{counter} & echo $! > {pidfile}; wait",
    }
    tty = None
    if style == "supervisor-child":  # what systemd or a container runtime starts: own session, no tty
        parent = processes.start(counter.split(), "counter")
        pid = parent.pid
    elif style.startswith("terminal"):
        tty = os.ttyname(slave)
        argv = (["sh", "-c", shell[style]] if style == "terminal-shell-job" else counter.split())
        parent = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave,
                                  start_new_session=True, preexec_fn=_take_ctty)
        processes.children.append(parent)
        pid = parent.pid
    else:
        parent = processes.start(["sh", "-c", shell[style]], style)
    if style in shell:
        pid = int(wait_for(lambda: pidfile.exists() and pidfile.read_text().strip(),
                           what="the counter's pid"))
    wait_for(lambda: len(counted(log)) >= 5, what=f"{log} to grow")
    processes.adopt(pid, str(script))
    return Started(pid=pid, log=log, tty=tty, parent=parent)


def reaped(s: Started) -> None:
    """Wait until the dumped counter is gone (its parent reaps it)."""
    if s.parent.pid == s.pid:
        s.parent.wait(timeout=10)
    wait_for(lambda: not procs.alive(s.pid), what=f"pid {s.pid} to be gone")


def keeps_counting(log: Path) -> None:
    start = len(counted(log))
    wait_for(lambda: len(counted(log)) >= start + 20, what=f"{log} to keep growing")
    assert_consecutive(counted(log))


@pytest.fixture
def env(criu_bin, home):
    return gpuos_env(home.home, criu=criu_bin)


@pytest.fixture
def pty_pair():
    master, slave = pty.openpty()
    yield master, slave
    for fd in (master, slave):
        try:
            os.close(fd)
        except OSError:
            pass


# A shell's job on a terminal is restored from a shell on a terminal: its own test below.
STYLES = ["shell-background", "nohup", "setsid", "supervisor-child", "terminal-session-leader"]


@pytest.mark.parametrize("style", STYLES)
def test_checkpoint_kill_restore_however_started(style, env, home, processes, tmp_path, pty_pair):
    s = launch(style, processes, tmp_path, pty_pair[1])
    st = procs.stat(s.pid)
    assert (st.session == s.pid) == (style in ("setsid", "supervisor-child", "terminal-session-leader"))
    assert bool(st.tty_nr) == style.startswith("terminal")

    code, out = gpuos_json(env, "checkpoint", str(s.pid), "--image", style)
    assert code == 0, out
    reaped(s)
    at_dump = counted(s.log)
    code, res = gpuos_json(env, "restore", style)
    assert code == 0, res
    assert res["pid"] == s.pid
    keeps_counting(s.log)
    assert counted(s.log)[: len(at_dump)] == at_dump
    after = procs.stat(s.pid)
    assert after.state != "T"
    # Restored into a session of its own, never into gpuos's caller's (a ^C there).
    assert after.session != os.getsid(0) and os.getpgid(s.pid) != os.getpgrp()
    if s.tty:
        assert os.readlink(f"/proc/{s.pid}/fd/1") == s.tty
    assert journals(home.run) == []


def test_leave_running_shell_job(env, processes, tmp_path):
    s = launch("shell-background", processes, tmp_path)
    code, out = gpuos_json(env, "checkpoint", str(s.pid), "--image", "live", "--leave-running")
    assert code == 0, out
    assert procs.stat(s.pid).state != "T" and procs.stat(s.pid).ppid == s.parent.pid
    keeps_counting(s.log)


def test_terminal_gone_is_refused_before_restoring_and_tty_names_another(
        env, home, processes, tmp_path, pty_pair):
    s = launch("terminal-session-leader", processes, tmp_path, pty_pair[1])
    code, out = gpuos_json(env, "checkpoint", str(s.pid), "--image", "tty")
    assert code == 0, out
    reaped(s)
    other_master, other_slave = pty.openpty()  # opened first: it cannot take the old number
    try:
        other = os.ttyname(other_slave)
        for fd in pty_pair:
            os.close(fd)
        wait_for(lambda: not os.path.exists(s.tty) or os.stat(s.tty).st_rdev != os.stat(other).st_rdev,
                 what=f"{s.tty} to go")
        at_dump = counted(s.log)
        res = gpuos(env, "restore", "tty")
        assert res.returncode == 15, (res.stdout, res.stderr)
        line = res.stderr.strip().splitlines()[-1]
        assert f"terminal {s.tty}" in line and "--tty" in line and "nothing was restored" in line
        assert not procs.exists(s.pid) and counted(s.log) == at_dump and journals(home.run) == []

        res = gpuos(env, "restore", "tty", "--tty", "/dev/null")
        assert res.returncode == 15 and "not a terminal" in res.stderr

        code, out = gpuos_json(env, "restore", "tty", "--tty", other)
        assert code == 0, out
        keeps_counting(s.log)
        assert os.readlink(f"/proc/{s.pid}/fd/1") == other
    finally:
        os.close(other_master)
        os.close(other_slave)


def test_terminal_shell_job_comes_back_as_a_job_of_the_restoring_terminals_shell(
        env, home, processes, tmp_path, pty_pair):
    """A shell's job on a terminal (the session leader, the shell, stays outside the tree):
    restored by `gpuos restore` run from a shell on a terminal, it joins that terminal's
    session, as criu's shell-job restore does. Run from no terminal, it is refused before
    anything is restored."""
    master, slave = pty_pair
    s = launch("terminal-shell-job", processes, tmp_path, slave)
    st = procs.stat(s.pid)
    assert st.session == s.parent.pid != s.pid and st.tty_nr
    code, out = gpuos_json(env, "checkpoint", str(s.pid), "--image", "job")
    assert code == 0, out
    reaped(s)
    at_dump = counted(s.log)

    res = gpuos(env, "restore", "job")  # from pytest: no controlling terminal
    assert res.returncode == 15, (res.stdout, res.stderr)
    assert "run `gpuos restore` from a terminal" in res.stderr and "nothing was restored" in res.stderr
    assert not procs.exists(s.pid) and counted(s.log) == at_dump

    # What a user does: in a shell on that terminal, `sudo gpuos restore job`.
    done = tmp_path / "restore.json"
    shell = subprocess.Popen(
        ["sh", "-c", f"{sys.executable} -m gpuos.cli restore job --json > {done}; sleep 60"],
        stdin=slave, stdout=slave, stderr=slave, env=env, start_new_session=True,
        preexec_fn=_take_ctty)
    processes.children.append(shell)
    wait_for(lambda: done.exists() and done.read_text().strip().endswith("}"), timeout=60,
             what="gpuos restore in the terminal")
    res = json.loads(done.read_text())
    assert res["ok"] and res["pid"] == s.pid, res
    keeps_counting(s.log)
    assert counted(s.log)[: len(at_dump)] == at_dump
    after = procs.stat(s.pid)
    assert after.session == shell.pid and after.tty_nr == st.tty_nr and after.state != "T"
    assert os.readlink(f"/proc/{s.pid}/fd/1") == s.tty
