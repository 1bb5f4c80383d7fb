"""Checkpoint and restore of a process under `gpuos run` whose device memory is movable:
the real libgpuos and agent, the fake driver (its VMM memory a memfd the process maps), the
real criu, a FakeDriver for the driver's checkpoint API.  t_agent checks every byte of
its device memory at every iteration, before the checkpoint and after the restore.

The checkpoint captures the movable memory through the agent, hands it out, lets CRIU
dump a process that holds none of it, and saves it in the image; the restore gives the
process new memory at the same addresses, filled from the image.  Skipped without root
or a working criu."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpuos import procs
from gpuos.checkpoint import CheckpointRequest, checkpoint
from gpuos.criu import Criu
from gpuos.cudadrv import CHECKPOINTED, LOCKED, RUNNING
from gpuos.journal import recover
from gpuos.movable import agent_available
from gpuos.restore import restore

from fakes import FakeDriver
from helpers import hidden_entries

pytestmark = pytest.mark.criu
GPUOS = [sys.executable, "-m", "gpuos.cli"]
GRAN = 2 << 20
SIZES = (2 << 20, (5 << 20) + 3, 8 << 20)


def wait_for(cond, what: str, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


STARTED = time.time()


def staging_left(pid: int) -> list[Path]:
    """Staging files of pid's movable memory left in /dev/shm by this run (an older run's,
    with a pid that happens to be the same, is not ours to judge)."""
    return [p for p in Path("/dev/shm").glob(f"gpuos-*-{pid}.mem") if p.stat().st_ctime >= STARTED]


def ready_pid(out: Path) -> int | None:
    for line in out.read_text().splitlines() if out.exists() else []:
        if line.startswith("ready"):
            return int(line.split()[1])
    return None


@pytest.fixture
def app(libgpuos_build, tmp_path):
    out, err, stop = tmp_path / "app.out", tmp_path / "app.err", tmp_path / "stop"
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUOS_")}
    env.update(GPUOS_LIBGPUOS=str(libgpuos_build / "libgpuos.so"),
               LD_LIBRARY_PATH=str(libgpuos_build / "fakecuda"), GPUOS_HOME=str(tmp_path / "runhome"))
    with open(out, "a") as o, open(err, "a") as e:  # appended: replicas of it write there too
        run = subprocess.Popen([*GPUOS, "run", "-q", "--", str(libgpuos_build / "tests" / "t_agent"), str(stop), "5"],
                               stdout=o, stderr=e, stdin=subprocess.DEVNULL, env=env, start_new_session=True)
    pid = wait_for(lambda: ready_pid(out), "t_agent to allocate")
    wait_for(lambda: agent_available(pid), "its agent")
    yield pid, out, err, stop
    for p in (pid, run.pid):
        try:
            os.kill(p, 9)
        except ProcessLookupError:
            pass
    run.wait()


def checkpointed(pid: int, image: str, home, store, criu_bin, tmp_path):
    """The process checkpointed into `image` (and ended by CRIU), with a FakeDriver for the
    driver's API: (driver, criu, the checkpoint's result)."""
    driver = FakeDriver()
    driver.add(pid)
    (tmp_path / "plugins").mkdir(exist_ok=True)
    criu = Criu(criu_bin, tmp_path / "plugins")
    res = checkpoint(CheckpointRequest(pid=pid, image=image), home.run, store, lambda: driver, criu)
    wait_for(lambda: not procs.alive(pid), "CRIU to end the process")
    return driver, criu, res


@pytest.mark.parametrize("on_demand", [True, False], ids=["on-demand", "eager"])
def test_checkpoint_and_restore_move_the_memory_through_the_image(app, criu_bin, home, store, tmp_path, on_demand):
    pid, out, err, stop = app
    driver, criu, res = checkpointed(pid, "moved", home, store, criu_bin, tmp_path)
    (mem,) = res.manifest.movable
    assert mem.pid == pid and sorted(r.size for r in mem.ranges) == sorted(SIZES)
    assert mem.bytes == sum((n + GRAN - 1) // GRAN * GRAN for n in SIZES)
    (entry,) = [f for f in res.manifest.files if f.path == mem.file]  # stored with the rest
    assert entry.size == mem.bytes == sum(c.size for c in entry.chunks)
    # a chunk ends at every allocation's start: an allocation's chunks do not depend on its neighbours
    ends = {sum(c.size for c in entry.chunks[:i + 1]) for i in range(len(entry.chunks))}
    assert {sum(r.reserved for r in mem.ranges[:i]) for i in range(1, len(mem.ranges))} <= ends
    assert "movable-hold" in res.timings and not staging_left(pid)

    back = restore("moved", home.run, store, lambda: driver, criu, on_demand=on_demand)
    assert procs.alive(pid)
    fill = back.fills[pid]
    assert fill.on_demand == on_demand and fill.bytes == mem.bytes
    # on demand it went on before its memory was back; eager, after
    assert (fill.resumed_after < fill.seconds) if on_demand else (fill.resumed_after >= fill.seconds - 0.05)
    stop.touch()
    wait_for(lambda: "ok" in out.read_text(), "the restored t_agent to finish", timeout=60)
    assert "differs" not in err.read_text() and " is " not in err.read_text(), err.read_text()


def test_leave_running_gives_the_same_memory_back(app, criu_bin, home, store, tmp_path):
    pid, out, err, stop = app
    driver = FakeDriver()
    driver.add(pid)
    (tmp_path / "plugins").mkdir()
    res = checkpoint(CheckpointRequest(pid=pid, image="live", leave_running=True), home.run, store,
                     lambda: driver, Criu(criu_bin, tmp_path / "plugins"))
    assert res.stall is not None and procs.alive(pid)
    assert {"movable-hold", "movable-give-back", "movable-capture"} <= set(res.timings)  # a snapshot, captured after
    stop.touch()
    wait_for(lambda: "ok" in out.read_text(), "t_agent to finish", timeout=60)
    assert err.read_text() == "", err.read_text()


# Where a killed gpuos leaves the process's driver state (the fake driver's, in this test).
LEFT_IN = {"movable-hold": RUNNING, "lock": RUNNING, "gpu-checkpoint": LOCKED, "criu-dump": CHECKPOINTED,
           "movable-give-back": RUNNING, "movable-capture": RUNNING, "store": RUNNING}


@pytest.mark.parametrize("phase,leave", [("movable-hold", True), ("lock", True), ("gpu-checkpoint", True),
                                         ("criu-dump", True), ("movable-give-back", True),
                                         ("movable-capture", True), ("criu-dump", False)])
def test_gpuos_killed_at_a_phase_loses_nothing(app, criu_bin, home, store, tmp_path, phase, leave):
    """SIGKILL the checkpoint at the start of each phase of the movable path: once the
    memory is handed out, only the keeper holds it; `gpuos recover` puts it back and the
    process runs on, checking every byte, or (killed during a dump that completes) the
    image is finished."""
    pid, out, err, stop = app
    hold = tmp_path / "held"
    (tmp_path / "plugins").mkdir()
    child = os.fork()
    if child == 0:  # the gpuos to kill
        try:
            os.environ.update(GPUOS_TEST_HOLD_AT=phase, GPUOS_TEST_HOLD_FILE=str(hold))
            drv = FakeDriver()
            drv.add(pid)
            checkpoint(CheckpointRequest(pid=pid, image="crash", leave_running=leave), home.run, store,
                       lambda: drv, Criu(criu_bin, tmp_path / "plugins"))
        finally:
            os._exit(0)
    wait_for(hold.exists, f"gpuos to reach {phase}")
    os.kill(child, signal.SIGKILL)
    os.waitpid(child, 0)
    driver = FakeDriver()
    driver.add(pid, state=LEFT_IN[phase])
    actions = recover(home.run, store, lambda: driver)
    assert all(a.ok for a in actions), actions
    said = " ".join(a.action for a in actions)
    if phase in ("gpu-checkpoint", "criu-dump") and leave or phase == "movable-give-back":
        assert "mapped back from the keeper" in said, said  # the memory was handed out
    assert not staging_left(pid)
    stop.touch()
    wait_for(lambda: "ok" in out.read_text(), "t_agent to finish", timeout=60)
    assert err.read_text() == "", err.read_text()


def test_an_application_gone_during_the_copy_fails_the_checkpoint_cleanly(app, criu_bin, home, store, tmp_path,
                                                                        monkeypatch):
    """--leave-running: the process ends after the stop, before its snapshot is copied out:
    a one-line error, no image published, the previous image intact, nothing left behind."""
    from gpuos.errors import CheckpointFailed
    from gpuos.movable import handout

    pid, out, err, stop = app
    driver = FakeDriver()
    driver.add(pid)
    (tmp_path / "plugins").mkdir()
    criu = Criu(criu_bin, tmp_path / "plugins")
    first = checkpoint(CheckpointRequest(pid=pid, image="kept", leave_running=True), home.run, store,
                       lambda: driver, criu)
    before = sorted(p.name for p in first.path.iterdir())
    real = handout.capture_snapshot

    def exits_first(h, image_dir, chunks):
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: not agent_available(pid), "the process to be gone")
        real(h, image_dir, chunks)

    monkeypatch.setattr(handout, "capture_snapshot", exits_first)
    with pytest.raises(CheckpointFailed, match="no image was published"):
        checkpoint(CheckpointRequest(pid=pid, image="kept", leave_running=True), home.run, store,
                   lambda: driver, criu)
    assert sorted(p.name for p in first.path.iterdir()) == before
    store.verify(first.path, store.load(first.path))
    assert not staging_left(pid)
    assert hidden_entries(store.root) == []
    assert not list(home.run.glob("op-*.json"))


def test_leave_running_without_room_for_a_snapshot_copies_in_the_stop(app, criu_bin, home, store, tmp_path):
    """A GPU without free memory for a device-side copy: the staging file is registered
    before the stop and the memory copied to it during the stop; the process runs on."""
    from fakes import device

    pid, out, err, stop = app
    driver = FakeDriver(devices=[device(0, free=1 << 20)])
    driver.add(pid)
    (tmp_path / "plugins").mkdir()
    res = checkpoint(CheckpointRequest(pid=pid, image="tight", leave_running=True), home.run, store,
                     lambda: driver, Criu(criu_bin, tmp_path / "plugins"))
    assert "movable-capture" not in res.timings and "movable-give-back" in res.timings
    (mem,) = res.manifest.movable
    assert mem.bytes == sum((n + GRAN - 1) // GRAN * GRAN for n in SIZES)
    stop.touch()
    wait_for(lambda: "ok" in out.read_text(), "t_agent to finish", timeout=60)
    assert err.read_text() == "", err.read_text()


COPIER_SCRIPT = """
import json, sys
from pathlib import Path
sys.path.insert(0, {tests!r})
from fakes import FakeDriver
from helpers import hidden_entries
from gpuos.checkpoint import CheckpointRequest, checkpoint
from gpuos.criu import Criu
from gpuos.movable import handout
from gpuos.store import ImageStore
used = []
real = handout.capture_snapshot
def spy(h, image_dir, chunks):
    used.append(h.copier is not None)
    real(h, image_dir, chunks)
handout.capture_snapshot = spy
drv = FakeDriver()
drv.add({pid})
res = checkpoint(CheckpointRequest(pid={pid}, image="copied", leave_running=True), Path({run!r}),
                 ImageStore(Path({store!r})), lambda: drv, Criu(Path({criu!r}), Path({plugins!r})))
print(json.dumps({{"copier": used, "path": str(res.path)}}))
"""


def test_gpuos_copies_the_snapshot_out_from_a_context_of_its_own(app, criu_bin, home, store, tmp_path,
                                                                  libgpuos_build):
    """With a CUDA driver for gpuos itself (here the fake, through cuda-python), the
    snapshot is copied out by gpuos's copier, not inside the process; the image holds each
    allocation as it was at the stop (t_agent's iterations k + 1 then k)."""
    pid, out, err, stop = app
    (tmp_path / "plugins").mkdir()
    script = COPIER_SCRIPT.format(tests=str(Path(__file__).parents[1]), pid=pid, run=str(home.run),
                                  store=str(store.root), criu=str(criu_bin), plugins=str(tmp_path / "plugins"))
    env = dict(os.environ, LD_LIBRARY_PATH=str(libgpuos_build / "fakecuda"))
    env.pop("LD_PRELOAD", None)
    res = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    got = __import__("json").loads(res.stdout.splitlines()[-1])
    assert got["copier"] == [True]
    image = Path(got["path"])
    m = store.load(image)
    store.verify(image, m)
    (mem,) = m.movable
    (entry,) = [f for f in m.files if f.path == mem.file]
    data = b"".join(store.chunks().read(c) for c in entry.chunks)
    bases = [int(x) for x in out.read_text().split()[2:6]]  # "ready PID BASE..."
    by_index, off = {}, 0
    for r in mem.ranges:  # back to back in LIST (address) order, `reserved` bytes each
        i = bases.index(r.base)
        k = (data[off] - i * 7) % 256
        assert data[off:off + r.size] == bytes((j * 31 + i * 7 + k) & 0xFF for j in range(r.size)), i
        by_index[i] = k
        off += r.reserved
    ks = [by_index[i] for i in sorted(by_index)]
    assert all(x in (ks[-1], (ks[-1] + 1) % 256) for x in ks)
    assert ks == sorted(ks, key=lambda x: x != (ks[-1] + 1) % 256)  # k + 1 first, then k
    stop.touch()
    wait_for(lambda: "ok" in out.read_text(), "t_agent to finish", timeout=60)
    assert err.read_text() == "", err.read_text()


COPY_PIPELINE_SCRIPT = """
import ctypes, json, os, sys
from pathlib import Path
from cuda.bindings import driver as cu
from gpuos.movable.copier import Copier
MiB = 1 << 20
sizes = [40 * MiB, 70 * MiB, 2 * MiB, 30 * MiB]  # pieces of 64 MiB straddle allocations
cu.cuInit(0)
err, dev = cu.cuDeviceGet(0)
err, ctx = cu.cuDevicePrimaryCtxRetain(dev)
cu.cuCtxSetCurrent(ctx)
prop = cu.CUmemAllocationProp()
prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
prop.location.id = 0
prop.requestedHandleTypes = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
expected, fds = b"", []
for i, n in enumerate(sizes):
    err, h = cu.cuMemCreate(n, prop, 0)
    assert int(err) == 0, err
    err, va = cu.cuMemAddressReserve(n, 0, 0, 0)
    assert int(cu.cuMemMap(va, n, 0, h, 0)[0]) == 0
    desc = cu.CUmemAccessDesc()
    desc.location = prop.location
    desc.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    assert int(cu.cuMemSetAccess(va, n, [desc], 1)[0]) == 0
    data = os.urandom(n)
    buf = ctypes.create_string_buffer(data, n)
    assert int(cu.cuMemcpyHtoD(va, ctypes.addressof(buf), n)[0]) == 0
    expected += data
    err, fd = cu.cuMemExportToShareableHandle(h, prop.requestedHandleTypes, 0)
    assert int(err) == 0, err
    fds.append(int(fd))
    cu.cuMemUnmap(va, n)
    cu.cuMemAddressFree(va, n)
    cu.cuMemRelease(h)  # the fd alone keeps the memory
got = []
c = Copier(None)
n = c.copy(fds, sizes, got.append)
c.close()
closed = []
for fd in fds:
    try:
        os.fstat(fd)
        closed.append(False)
    except OSError:
        closed.append(True)
print(json.dumps({"bytes": n, "same": b"".join(got) == expected, "closed": closed,
                  "pieces": [len(p) for p in got]}))
"""


def test_copier_pipeline_writes_what_the_gpu_held(libgpuos_build, tmp_path):
    """The copier's pipeline on the fake driver: allocations of uneven sizes whose pieces
    straddle them come out back to back, byte for byte, in order, in pieces of 64 MiB;
    every descriptor is closed once copied."""
    env = dict(os.environ, LD_LIBRARY_PATH=str(libgpuos_build / "fakecuda"))
    env.pop("LD_PRELOAD", None)
    res = subprocess.run([sys.executable, "-c", COPY_PIPELINE_SCRIPT, str(tmp_path / "out.bin")], env=env,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    got = __import__("json").loads(res.stdout.splitlines()[-1])
    assert got == {"bytes": 142 << 20, "same": True, "closed": [True] * 4,
                   "pieces": [64 << 20, 64 << 20, 14 << 20]}


def test_gpuos_killed_after_the_copier_stored_the_snapshot_finishes_the_image(app, criu_bin, home, store,
                                                                               tmp_path, libgpuos_build):
    """gpuos SIGKILLed once its copier has put the snapshot into the chunk store (its chunk
    list journaled) but before the image is published: `gpuos recover` publishes it with
    those chunks, and it verifies; the process runs on."""
    pid, out, err, stop = app
    (tmp_path / "plugins").mkdir()
    hold = tmp_path / "held"
    script = COPIER_SCRIPT.format(tests=str(Path(__file__).parents[1]), pid=pid, run=str(home.run),
                                  store=str(store.root), criu=str(criu_bin), plugins=str(tmp_path / "plugins"))
    env = dict(os.environ, LD_LIBRARY_PATH=str(libgpuos_build / "fakecuda"), GPUOS_TEST_HOLD_AT="store",
               GPUOS_TEST_HOLD_FILE=str(hold))
    env.pop("LD_PRELOAD", None)
    gpuos_proc = subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE)
    wait_for(hold.exists, "gpuos to reach store")
    gpuos_proc.kill()
    gpuos_proc.communicate()
    driver = FakeDriver()
    driver.add(pid)
    actions = recover(home.run, store, lambda: driver)
    assert all(a.ok for a in actions), actions
    assert "published image" in " ".join(a.action for a in actions)
    image = store.resolve("copied")
    m = store.load(image)
    store.verify(image, m)
    (mem,) = m.movable
    assert mem.bytes == sum(r.reserved for r in mem.ranges) > 0
    stop.touch()
    wait_for(lambda: "ok" in out.read_text(), "t_agent to finish", timeout=60)
    assert err.read_text() == "", err.read_text()


@pytest.mark.parametrize("free", [None, 1 << 20], ids=["snapshot", "no-room"])
def test_checkpoint_again_and_again_while_it_runs(app, criu_bin, home, store, tmp_path, free):
    """Periodic checkpoints: the driver will not export memory a process imported, so
    after a --leave-running checkpoint the process must hold memory of its own again
    (filled from the snapshot, or from the staging file), or the next one fails.  Three in
    a row, each image verified, the process checking every byte throughout; then the last
    image restores."""
    from fakes import device

    pid, out, err, stop = app
    driver = FakeDriver(devices=[device(0, free=free)] if free else None)
    driver.add(pid)
    (tmp_path / "plugins").mkdir()
    criu = Criu(criu_bin, tmp_path / "plugins")
    for k in range(3):
        res = checkpoint(CheckpointRequest(pid=pid, image=f"again-{k}", leave_running=True), home.run, store,
                         lambda: driver, criu)
        assert procs.alive(pid)
        assert ("movable-capture" in res.timings) == (free is None)
        store.verify(res.path, res.manifest)
        (mem,) = res.manifest.movable
        assert mem.bytes == sum((n + GRAN - 1) // GRAN * GRAN for n in SIZES)
    stop.touch()
    wait_for(lambda: "ok" in out.read_text(), "t_agent to finish", timeout=60)
    assert err.read_text() == "", err.read_text()


def _gpu_memory_chunk(store, image: str):
    m = store.load(store.resolve(image))
    (mem,) = m.movable
    (entry,) = [f for f in m.files if f.path == mem.file]
    return store.chunks().stored(entry.chunks[-1].id)


def test_a_corrupt_chunk_of_gpu_memory_fails_the_restore_and_ends_the_process(app, criu_bin, home, store, tmp_path):
    """The process resumes before its GPU memory is back; a chunk of that memory found
    corrupt as it is read never reaches the GPU: the restore fails with exit 10's error,
    the restored process (which would wait for that memory for ever) is killed, the image
    and the store are as they were."""
    from gpuos.errors import ImageCorrupt

    pid, out, err, stop = app
    driver, criu, _ = checkpointed(pid, "bad", home, store, criu_bin, tmp_path)
    chunk = _gpu_memory_chunk(store, "bad")
    good = chunk.read_bytes()
    chunk.chmod(0o644)
    chunk.write_bytes(bytes(len(good)))
    with pytest.raises(ImageCorrupt, match="is corrupt.*killed, the image is intact") as exc:
        restore("bad", home.run, store, lambda: driver, criu)
    assert exc.value.exit_code == 10
    wait_for(lambda: not procs.exists(pid), "the restored process to be killed and reaped")
    chunk.write_bytes(good)  # mended: the same image restores
    restore("bad", home.run, store, lambda: driver, criu)
    stop.touch()
    wait_for(lambda: "ok" in out.read_text(), "the restored t_agent to finish", timeout=60)
    assert "differs" not in err.read_text() and " is " not in err.read_text(), err.read_text()


def restore_killed_while_filling(pid: int, image: str, home, store, criu_bin, tmp_path, **kw) -> None:
    """A gpuos (a child of ours) restoring `image`, SIGKILLed at the start of movable-fill."""
    hold = tmp_path / "held"
    child = os.fork()
    if child == 0:
        try:
            os.environ.update(GPUOS_TEST_HOLD_AT="movable-fill", GPUOS_TEST_HOLD_FILE=str(hold))
            drv = FakeDriver()
            drv.add(pid)
            restore(image, home.run, store, lambda: drv, Criu(criu_bin, tmp_path / "plugins"), **kw)
        finally:
            os._exit(0)
    wait_for(hold.exists, "gpuos to reach movable-fill")
    os.kill(child, signal.SIGKILL)
    os.waitpid(child, 0)


def test_gpuos_killed_while_it_fills_leaves_nothing_waiting(app, criu_bin, home, store, tmp_path):
    """gpuos SIGKILLed at the start of movable-fill: the restored process waits for memory
    only that gpuos had; `gpuos recover` kills it, and the image restores again."""
    pid, out, err, stop = app
    driver, criu, _ = checkpointed(pid, "again", home, store, criu_bin, tmp_path)
    restore_killed_while_filling(pid, "again", home, store, criu_bin, tmp_path)
    assert procs.alive(pid)  # restored, held for its memory
    actions = recover(home.run, store, lambda: driver)
    assert any(f"killed pids {pid}" in a.action for a in actions), actions
    wait_for(lambda: not procs.exists(pid), "recovery to end the process, and it to be reaped")
    restore("again", home.run, store, lambda: driver, criu)
    stop.touch()
    wait_for(lambda: "ok" in out.read_text(), "the restored t_agent to finish", timeout=60)


def test_replicas_each_get_their_gpu_memory_back(app, criu_bin, home, store, tmp_path):
    """Two replicas of one image, each in namespaces of its own: the driver, the restore
    thread and the agent are reached by our pids, each gets all its memory, on demand,
    and each t_agent checks every byte of it to the end."""
    pid, out, err, stop = app
    driver, criu, res = checkpointed(pid, "many", home, store, criu_bin, tmp_path)
    (mem,) = res.manifest.movable
    back = restore("many", home.run, store, lambda: driver, criu, replicas=2)
    try:
        hosts = [pl.pids[pid] for pl in back.placements]
        assert len(set(hosts)) == 2 and [procs.own_pid(h) for h in hosts] == [pid, pid]
        assert all(pl.init and procs.stat(pl.root).ppid == pl.init for pl in back.placements)
        assert sorted(back.fills) == sorted(hosts)
        assert all(f.bytes == mem.bytes and f.on_demand for f in back.fills.values())
        assert all(driver.calls_for(h)[-2:] == ["restore", "unlock"] for h in hosts)
        assert driver.running_threads == []  # the restore thread found by its id in the namespace
        stop.touch()
        wait_for(lambda: out.read_text().count("ok ") == 2, "both replicas to finish", timeout=60)
        assert err.read_text() == "", err.read_text()
    finally:
        for pl in back.placements:
            pl.kill()


def test_gpuos_killed_while_replicas_fill_leaves_none(app, criu_bin, home, store, tmp_path):
    """Replicas are all or none: gpuos SIGKILLed while it fills them, `gpuos recover` ends
    every replica (their pid 1), and the image restores again."""
    pid, out, err, stop = app
    driver, criu, _ = checkpointed(pid, "again", home, store, criu_bin, tmp_path)
    restore_killed_while_filling(pid, "again", home, store, criu_bin, tmp_path, replicas=3)
    (journal,) = home.run.glob("op-*.json")
    inits = [p for p, _ in json.loads(journal.read_text())["replica_inits"]]
    assert len(inits) == 3 and all(procs.alive(p) for p in inits)
    actions = recover(home.run, store, lambda: driver)
    assert all(a.ok for a in actions) and any("ended the replicas" in a.action for a in actions), actions
    wait_for(lambda: not any(procs.alive(p) for p in inits), "recovery to end every replica")
    assert list(home.run.glob("op-*.json")) == []
    restore("again", home.run, store, lambda: driver, criu)
    stop.touch()
    wait_for(lambda: "ok" in out.read_text(), "the restored t_agent to finish", timeout=60)


def test_an_image_of_format_4_with_gpu_memory_still_restores(app, criu_bin, home, store, tmp_path):
    """An image as gpuos wrote them before the chunk store (whole files, sha256s): its GPU
    memory file, read in pieces that do not fall on allocation starts, comes back whole;
    t_agent checks every byte."""
    from gpuos.store import ImageStore

    from helpers import legacy_entries

    pid, out, err, stop = app
    driver, criu, res = checkpointed(pid, "new", home, store, criu_bin, tmp_path)
    # the same image, as format 4: its files in the image directory
    old = tmp_path / "old-store"
    files = old / "old"
    store.content(res.path, res.manifest).materialize(("criu", "links"), files)
    (mem,) = res.manifest.movable
    fd = os.open(files / mem.file, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        from concurrent.futures import ThreadPoolExecutor
        c = store.content(res.path, res.manifest)
        with ThreadPoolExecutor(2) as pool:
            c.write_files([(c.entry(mem.file), fd)], pool)
    finally:
        os.close(fd)
    m = store.load(res.path)
    m.format_version, m.chunk_dir = 4, ""
    m.files = legacy_entries(files)
    ImageStore.write_manifest(files, m)
    import gpuos.store.content as content_mod
    assert content_mod.COPY_PIECE % (2 << 20) == 0  # 16 MiB pieces: allocations of 2, 6, 8 MiB straddle them
    old_store = ImageStore(old)
    back = restore(str(files), home.run, old_store, lambda: driver, criu)
    assert back.timings.get("verify") is not None  # a format-4 image is verified whole first
    stop.touch()
    wait_for(lambda: "ok" in out.read_text(), "the restored t_agent to finish", timeout=60)
    assert "differs" not in err.read_text() and " is " not in err.read_text(), err.read_text()


COPY_IN_SCRIPT = """
import json, os
from concurrent.futures import ThreadPoolExecutor
from gpuos.movable.copier import Copier
MiB = 1 << 20
sizes = [40 * MiB, 70 * MiB, 2 * MiB]
data = [os.urandom(n) for n in sizes]
# parts in a fill order of its own, of uneven lengths: (allocation, offset, length)
parts = [(2, 0, 2 * MiB)] + [(1, o, min(24 * MiB, sizes[1] - o)) for o in range(0, sizes[1], 24 * MiB)] \\
    + [(0, o, 8 * MiB) for o in range(0, sizes[0], 8 * MiB)]
c = Copier(None)
c.allocate(sizes)
with ThreadPoolExecutor(4) as pool:
    done = c.load(parts, lambda k, view: view.__setitem__(slice(None), data[parts[k][0]][parts[k][1]:parts[k][1] + parts[k][2]]),
                  pool, lambda: False)
fds = c.export()
c.close()  # what the fds hold lives on
same = [os.pread(fd, n, 0) == d for fd, n, d in zip(fds, sizes, data)]
stopped = Copier(None)
stopped.allocate(sizes)
with ThreadPoolExecutor(4) as pool:
    calls = []
    none = stopped.load(parts, lambda k, view: None, pool, lambda: calls.append(1) or len(calls) > 1)
stopped.close()
print(json.dumps({"done": done, "parts": len(parts), "same": same, "stopped_after_one_buffer": none}))
"""


def test_copier_fills_memory_of_its_own_that_it_exports(libgpuos_build):
    """The copier's way in (a restore's prefill) on the fake driver: memory of its own,
    parts of uneven sizes in any order read into its buffers and copied to the GPU, every
    byte where it belongs once exported (the fake driver's memory is the memfd behind the
    fd); a stop before the second buffer leaves the first one's parts done."""
    env = dict(os.environ, LD_LIBRARY_PATH=str(libgpuos_build / "fakecuda"))
    env.pop("LD_PRELOAD", None)
    res = subprocess.run([sys.executable, "-c", COPY_IN_SCRIPT], env=env, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    got = __import__("json").loads(res.stdout.splitlines()[-1])
    assert got == {"done": 9, "parts": 9, "same": [True] * 3, "stopped_after_one_buffer": 3}
