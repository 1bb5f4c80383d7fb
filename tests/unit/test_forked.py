"""Removing what a forked child inherited from its parent (gpuos.forked), on real processes.

A file under tmp_path stands for a /dev/nvidia* device: the parent maps it and holds it
open, then forks; the child also opens it itself. Only the inherited mapping and file
may go, the child must go on exactly where it was (here: in the middle of a sleep), and
the parent must keep its own.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from gpuos import forked

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or os.uname().machine != "x86_64",
                                reason="needs root (ptrace of a non-child) on x86-64")

PROGRAM = r"""
import mmap, os, sys, time
dev = sys.argv[1]
fd = os.open(dev, os.O_RDWR)
m = mmap.mmap(fd, 4096)
m[:5] = b"hello"
child = os.fork()
if child == 0:
    own = os.open(dev, os.O_RDONLY)
    print("child", os.getpid(), fd, own, flush=True)
    t0 = time.monotonic()
    time.sleep(1.5)  # gpuos runs its system calls in here
    slept = time.monotonic() - t0
    os.read(own, 1)
    try:
        os.fstat(fd)
        inherited_fd = "open"
    except OSError:
        inherited_fd = "closed"
    print(f"child slept {slept:.2f} inherited fd {inherited_fd}", flush=True)
    os._exit(0)
_, status = os.waitpid(child, 0)
print("parent", m[:5].decode(), os.fstat(fd).st_size, os.waitstatus_to_exitcode(status), flush=True)
"""


def test_inherited_mapping_and_file_go_and_the_child_goes_on(tmp_path):
    dev = tmp_path / "nvidia-standin"
    dev.write_bytes(b"\0" * 4096)
    proc = subprocess.Popen([sys.executable, "-c", PROGRAM, str(dev)], stdout=subprocess.PIPE,
                            text=True)
    try:
        _, child, fd, own = proc.stdout.readline().split()
        child, fd, own = int(child), int(fd), int(own)
        prefix = str(dev)
        found = forked.inherited(child, proc.pid, prefix)
        # fd and the duplicate Python's mmap keeps of it, not `own`: the same path, another file
        assert found.fds == forked.device_fds(proc.pid, prefix) and fd in found.fds
        assert len(found.maps) == 1 and found.maps[0] in forked.device_maps(proc.pid, prefix)

        forked.drop(found)

        assert forked.device_maps(child, prefix) == set()
        assert forked.device_fds(child, prefix) == [own]
        assert forked.device_maps(proc.pid, prefix) and fd in forked.device_fds(proc.pid, prefix)
        out, _ = proc.communicate(timeout=30)
    finally:
        proc.kill()
    child_line, parent_line = out.strip().splitlines()
    _, _, slept, *_ , state = child_line.split()
    assert 1.4 < float(slept) < 5 and state == "closed", child_line  # the sleep went on
    assert parent_line == "parent hello 4096 0"


def test_a_process_that_inherited_nothing(tmp_path):
    dev = tmp_path / "nvidia-standin"
    dev.write_bytes(b"\0" * 4096)
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert not forked.inherited(other.pid, os.getpid(), str(dev))
    finally:
        other.kill()
        other.wait()
