"""SIGKILL `gpuos checkpoint` at the start of each phase; nothing may be lost.

gpuos stops at the named phase when GPUOS_TEST_HOLD_AT is set (journal.py),
after journaling it and before starting it.  For a process without CUDA the
phases are criu-dump, store and publish.  After the kill the previous image
of that name must be intact; after `gpuos recover` either the process still
runs (killed before the dump) or, once the dump had completed (and the dump
killed the process), the new image is published, verifies, and restores.
Skipped without root or a working criu.
"""

from __future__ import annotations

import os
import signal
import subprocess

import pytest

from gpuos import procs
from gpuos.store import ImageStore

from helpers import (GPUOS, assert_consecutive, counted, gpuos, gpuos_env, gpuos_json,
                     hidden_entries, journals, tree_digest, wait_for)

pytestmark = pytest.mark.criu


@pytest.mark.parametrize("phase", ["criu-dump", "store", "publish"])
def test_kill_at_phase_then_recover(phase, criu_bin, home, store, processes, tmp_path):
    env = gpuos_env(home.home, criu=criu_bin)
    log = tmp_path / "count.log"
    proc = processes.counter(log)
    pid, cmdline = proc.pid, procs.cmdline(proc.pid)
    code, out = gpuos_json(env, "checkpoint", str(pid), "--image", "job", "--leave-running")
    assert code == 0, out
    final = store.root / "job"
    previous = tree_digest(final)

    hold = tmp_path / "held"
    with open(tmp_path / "gpuos.err", "w") as err:
        victim = subprocess.Popen(
            [*GPUOS, "checkpoint", str(pid), "--image", "job"], stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=err, start_new_session=True,
            env=gpuos_env(home.home, criu=criu_bin, GPUOS_TEST_HOLD_AT=phase,
                          GPUOS_TEST_HOLD_FILE=str(hold)))
    processes.children.append(victim)
    wait_for(lambda: hold.exists() or victim.poll() is not None, what=f"gpuos to reach {phase}")
    assert victim.poll() is None, (tmp_path / "gpuos.err").read_text()
    assert hold.read_text().split() == [str(victim.pid), phase]
    victim.send_signal(signal.SIGKILL)
    victim.wait(timeout=10)

    dumped = phase != "criu-dump"
    if dumped:
        assert proc.wait(timeout=10) == -9  # the dump had completed and killed it
    else:
        assert proc.poll() is None
    # Killed mid-operation: the previous image is untouched; the new one only staged.
    assert tree_digest(final) == previous
    assert len(journals(home.run)) == 1
    assert len(hidden_entries(store.root)) == 1

    code, rec = gpuos_json(env, "recover")
    assert code == 0 and rec["ok"] is True, rec
    actions = " | ".join(a["action"] for a in rec["actions"])
    assert journals(home.run) == [] and hidden_entries(store.root) == []

    if not dumped:
        assert "deleted incomplete image" in actions
        assert tree_digest(final) == previous
        assert proc.poll() is None
        n = len(counted(log))
        wait_for(lambda: len(counted(log)) > n + 10, what="the process to keep counting")
        assert_consecutive(counted(log))
        return

    assert "published" in actions
    assert tree_digest(final) != previous
    m = ImageStore.load(final)
    assert m.leave_running is False and m.root_pid == pid
    assert gpuos(env, "images", "verify", "job").returncode == 0
    at_dump = counted(log)
    assert_consecutive(at_dump)

    code, res = gpuos_json(env, "restore", "job")
    assert code == 0, res
    processes.adopt(res["pid"], cmdline[1])
    assert res["pid"] == pid and procs.cmdline(pid) == cmdline
    wait_for(lambda: len(counted(log)) > len(at_dump) + 10, what="the restored process to count")
    after = counted(log)
    assert_consecutive(after)
    assert after[: len(at_dump)] == at_dump


def test_kill_during_the_criu_dump_itself(criu_bin, home, store, processes, tmp_path):
    """Not at a phase boundary: gpuos is killed while criu is writing the process's pages
    (the process seized and infected).  criu must die with gpuos (PR_SET_PDEATHSIG) and the
    process must go on, unharmed: it still counts, and checkpoints and restores again."""
    env = gpuos_env(home.home, criu=criu_bin)
    log = tmp_path / "count.log"
    proc = processes.counter(log, mb=256)  # a dump long enough to be caught in the middle
    pid, cmdline = proc.pid, procs.cmdline(proc.pid)

    victim = subprocess.Popen([*GPUOS, "checkpoint", str(pid), "--image", "job"], env=env,
                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, start_new_session=True)
    processes.children.append(victim)

    def writing_pages():
        for dump_log in store.root.glob(".job.staging-*/criu/dump.log"):
            if "page-xfer: Transferring pages" in dump_log.read_text(errors="replace"):
                return dump_log
        return None
    dump_log = wait_for(lambda: writing_pages() or victim.poll() is not None,
                        what="criu to write pages", step=0.002)
    criu_pids = procs.children(victim.pid)
    victim.send_signal(signal.SIGKILL)
    victim.wait(timeout=10)
    assert dump_log is not True, "gpuos exited before criu wrote pages"
    assert criu_pids, "no criu running under gpuos"
    if "Dumping finished successfully" in dump_log.read_text(errors="replace"):
        pytest.skip("the dump finished before gpuos could be killed (too fast a host)")
    wait_for(lambda: not any(procs.alive(c) for c in criu_pids), what="criu to die with gpuos")

    assert proc.poll() is None
    n = len(counted(log))
    wait_for(lambda: len(counted(log)) > n + 10, what="the process to keep counting")
    assert_consecutive(counted(log))

    code, rec = gpuos_json(env, "recover")
    assert code == 0 and rec["ok"] is True, rec
    assert "deleted incomplete image" in " | ".join(a["action"] for a in rec["actions"])
    assert journals(home.run) == [] and hidden_entries(store.root) == [] and not (store.root / "job").exists()

    # Unharmed: it checkpoints and restores as if nothing had happened.
    code, out = gpuos_json(env, "checkpoint", str(pid), "--image", "job")
    assert code == 0, out
    assert proc.wait(timeout=10) == -9
    at_dump = counted(log)
    code, res = gpuos_json(env, "restore", "job")
    assert code == 0, res
    processes.adopt(res["pid"], cmdline[1])
    assert res["pid"] == pid
    wait_for(lambda: len(counted(log)) > len(at_dump) + 10, what="the restored process to count")
    assert_consecutive(counted(log))


def test_kill_restore_onto_another_gpu_then_recover(criu_bin, home, store, processes, tmp_path,
                                                    monkeypatch):
    """A restore onto another GPU of the same model (gpuPairs remapping) killed after criu
    restored the process, before the driver restored its GPU memory: recover() must put the
    process back on the GPU the restore had chosen.  The GPU side is a FakeDriver; the
    process, criu and the kill are real."""
    import gpuos.checkpoint
    from gpuos.checkpoint import CheckpointRequest, checkpoint
    from gpuos.criu import Criu
    from gpuos.cudadrv import CHECKPOINTED, RUNNING
    from gpuos.journal import HOLD_ENV, HOLD_FILE_ENV, recover
    from gpuos.restore import restore

    from fakes import FakeDriver, device, gpu_uuid

    criu = Criu(criu_bin, home.run / "criu-plugins")
    log = tmp_path / "count.log"
    proc = processes.counter(log)
    pid, cmdline = proc.pid, procs.cmdline(proc.pid)
    monkeypatch.setattr(gpuos.checkpoint.procs, "uses_cuda", lambda p: p == pid)
    there = FakeDriver(devices=[device(7)])
    there.add(pid, uuid=gpu_uuid(7))
    checkpoint(CheckpointRequest(pid=pid, image="job"), home.run, store, lambda: there, criu)
    assert proc.wait(timeout=10) == -9
    at_dump = counted(log)

    here = FakeDriver(devices=[device(3)])  # same model, another GPU
    here.add(pid, uuid=gpu_uuid(7), state=CHECKPOINTED)  # how criu brings the process back
    hold = tmp_path / "held"
    child = os.fork()
    if child == 0:  # pragma: no cover - the gpuos that gets killed
        try:
            os.environ[HOLD_ENV], os.environ[HOLD_FILE_ENV] = "gpu-restore", str(hold)
            restore("job", home.run, store, lambda: here, criu)
        finally:
            os._exit(3)
    try:
        wait_for(lambda: hold.exists() or os.waitpid(child, os.WNOHANG)[0] != 0,
                 what="restore to reach gpu-restore")
        assert hold.exists(), "restore() ended before gpu-restore"
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
    processes.adopt(pid, cmdline[1])
    assert procs.alive(pid)  # criu restored it; its GPU side is still checkpointed
    assert here.states[pid] == CHECKPOINTED

    actions = recover(home.run, store, lambda: here)

    assert all(a.ok for a in actions), actions
    assert here.states[pid] == RUNNING
    assert here.restore_pairs[pid] == {gpu_uuid(7): gpu_uuid(3)}
    assert journals(home.run) == []
    wait_for(lambda: len(counted(log)) > len(at_dump) + 10, what="the restored process to count")
    assert_consecutive(counted(log))
