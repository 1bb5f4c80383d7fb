"""Fakes for the layers the host has no hardware for.

``FakeDriver`` stands in for the CUDA driver's checkpoint API and NVML (the
``gpuos.cudadrv.GpuDriver`` protocol).  It keeps one state machine per pid, as
the driver does:

    running --lock--> locked --checkpoint--> checkpointed
    checkpointed --restore--> locked --unlock--> running

and answers any other transition with a GpuosError, so code that calls the
driver in the wrong order fails here as it would on a GPU.  Like the driver, it
does its checkpoint and restore through the process's *restore thread*
(``restore_thread``; the main thread unless ``add`` names another), and like a
JAX process it insists that no other thread of the process runs meanwhile:
``running_threads`` records every thread it found running at a checkpoint,
restore or unlock of a real process.  A restore puts a
process's GPU memory back on the GPU it was checkpointed on unless gpu_pairs
maps that to another; the target GPU must be one of devices().  Failures (a lock
timeout, a failed restore, ...) are injected per method and pid.

``FakeCriu`` is used only by the checkpoint orchestration tests, to exercise
the logic around a dump that fails or succeeds; everything that claims to work
with CRIU is tested against the real one (tests marked ``criu``).
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

from gpuos import procs
from gpuos.criu import DUMP_LOG, DUMP_OK
from gpuos.cudadrv import CHECKPOINTED, LOCKED, RUNNING, GpuDevice, GpuProcess
from gpuos.errors import GpuosError
from gpuos.manifest import DriverInfo

H100 = "NVIDIA H100 80GB HBM3"
A100 = "NVIDIA A100-SXM4-80GB"
GIB = 1 << 30


def gpu_uuid(n: int) -> str:
    return f"GPU-{n:08x}-0000-4000-8000-{n:012x}"


def device(n: int, name: str = H100, total: int = 80 * GIB, free: int = 70 * GIB) -> GpuDevice:
    return GpuDevice(index=n, uuid=gpu_uuid(n), name=name, memory_total=total, memory_free=free)


class FakeDriver:
    """A GpuDriver whose GPU processes are registered with ``add``."""

    def __init__(self, devices: list[GpuDevice] | None = None,
                 version: str = "580.65.06", cuda_api: int = 13000):
        self._devices = list(devices if devices is not None else [device(0)])
        self.info = DriverInfo(version=version, cuda_api=cuda_api)
        self.states: dict[int, str] = {}
        self.usage: dict[int, tuple[str, int]] = {}  # pid -> (uuid, bytes)
        self.calls: list[tuple[str, int]] = []
        self.restore_pairs: dict[int, dict[str, str]] = {}
        self.runners: dict[int, int] = {}
        self.running_threads: list[tuple[str, int, int, str]] = []  # (call, pid, tid, state)
        self._failures: dict[tuple[str, int], list[GpuosError]] = {}

    # -- test set-up --------------------------------------------------------
    def add(self, pid: int, uuid: str | None = None, used: int = GIB, state: str = RUNNING,
            runner: int | None = None) -> None:
        self.states[pid] = state
        self.usage[pid] = (uuid or self._devices[0].uuid, used)
        self.runners[pid] = runner or pid

    def fail(self, method: str, pid: int, exc: GpuosError, times: int = 1) -> None:
        """The next ``times`` calls of ``method`` for ``pid`` raise ``exc``; the state is unchanged."""
        self._failures.setdefault((method, pid), []).extend([exc] * times)

    def calls_for(self, pid: int) -> list[str]:
        return [m for m, p in self.calls if p == pid]

    # -- GpuDriver ------------------------------------------------------------
    def driver_info(self) -> DriverInfo:
        return self.info

    def devices(self) -> list[GpuDevice]:
        return list(self._devices)

    def processes(self) -> list[GpuProcess]:
        # Like NVML: a checkpointed process holds no context and no memory on a GPU.
        return [GpuProcess(pid=pid, uuid=self.usage[pid][0], used_memory=self.usage[pid][1])
                for pid, st in sorted(self.states.items()) if st in (RUNNING, LOCKED)]

    def state(self, pid: int) -> str:
        self.calls.append(("state", pid))
        self._maybe_fail("state", pid)
        return self._state(pid)

    def restore_thread(self, pid: int) -> int:
        self._maybe_fail("restore_thread", pid)
        self._state(pid)
        return self.runners[pid]

    def lock(self, pid: int, timeout_ms: int) -> None:
        self._transition("lock", pid, RUNNING, LOCKED)

    def checkpoint(self, pid: int) -> None:
        self._transition("checkpoint", pid, LOCKED, CHECKPOINTED)

    def restore(self, pid: int, gpu_pairs: dict[str, str]) -> None:
        # The process's GPU memory goes back to the GPU it was checkpointed on, or to the one
        # gpu_pairs maps that to; that GPU has to be here.
        uuid, used = self.usage.get(pid, ("", 0))
        target = gpu_pairs.get(uuid, uuid)
        if pid in self.states and target not in {d.uuid for d in self._devices}:
            self.calls.append(("restore", pid))
            raise GpuosError(f"cuCheckpointProcessRestore (pid {pid}) failed: CUDA_ERROR_INVALID_DEVICE "
                             f"(no GPU {target} here)")
        self._transition("restore", pid, CHECKPOINTED, LOCKED)
        self.restore_pairs[pid] = dict(gpu_pairs)
        self.usage[pid] = (target, used)

    def unlock(self, pid: int) -> None:
        self._transition("unlock", pid, LOCKED, RUNNING)

    # -- plumbing ------------------------------------------------------------
    def _state(self, pid: int) -> str:
        if pid not in self.states:
            self._adopt_replica(pid)
        if pid not in self.states:
            raise GpuosError(f"cuCheckpointProcessGetState (pid {pid}) failed: CUDA_ERROR_NOT_FOUND")
        return self.states[pid]

    def _adopt_replica(self, pid: int) -> None:
        """A real process in a pid namespace of its own that calls itself a pid we know is a
        replica restored from that process's image: checkpointed, like the image, and, like
        the driver, we name its restore thread as it sees it."""
        try:
            own = procs.own_pid(pid)
        except GpuosError:
            return
        if own != pid and own in self.states:
            self.states[pid] = CHECKPOINTED
            self.usage[pid] = self.usage[own]
            self.runners[pid] = self.runners[own]

    def _maybe_fail(self, method: str, pid: int) -> None:
        pending = self._failures.get((method, pid))
        if pending:
            raise pending.pop(0)

    def _check_still(self, method: str, pid: int) -> None:
        try:
            states = procs.thread_states(pid)
        except GpuosError:
            return  # not a real process
        runner = procs.thread_by_own_id(pid, self.runners.get(pid, pid))
        self.running_threads += [(method, pid, tid, st) for tid, st in states.items()
                                 if tid != runner and st not in ("t", "T")]

    def _transition(self, method: str, pid: int, before: str, after: str) -> None:
        self.calls.append((method, pid))
        if method in ("checkpoint", "restore", "unlock"):
            self._check_still(method, pid)
        state = self._state(pid)
        if state != before:
            raise GpuosError(f"{method} (pid {pid}) failed: CUDA_ERROR_ILLEGAL_STATE "
                             f"(process is {state}, {method} needs {before})")
        self._maybe_fail(method, pid)
        self.states[pid] = after


@dataclass
class FakeCriu:
    """The two calls checkpoint() makes of a Criu, for orchestration tests only.

    A successful dump writes an image file and a dump.log ending with CRIU's
    success line, and kills the tree's root unless told to leave it running,
    as criu does.  ``dump_error`` makes the dump fail instead (no success line).
    """

    dump_error: GpuosError | None = None
    dump_seconds: float = 0.0
    dumps: list[dict] = field(default_factory=list)

    def check_version(self) -> str:
        return "4.2.1"

    def dump(self, pid: int, images: Path, leave_running: bool, options: list[str]) -> float:
        self.dumps.append({"pid": pid, "images": images, "leave_running": leave_running,
                           "options": list(options)})
        time.sleep(self.dump_seconds)
        if self.dump_error is not None:
            (images / DUMP_LOG).write_text("(00.001) Error (criu/cr-dump.c:1): dump failed\n")
            raise self.dump_error
        (images / f"pages-{pid}.img").write_bytes(os.urandom(8192))
        (images / "pstree.img").write_bytes(pid.to_bytes(4, "little"))
        (images / DUMP_LOG).write_text(f"(00.010) Writing stats\n(00.011) {DUMP_OK}\n")
        if not leave_running:  # criu kills the dumped tree
            for p in procs.tree(pid):
                os.kill(p, signal.SIGKILL)
        return self.dump_seconds
