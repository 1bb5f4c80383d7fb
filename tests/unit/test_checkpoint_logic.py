"""checkpoint(): the orchestration around the driver and CRIU, with a FakeDriver.

Targets are real processes (a shell and its child); procs.uses_cuda is told
which of them to treat as CUDA processes.  CRIU is a FakeCriu here, to make a
dump fail or succeed on demand; tests/unit/test_criu_e2e.py uses the real one.
"""

from __future__ import annotations

import errno
import os
import pickle
import subprocess
import sys
import time

import pytest

import gpuos.checkpoint
from gpuos import procs
from gpuos.checkpoint import CheckpointRequest, checkpoint, default_name
from gpuos.cudadrv import CHECKPOINTED, LOCKED, RUNNING
from gpuos.errors import (Busy, CheckpointFailed, DriverUnsupported, GpuosError, LockTimeout,
                          NotPermitted, ProcessLeftStopped)
from gpuos.journal import recover
from gpuos.manifest import GpuInfo
from gpuos.store import ImageStore

from fakes import GIB, FakeCriu, FakeDriver, device
from helpers import build_image, hidden_entries, journals, needs_root, tree_digest

pytestmark = needs_root

CRIU_FAILED = GpuosError("criu dump failed (exit 1): Error (criu/sk-inet.c:1): inet: Connected TCP socket")


@pytest.fixture
def target(processes, monkeypatch):
    """(root pid, child pid, shell Popen); both pids count as CUDA processes."""
    shell, child = processes.tree()
    cuda = {shell.pid, child}
    real = gpuos.checkpoint.procs.uses_cuda
    monkeypatch.setattr(gpuos.checkpoint.procs, "uses_cuda", lambda pid: pid in cuda or real(pid))
    return shell.pid, child, shell


@pytest.fixture
def driver(target) -> FakeDriver:
    root, child, _ = target
    drv = FakeDriver(devices=[device(0), device(1)])
    drv.add(root, uuid=drv.devices()[0].uuid, used=3 * GIB)
    drv.add(child, uuid=drv.devices()[1].uuid, used=1 * GIB)
    return drv


def run(home, store, driver, criu, pid, **req):
    return checkpoint(CheckpointRequest(pid=pid, image=req.pop("image", "job"), **req),
                      home.run, store, lambda: driver, criu)


def assert_untouched(home, store, previous_digest):
    assert tree_digest(store.root / "job") == previous_digest
    assert hidden_entries(store.root) == [], "staging left behind"
    assert journals(home.run) == []


def test_checkpoint_publishes_a_complete_image(home, store, driver, target):
    root, child, shell = target
    criu = FakeCriu()
    res = run(home, store, driver, criu, root)
    shell.wait(timeout=10)  # the dump killed the tree

    assert res.path == store.root / "job"
    m = ImageStore.load(res.path)
    ImageStore(res.path.parent).verify(res.path, m)
    assert m == res.manifest
    assert [p.pid for p in m.processes] == [root, child]
    assert m.gpu_pids == [root, child]
    assert m.processes[0].gpu_memory == 3 * GIB and m.processes[1].gpu_memory == 1 * GIB
    assert sorted((g.uuid, g.memory_used_by_image) for g in m.gpus) == \
        sorted([(driver.devices()[0].uuid, 3 * GIB), (driver.devices()[1].uuid, 1 * GIB)])
    assert all(isinstance(g, GpuInfo) and g.name == driver.devices()[0].name for g in m.gpus)
    assert m.driver == driver.info
    assert m.leave_running is False and res.stall is None
    assert {"prepare", "lock", "gpu-checkpoint", "criu-dump", "store"} <= set(m.timings)
    assert "publish" in res.timings
    for pid in (root, child):
        assert driver.calls_for(pid) == ["state", "lock", "checkpoint"]
        assert driver.states[pid] == CHECKPOINTED
    assert criu.dumps == [{"pid": root, "images": criu.dumps[0]["images"], "leave_running": False,
                           "options": ["--file-locks"]}]
    assert m.criu_options == ["--file-locks"]
    assert hidden_entries(store.root) == [] and journals(home.run) == []


def test_default_image_name(home, store, processes):
    proc = processes.sleeper()
    res = checkpoint(CheckpointRequest(pid=proc.pid), home.run, store,
                     lambda: pytest.fail("no CUDA process: no driver needed"), FakeCriu())
    proc.wait(timeout=10)
    assert res.path == store.root / f"sleep-{proc.pid}" == store.root / default_name("sleep", proc.pid)
    assert res.manifest.gpus == [] and res.manifest.driver is None
    assert "lock" not in res.timings


def test_dump_failure_puts_every_gpu_process_back(home, store, driver, target):
    root, child, shell = target
    prev = tree_digest(build_image(store, "job", seed=b"previous"))

    with pytest.raises(CheckpointFailed) as exc:
        run(home, store, driver, FakeCriu(dump_error=CRIU_FAILED), root)

    assert exc.value.exit_code == 8
    assert "left running" in exc.value.message and "Connected TCP socket" in exc.value.message
    for pid in (root, child):
        assert driver.states[pid] == RUNNING
        assert driver.calls_for(pid) == ["state", "lock", "checkpoint", "state", "restore", "unlock"]
    assert shell.poll() is None and os.path.exists(f"/proc/{child}")
    assert_untouched(home, store, prev)


def test_dump_failure_on_a_full_disk_still_puts_back_and_keeps_the_log(home, store, driver, target,
                                                                      monkeypatch):
    """Found on H200 with a full disk: keeping CRIU's log by copying it raised ENOSPC out of
    the undo (a traceback instead of the error; the copy needs space the disk no longer has)."""
    root, child, shell = target
    prev = tree_digest(build_image(store, "job", seed=b"previous"))

    def disk_full(*_a, **_k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(gpuos.checkpoint.shutil, "copyfile", disk_full)
    monkeypatch.setattr(gpuos.checkpoint.shutil, "copy2", disk_full)
    with pytest.raises(CheckpointFailed) as exc:
        run(home, store, driver, FakeCriu(dump_error=CRIU_FAILED), root)

    assert "left running" in exc.value.message
    kept = list(home.run.glob("checkpoint-*-dump.log"))
    assert len(kept) == 1 and f"(log: {kept[0]})" in exc.value.message
    assert "Error (criu/cr-dump.c:1)" in kept[0].read_text()
    for pid in (root, child):
        assert driver.states[pid] == RUNNING
    assert shell.poll() is None and os.path.exists(f"/proc/{child}")
    assert_untouched(home, store, prev)


def test_lock_timeout_on_the_second_process_unlocks_the_first(home, store, driver, target):
    root, child, shell = target
    prev = tree_digest(build_image(store, "job", seed=b"previous"))
    driver.fail("lock", child, LockTimeout(f"cuCheckpointProcessLock (pid {child}): timed out"))
    criu = FakeCriu()

    with pytest.raises(LockTimeout) as exc:
        run(home, store, driver, criu, root, lock_timeout_ms=50)

    assert exc.value.exit_code == 7
    assert "left running" in exc.value.message
    assert driver.calls_for(root) == ["state", "lock", "state", "unlock"]
    assert driver.calls_for(child) == ["state", "lock", "state"]
    assert driver.states == {root: RUNNING, child: RUNNING}
    assert criu.dumps == []
    assert shell.poll() is None
    assert_untouched(home, store, prev)


def test_driver_checkpoint_failure_puts_back_both(home, store, driver, target):
    root, child, _ = target
    prev = tree_digest(build_image(store, "job", seed=b"previous"))
    driver.fail("checkpoint", child, GpuosError("cuCheckpointProcessCheckpoint failed: CUDA_ERROR_UNKNOWN"))
    criu = FakeCriu()
    with pytest.raises(CheckpointFailed, match="left running"):
        run(home, store, driver, criu, root)
    assert driver.states == {root: RUNNING, child: RUNNING}
    assert driver.calls_for(root)[-3:] == ["state", "restore", "unlock"]
    assert driver.calls_for(child)[-2:] == ["state", "unlock"]
    assert criu.dumps == []
    assert_untouched(home, store, prev)


def test_leave_running_restores_unlocks_and_reports_the_stall(home, store, driver, target):
    root, child, shell = target
    t0 = time.monotonic()
    res = run(home, store, driver, FakeCriu(dump_seconds=0.05), root, leave_running=True)
    elapsed = time.monotonic() - t0
    for pid in (root, child):
        assert driver.calls_for(pid) == ["state", "lock", "checkpoint", "state", "restore", "unlock"]
        assert driver.states[pid] == RUNNING
        assert procs.stat(pid).state != "T"  # held for the driver, then let go
    assert shell.poll() is None
    assert res.stall is not None and res.stall >= 0.05
    assert res.stall < elapsed
    assert res.stall >= sum(res.timings[p] for p in ("lock", "gpu-checkpoint", "criu-dump",
                                                     "gpu-restore"))
    m = ImageStore.load(res.path)
    ImageStore(res.path.parent).verify(res.path, m)
    assert m.leave_running is True
    assert "gpu-restore" in m.timings


def test_failed_put_back_exits_19_and_recover_finishes_the_job(home, store, driver, target):
    root, child, _ = target
    prev = tree_digest(build_image(store, "job", seed=b"previous"))
    driver.fail("restore", root, GpuosError("cuCheckpointProcessRestore failed: CUDA_ERROR_UNKNOWN"))

    code, message = _run_in_child(home, store, driver, root, dump_error=True, leave_running=False)

    assert code == ProcessLeftStopped.exit_code == 19 and "gpuos recover" in message
    assert driver.states == {root: CHECKPOINTED, child: RUNNING}  # as the failed gpuos left them
    assert len(journals(home.run)) == 1  # kept for recover
    assert tree_digest(store.root / "job") == prev
    actions = recover(home.run, store, lambda: driver)
    assert all(a.ok for a in actions), actions
    assert driver.states == {root: RUNNING, child: RUNNING}
    assert_untouched(home, store, prev)


def test_resume_failure_after_leave_running_is_retried(home, store, driver, target):
    root, child, shell = target
    driver.fail("restore", child, GpuosError("cuCheckpointProcessRestore failed: CUDA_ERROR_UNKNOWN"),
                times=2)
    res = run(home, store, driver, FakeCriu(), root, leave_running=True)
    assert driver.calls_for(child).count("restore") == 3
    assert driver.states == {root: RUNNING, child: RUNNING}
    assert res.stall is not None and procs.stat(child).state != "T"
    assert shell.poll() is None and journals(home.run) == []


def test_resume_that_keeps_failing_leaves_the_process_stopped_and_its_image_published(
        home, store, driver, target):
    root, child, shell = target
    prev = tree_digest(build_image(store, "job", seed=b"previous"))
    driver.fail("restore", child, GpuosError("cuCheckpointProcessRestore failed: CUDA_ERROR_UNKNOWN"),
                times=3)
    code, message = _run_in_child(home, store, driver, root, dump_error=False, leave_running=True)
    assert code == 19, message
    assert driver.calls_for(child).count("restore") == 3
    assert driver.states[child] == CHECKPOINTED and driver.states[root] == RUNNING
    # The last copy of the application: published, and the process stopped, never running
    # without its GPU state.
    assert f"image {store.root / 'job'} is published" in message
    assert "CUDA_ERROR_UNKNOWN" in message and "left stopped" in message
    assert f"gpuos restore {store.root / 'job'}" in message and "gpuos recover" in message
    assert procs.stat(child).state == "T" and shell.poll() is None
    m = ImageStore.load(store.root / "job")
    store.verify(store.root / "job", m)
    assert tree_digest(store.root / "job") != prev
    assert m.gpu_pids == [root, child] and m.leave_running is True
    assert hidden_entries(store.root) == []
    assert driver.running_threads == []

    actions = recover(home.run, store, lambda: driver)  # the driver works again
    assert all(a.ok for a in actions), actions
    assert driver.states == {root: RUNNING, child: RUNNING}
    assert procs.stat(child).state != "T" and shell.poll() is None
    assert journals(home.run) == []
    store.verify(store.root / "job", ImageStore.load(store.root / "job"))


def _run_in_child(home, store, driver, pid, dump_error: bool, leave_running: bool) -> tuple[int, str]:
    """checkpoint() in a forked child: a gpuos that fails, reports, and exits (releasing its
    operation's lock).  The FakeDriver comes back through a pipe, as the real driver's state
    outlives gpuos."""
    r, w = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - runs in the fork
        os.close(r)
        code, message = 0, ""
        try:
            run(home, store, driver, FakeCriu(dump_error=CRIU_FAILED if dump_error else None), pid,
                leave_running=leave_running)
        except GpuosError as exc:
            code, message = exc.exit_code, exc.message
        except BaseException as exc:  # noqa: BLE001
            code, message = 99, repr(exc)
        os.write(w, pickle.dumps((driver.__dict__, message)))
        os._exit(code)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        state, message = pickle.loads(f.read())
    _, status = os.waitpid(child, 0)
    driver.__dict__.update(state)
    return os.waitstatus_to_exitcode(status), message


def test_process_not_running_on_gpu_is_refused_untouched(home, store, driver, target):
    root, child, _ = target
    driver.states[child] = LOCKED
    with pytest.raises(CheckpointFailed, match="gpuos recover"):
        run(home, store, driver, FakeCriu(), root)
    assert "lock" not in driver.calls_for(root)
    assert driver.states == {root: RUNNING, child: LOCKED}
    assert not store.root.exists() or os.listdir(store.root) == []
    assert journals(home.run) == []


def test_busy_when_another_gpuos_works_on_the_pid(home, store, driver, target, processes):
    root, child, _ = target
    code = ("import sys, time; from pathlib import Path; from gpuos.journal import pid_lock\n"
            "with pid_lock(Path(sys.argv[1]), int(sys.argv[2])):\n"
            "    print('held', flush=True); time.sleep(1000)")
    holder = subprocess.Popen([sys.executable, "-c", code, str(home.run), str(root)],
                              stdout=subprocess.PIPE, text=True, start_new_session=True)
    processes.children.append(holder)
    assert holder.stdout.readline().strip() == "held"
    criu = FakeCriu()
    with pytest.raises(Busy) as exc:
        run(home, store, driver, criu, root)
    assert exc.value.exit_code == 18
    assert criu.dumps == [] and set(driver.calls_for(root)) == {"state"}
    assert driver.states == {root: RUNNING, child: RUNNING}


def test_refuses_to_checkpoint_itself(home, store):
    with pytest.raises(NotPermitted):
        checkpoint(CheckpointRequest(pid=os.getpid()), home.run, store, FakeDriver, FakeCriu())


def test_refuses_a_tree_containing_gpuos(home, store):
    # The parent of this test process has gpuos (pytest) in its tree.
    parent = os.getppid()
    if parent <= 1:
        pytest.skip("no parent to try")
    criu = FakeCriu()
    with pytest.raises(NotPermitted, match="contains gpuos"):
        checkpoint(CheckpointRequest(pid=parent), home.run, store, FakeDriver, criu)
    assert criu.dumps == []
    os.kill(parent, 0)  # still there


@pytest.mark.parametrize("where", ["path", "store-name"])
def test_never_replaces_a_directory_that_is_not_an_image(home, store, processes, tmp_path, where):
    """`--image DIR` (or a name in the store) naming an existing directory that is not a gpuos
    image must be refused, not swapped out and deleted (publish() replaces what is there)."""
    precious = tmp_path / "precious" if where == "path" else store.root / "precious"
    precious.mkdir(parents=True)
    (precious / "thesis.tex").write_text("years of work")
    proc = processes.sleeper()
    criu = FakeCriu()
    ref = str(precious) if where == "path" else "precious"
    with pytest.raises(GpuosError):
        checkpoint(CheckpointRequest(pid=proc.pid, image=ref), home.run, store,
                   lambda: pytest.fail("no CUDA process"), criu)
    assert (precious / "thesis.tex").read_text() == "years of work"
    assert proc.poll() is None, "the process was dumped (and killed) for an image that cannot be published"
    assert criu.dumps == []
    assert hidden_entries(precious.parent) == [] and journals(home.run) == []


def test_cuda_ipc_is_refused_before_anything_changes(home, store, driver, target, monkeypatch):
    """A process that maps the runtime's IPC file (as every exporter and importer of CUDA IPC
    memory does) is refused before the lock: the driver would checkpoint an importer and
    then fail to restore it."""
    root, child, shell = target
    shm = f"/dev/shm/cuda.shm.gpuos-test.{os.getpid()}"
    holder = subprocess.Popen([sys.executable, "-c", (
        "import mmap, os, sys, time\n"
        "fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600); os.ftruncate(fd, 4096)\n"
        "m = mmap.mmap(fd, 4096); print('ready', flush=True); time.sleep(60)"), shm],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "ready"
        assert gpuos.checkpoint.unsupported_features(holder.pid) == [gpuos.checkpoint.IPC]
        assert gpuos.checkpoint.unsupported_features(root) == []
        seen = {child: gpuos.checkpoint.unsupported_features(holder.pid)}  # the child "maps" it
        monkeypatch.setattr(gpuos.checkpoint, "unsupported_features", lambda pid: seen.get(pid, []))
        with pytest.raises(DriverUnsupported) as exc:
            run(home, store, driver, FakeCriu(), root)
    finally:
        holder.kill()
        holder.wait()
        os.unlink(shm)
    assert exc.value.exit_code == 6
    assert f"pid {child} shares GPU memory with other processes (CUDA IPC)" in exc.value.message
    assert "nothing was changed" in exc.value.message
    assert "lock" not in driver.calls_for(root) + driver.calls_for(child)
    assert driver.states == {root: RUNNING, child: RUNNING} and journals(home.run) == []


def test_managed_memory_is_refused_before_anything_changes(home, store, driver, target, monkeypatch):
    root, child, _ = target
    monkeypatch.setattr(gpuos.checkpoint, "unsupported_features",
                        lambda pid: [gpuos.checkpoint.MANAGED] if pid == child else [])
    with pytest.raises(DriverUnsupported) as exc:
        run(home, store, driver, FakeCriu(), root)
    assert exc.value.exit_code == 6
    assert f"pid {child} uses CUDA managed memory" in exc.value.message
    assert "lock" not in driver.calls_for(root) + driver.calls_for(child)
    assert driver.states == {root: RUNNING, child: RUNNING}
