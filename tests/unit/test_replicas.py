"""`gpuos restore --replicas N`: N copies of one image, each in pid, network and mount
namespaces of its own, with the real criu (and, for movable GPU memory, the real libgpuos
and agent on the fake driver).  Skipped without root or a working criu."""

from __future__ import annotations

import collections
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from gpuos import procs

from helpers import GHOST_HOLDER, counted, gpuos, gpuos_env, gpuos_json, hidden_entries, journals, wait_for

pytestmark = pytest.mark.criu


def net_ns(pid: int) -> int:
    return os.stat(f"/proc/{pid}/ns/net").st_ino


def copies_after(log: Path, start: int) -> dict[int, int]:
    """How many times each number from ``start`` on was written to the shared log."""
    return collections.Counter(n for n in counted(log) if n >= start)


@pytest.fixture
def env(criu_bin, home):
    return gpuos_env(home.home, criu=criu_bin)


@pytest.fixture
def replicas_left():
    """Pid 1 of every replica a test started: ended at teardown, if still there."""
    inits: list[int] = []
    yield inits
    for pid in inits:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_three_replicas_each_continue_in_namespaces_of_their_own(env, home, store, processes, tmp_path,
                                                                 replicas_left):
    log = tmp_path / "count.log"
    proc = processes.counter(log)
    pid = proc.pid
    code, out = gpuos_json(env, "checkpoint", str(pid), "--image", "job")
    assert code == 0, out
    proc.wait(timeout=10)
    at_dump = len(counted(log))

    code, res = gpuos_json(env, "restore", "job", "--replicas", "3")
    assert code == 0, res
    reps = res["replicas"]
    replicas_left.extend(r["init"] for r in reps)
    assert len(reps) == 3 and res["pid"] == reps[0]["pid"]
    ours = net_ns(os.getpid())
    roots = [r["pid"] for r in reps]
    assert len(set(roots)) == 3 and len({r["init"] for r in reps}) == 3
    for r in reps:
        assert r["pids"] == {str(pid): r["pid"]}
        assert procs.own_pid(r["pid"]) == pid  # the image's pid, in its own namespace
        assert procs.ns_pids(r["init"])[-1] == 1  # under a pid 1 of its own
        assert procs.stat(r["pid"]).ppid == r["init"]
        assert net_ns(r["pid"]) != ours
    assert len({net_ns(r["pid"]) for r in reps}) == 3

    # Every copy goes on from where the image was: each number after it three times.
    wait_for(lambda: sum(1 for c in copies_after(log, at_dump).values() if c == 3) >= 20,
             what="three copies to count on")
    seen = copies_after(log, at_dump)
    settled = [n for n in range(at_dump, at_dump + 20)]
    assert all(seen[n] == 3 for n in settled), seen
    assert counted(log)[:at_dump] == list(range(at_dump))

    # Ending one replica's pid 1 ends that copy only.
    os.kill(reps[0]["init"], signal.SIGKILL)
    wait_for(lambda: not procs.alive(reps[0]["pid"]), what="the first replica to end")
    assert procs.alive(reps[1]["pid"]) and procs.alive(reps[2]["pid"])
    n = len(counted(log))
    wait_for(lambda: len(counted(log)) > n + 10, what="the other two to count on")

    assert journals(home.run) == [] and hidden_entries(store.root) == []
    assert not list(home.run.glob("restore-*"))

    # A replica cannot be checkpointed (CRIU dumps a pid namespace only whole): said up
    # front, and it runs on untouched.
    res = gpuos(env, "checkpoint", str(reps[1]["pid"]), "--image", "of-a-replica", "--leave-running")
    assert res.returncode == 8 and "pid namespace of its own" in res.stderr and "nothing was changed" in res.stderr
    n = len(counted(log))
    wait_for(lambda: len(counted(log)) > n + 10, what="the replicas to count on")

    # The image restores again, as replicas or alone, while these run.
    for r in reps[1:]:
        os.kill(r["init"], signal.SIGKILL)
    code, res = gpuos_json(env, "restore", "job", "--replicas", "1")
    assert code == 0, res
    replicas_left.append(res["replicas"][0]["init"])


def test_bad_replica_counts_are_refused(env, home, store, processes, tmp_path):
    log = tmp_path / "count.log"
    proc = processes.counter(log)
    code, out = gpuos_json(env, "checkpoint", str(proc.pid), "--image", "job")
    assert code == 0, out
    proc.wait(timeout=10)
    for n in ("0", "-1", "257", "x"):
        res = gpuos(env, "restore", "job", "--replicas", n)
        assert res.returncode == 2, (n, res.stderr)
        assert "--replicas" in res.stderr


def test_replicas_of_a_process_holding_a_deleted_file_all_restore(env, home, store, processes, tmp_path,
                                                                  replicas_left):
    """CRIU recreates a deleted open file under one fixed name for each restore: the
    replicas of such an image must not race for it."""
    script, log = tmp_path / "ghost.py", tmp_path / "count.log"
    script.write_text(GHOST_HOLDER)
    proc = processes.start([sys.executable, str(script), str(log), str(tmp_path / "held.tmp")], "ghost")
    wait_for(lambda: len(counted(log)) >= 5, what="the ghost holder to count")
    code, out = gpuos_json(env, "checkpoint", str(proc.pid), "--image", "ghost")
    assert code == 0, out
    proc.wait(timeout=10)
    at_dump = len(counted(log))
    assert list((tmp_path).glob("held.tmp*")) == []
    code, res = gpuos_json(env, "restore", "ghost", "--replicas", "3")
    assert code == 0, res
    replicas_left.extend(r["init"] for r in res["replicas"])
    wait_for(lambda: sum(1 for c in copies_after(log, at_dump).values() if c == 3) >= 10,
             what="three copies to count on")
    assert list((tmp_path).glob("held.tmp*")) == []  # no ghost left behind
