"""Checkpoint and restore of real (non-GPU) processes with the real criu, through `gpuos`.

The target counts into a log file it keeps open; after a restore the log must
go on with the next number: no gap, no repeat.  Skipped without root or a
working criu.
"""

from __future__ import annotations

import os
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from gpuos import procs
from gpuos.config import Paths
from gpuos.store import ImageStore

from helpers import (GHOST_HOLDER, Processes, assert_consecutive, counted, gpuos, gpuos_env, gpuos_json,
                     hidden_entries, journals, kill_if_running, tree_digest, wait_for)

pytestmark = pytest.mark.criu


@dataclass
class CR:
    env: dict[str, str]
    paths: Paths
    store: ImageStore
    processes: Processes
    tmp: Path

    def restore_workdirs(self) -> list[Path]:
        return sorted([*self.paths.run.glob("restore-*"), *self.paths.hot.glob("restore-*")])


@pytest.fixture
def cr(criu_bin, home, store, processes, tmp_path) -> CR:
    return CR(gpuos_env(home.home, criu=criu_bin), home, store, processes, tmp_path)


def error_line(res, code: int) -> str:
    assert res.returncode == code, (res.returncode, res.stdout, res.stderr)
    lines = res.stderr.splitlines()
    assert [ln for ln in lines if ln.startswith("gpuos:")] == lines[-1:], res.stderr
    return lines[-1]


def keeps_counting(log: Path, more: int = 20) -> list[int]:
    start = len(counted(log))
    wait_for(lambda: len(counted(log)) >= start + more, what=f"{log} to keep growing")
    numbers = counted(log)
    assert_consecutive(numbers)
    return numbers


def test_checkpoint_kill_restore_continues_counting(cr: CR):
    log = cr.tmp / "count.log"
    proc = cr.processes.counter(log)
    pid, cmdline = proc.pid, procs.cmdline(proc.pid)

    code, out = gpuos_json(cr.env, "checkpoint", str(pid), "--image", "job")
    assert code == 0, out
    assert out["pids"] == [pid] and out["gpu_pids"] == [] and out["left_running"] is False
    assert out["stall"] is None and out["name"] == "job"
    assert {"prepare", "criu-dump", "store", "publish"} <= set(out["timings"])
    assert proc.wait(timeout=10) == -9  # criu killed it once the image was written
    at_dump = counted(log)
    assert_consecutive(at_dump)
    assert len(at_dump) >= 5

    res = gpuos(cr.env, "images", "verify", "job")
    assert res.returncode == 0 and ": OK," in res.stdout, res.stderr
    code, shown = gpuos_json(cr.env, "images", "show", "job")
    assert code == 0
    m = shown["manifest"]
    assert m["root_pid"] == pid and m["processes"][0]["cmdline"] == cmdline
    assert m["leave_running"] is False and m["driver"] is None
    assert shown["size"] == out["size"] > 0
    assert counted(log) == at_dump  # nothing runs until the restore

    code, res = gpuos_json(cr.env, "restore", "job")
    assert code == 0, res
    cr.processes.adopt(res["pid"], cmdline[1])
    assert res["pid"] == pid
    assert {"checks", "read", "criu-restore"} <= set(res["timings"])  # chunks checked as read
    assert res["decoders"]["workers"] >= 1 and res["decoders"]["chunks"] > 0  # by the decoder processes
    assert procs.cmdline(pid) == cmdline
    after = keeps_counting(log)
    assert after[: len(at_dump)] == at_dump

    # Restoring read the image and wrote nothing into it.
    assert gpuos(cr.env, "images", "verify", "job").returncode == 0
    assert journals(cr.paths.run) == [] and cr.restore_workdirs() == []
    assert hidden_entries(cr.store.root) == []


def test_leave_running_keeps_the_process_and_restore_while_taken_exits_14(cr: CR):
    log = cr.tmp / "count.log"
    proc = cr.processes.counter(log)
    start = procs.stat(proc.pid).starttime

    code, out = gpuos_json(cr.env, "checkpoint", str(proc.pid), "--image", "live", "--leave-running")
    assert code == 0, out
    assert out["left_running"] is True
    assert isinstance(out["stall"], float) and out["stall"] > 0
    assert proc.poll() is None
    keeps_counting(log)
    m = ImageStore.load(cr.store.root / "live")
    cr.store.verify(cr.store.root / "live", m)
    assert m.leave_running is True and m.root_pid == proc.pid

    line = error_line(gpuos(cr.env, "restore", "live"), 14)
    assert f"pid {proc.pid}" in line
    assert proc.poll() is None and procs.stat(proc.pid).starttime == start
    keeps_counting(log)
    assert journals(cr.paths.run) == [] and cr.restore_workdirs() == []
    code, out = gpuos_json(cr.env, "restore", "live")
    assert code == 14 and out["error"] == "pid-taken"


def test_dump_refused_by_criu_exits_8_keeps_process_and_previous_image(cr: CR):
    first = cr.processes.counter(cr.tmp / "first.log")
    code, out = gpuos_json(cr.env, "checkpoint", str(first.pid), "--image", "job", "--leave-running")
    assert code == 0, out
    previous = tree_digest(cr.store.root / "job")

    listener = socket.create_server(("127.0.0.1", 0))
    try:
        log = cr.tmp / "tcp.log"
        proc = cr.processes.counter(log, port=listener.getsockname()[1])
        conn, _ = listener.accept()  # an established connection: criu refuses it by default
        try:
            line = error_line(gpuos(cr.env, "checkpoint", str(proc.pid), "--image", "job"), 8)
            assert "left running" in line
            assert "criu dump failed" in line
            kept = Path(line.rsplit("(log: ", 1)[1].rstrip(")"))  # criu's own log outlives the image
            assert kept.parent == cr.paths.run and "Connected TCP socket" in kept.read_text()
            assert proc.poll() is None
            keeps_counting(log)
            code, out = gpuos_json(cr.env, "checkpoint", str(proc.pid), "--image", "job")
            assert code == 8 and out["error"] == "checkpoint-failed" and out["ok"] is False
            assert proc.poll() is None
        finally:
            conn.close()
    finally:
        listener.close()
    assert tree_digest(cr.store.root / "job") == previous
    assert hidden_entries(cr.store.root) == [] and journals(cr.paths.run) == []


RENAMED_FILE = """
import mmap, os, sys, time
# What glibc's sem_open does: a file under a temporary name, linked to its final one.
tmp, final = sys.argv[2] + ".tmp", sys.argv[2]
fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
os.ftruncate(fd, 4096)
shared = mmap.mmap(fd, 4096)
os.link(tmp, final)
os.unlink(tmp)
log = open(sys.argv[1], "a", buffering=1)
i = 0
while True:
    shared[0] = (shared[0] + 1) % 256
    log.write(f"{i} {shared[0]}\\n")
    i += 1
    time.sleep(0.05)
"""


def test_a_file_known_by_another_name_restores_twice_and_leaves_no_link(cr: CR):
    """A file held under a name that is gone while it lives on under another (every named
    semaphore): CRIU must re-link it (links.py), and gpuos keeps that link in the image."""
    script, log = cr.tmp / "renamed.py", cr.tmp / "renamed.log"
    final = Path(f"/dev/shm/gpuos-test-{os.getpid()}-{cr.tmp.name}")
    script.write_text(RENAMED_FILE)
    proc = cr.processes.start([sys.executable, str(script), str(log), str(final)], "renamed")
    try:
        wait_for(lambda: len(log.read_text().splitlines()) >= 5 if log.exists() else False)
        cr.processes.adopt(proc.pid, str(script))
        before = set(Path("/dev/shm").glob("link_remap.*"))

        code, out = gpuos_json(cr.env, "checkpoint", str(proc.pid), "--image", "renamed")
        assert code == 0, out
        assert set(Path("/dev/shm").glob("link_remap.*")) == before  # moved into the image
        kept = [f for f in ImageStore.load(cr.store.root / "renamed").files if f.path.startswith("links/dev/shm/link_remap.")]
        assert kept and all(f.mode >= 0 and f.uid == os.geteuid() for f in kept)
        proc.wait(timeout=10)
        dumped = [int(ln.split()[1]) for ln in log.read_text().splitlines()]
        for _ in range(2):  # an image restores any number of times, each from the dump
            log.write_text("\n".join(f"{i} {v}" for i, v in enumerate(dumped)) + "\n")
            code, res = gpuos_json(cr.env, "restore", "renamed")
            assert code == 0, res
            wait_for(lambda: len(log.read_text().splitlines()) >= len(dumped) + 5)
            values = [int(ln.split()[1]) for ln in log.read_text().splitlines()]
            assert values[len(dumped)] == (dumped[-1] + 1) % 256  # the file's content went on
            assert set(Path("/dev/shm").glob("link_remap.*")) == before
            kill_if_running(res["pid"], str(script))
        assert gpuos(cr.env, "images", "verify", "renamed").returncode == 0
    finally:
        final.unlink(missing_ok=True)


def test_corrupt_image_is_refused_before_anything_is_restored(cr: CR):
    log = cr.tmp / "count.log"
    proc = cr.processes.counter(log)
    pid = proc.pid
    code, out = gpuos_json(cr.env, "checkpoint", str(pid), "--image", "job")
    assert code == 0, out
    proc.wait(timeout=10)
    pages = max((f for f in ImageStore.load(cr.store.root / "job").files if "/pages-" in f.path),
                key=lambda f: f.size)
    chunk = cr.store.chunks().stored(pages.chunks[-1].id)
    data = bytearray(chunk.read_bytes())
    data[len(data) // 3] ^= 0x40
    chunk.chmod(0o644)
    chunk.write_bytes(bytes(data))
    at_dump = counted(log)

    line = error_line(gpuos(cr.env, "restore", "job"), 10)
    assert f"({pages.path} at byte {pages.size - pages.chunks[-1].size}) is corrupt" in line
    assert "nothing was restored" in line
    # CRIU may have begun (the bad chunk is found as it streams): what it began is dead
    # when gpuos returns, and reaped by init soon after
    assert not procs.alive(pid)
    wait_for(lambda: not procs.exists(pid), what="the half-restored process to be reaped")
    assert counted(log) == at_dump
    assert journals(cr.paths.run) == [] and cr.restore_workdirs() == []


def test_a_restore_stopped_by_a_bad_chunk_leaves_no_ghost_file_and_the_mended_image_restores(cr: CR):
    """A file open but deleted at the checkpoint is recreated by CRIU's restore under a
    name of its own (a ghost file). gpuos kills a CRIU whose chunk was bad before that file
    is removed again: the failed restore must remove it, or no later restore gets past it."""
    script, log, held = cr.tmp / "ghost.py", cr.tmp / "count.log", cr.tmp / "held.tmp"
    script.write_text(GHOST_HOLDER)
    proc = cr.processes.start([sys.executable, str(script), str(log), str(held)], "ghost")
    wait_for(lambda: len(counted(log)) >= 5, what="the ghost holder to count")
    code, out = gpuos_json(cr.env, "checkpoint", str(proc.pid), "--image", "ghost")
    assert code == 0, out
    proc.wait(timeout=10)
    manifest = ImageStore.load(cr.store.root / "ghost")
    assert manifest.deleted_dirs == [str(cr.tmp)]
    pages = max((f for f in manifest.files if "/pages-" in f.path), key=lambda f: f.size)
    chunk = cr.store.chunks().stored(pages.chunks[-1].id)
    good = chunk.read_bytes()
    chunk.chmod(0o644)
    chunk.write_bytes(good[:100] + bytes([good[100] ^ 1]) + good[101:])

    line = error_line(gpuos(cr.env, "restore", "ghost"), 10)
    assert "is corrupt" in line and "nothing was restored" in line
    assert list(cr.tmp.glob("held.tmp*")) == []
    wait_for(lambda: not procs.exists(proc.pid), what="the half-restored process to be reaped")
    chunk.write_bytes(good)
    at_dump = len(counted(log))
    code, res = gpuos_json(cr.env, "restore", "ghost")
    assert code == 0, res
    try:
        wait_for(lambda: len(counted(log)) >= at_dump + 10, what="the mended image's process to count on")
        assert list(cr.tmp.glob("held.tmp*")) == []
    finally:
        kill_if_running(res["pid"], str(script))
