"""GPU device state that a CPU process inherited by fork() from a CUDA process.

A process that a CUDA process forked without exec (PyTorch DataLoader workers,
multiprocessing's fork start method) inherits its parent's mappings of ``/dev/nvidia*``
and its open device files. It can never use them: CUDA does not work in a child forked
after the parent initialized it. But CRIU cannot save a device mapping or a device file,
so it refuses the whole tree ("Collect mappings ... failed", measured on H100 with a
DataLoader). Just before the dump, gpuos removes exactly that inherited state from such a
process, running ``munmap`` and ``close`` in it under ptrace (``ThreadHold.syscall``):

* each device mapping that its CUDA ancestor has at the same address range, and
* each device file that is the same open file as one of the ancestor's (``kcmp``).

It is what the child's own exit would do to those objects. Anything else of the kind (a
device file the process opened itself, say through NVML) is left alone, and CRIU's error
names it.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass, field

from . import procs
from .errors import GpuosError
from .hold import hold

DEVICE_PREFIX = "/dev/nvidia"
SYS_CLOSE, SYS_MUNMAP, SYS_KCMP = 3, 11, 312  # x86-64
KCMP_FILE = 0

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


@dataclass
class Inherited:
    """What ``pid`` inherited from its CUDA ancestor and cannot use."""

    pid: int
    maps: list[tuple[int, int]] = field(default_factory=list)  # [start, end)
    fds: list[int] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.maps or self.fds)


def device_maps(pid: int, prefix: str = DEVICE_PREFIX) -> set[tuple[int, int]]:
    return {(m.start, m.end) for m in procs.mappings(pid) if m.path.startswith(prefix)}


def device_fds(pid: int, prefix: str = DEVICE_PREFIX) -> list[int]:
    return sorted(fd for fd, target in procs.open_files(pid).items() if target.startswith(prefix))


def _same_file(pid1: int, fd1: int, pid2: int, fd2: int) -> bool:
    return _libc.syscall(SYS_KCMP, pid1, pid2, KCMP_FILE, fd1, fd2) == 0


def inherited(pid: int, ancestor: int, prefix: str = DEVICE_PREFIX) -> Inherited:
    """The device mappings and files ``pid`` shares with ``ancestor`` (read while the
    ancestor still has them: before its GPU checkpoint)."""
    theirs = device_maps(ancestor, prefix)
    maps = sorted(m for m in device_maps(pid, prefix) if m in theirs)
    their_fds = device_fds(ancestor, prefix)
    fds = [fd for fd in device_fds(pid, prefix)
           if any(_same_file(pid, fd, ancestor, afd) for afd in their_fds)]
    return Inherited(pid=pid, maps=maps, fds=fds)


def drop(inh: Inherited) -> None:
    """Unmap and close what ``inh`` lists, in its process, which goes on running."""
    h = hold(inh.pid)
    try:
        for start, end in inh.maps:
            err = h.syscall(SYS_MUNMAP, start, end - start)
            if err:
                raise GpuosError(f"munmap of {start:#x}-{end:#x} in pid {inh.pid}: {os.strerror(-err)}")
        for fd in inh.fds:
            err = h.syscall(SYS_CLOSE, fd)
            if err:
                raise GpuosError(f"close of fd {fd} in pid {inh.pid}: {os.strerror(-err)}")
    finally:
        h.release()
