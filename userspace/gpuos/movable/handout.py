"""A process's movable memory during a checkpoint and a restore.

Checkpoint (checkpoint.py), for each CUDA process under `gpuos run --memory movable`:

    stage()      while it runs: gpuos's own copier (copier.py: a context on its GPU, pinned
                 bounce buffers) where a snapshot will be taken and it can; else a
                 shared-memory file (tmpfs, named in the journal, so a killed gpuos leaves
                 it for `gpuos recover`) sized for its movable memory, its pages allocated
                 and, for a capture in the stop, registered by the agent
    hand_out()   the stop: HOLD (detached from `gpuos run`); with --leave-running a
                 SNAPSHOT (device-to-device copies, TB/s) if the GPU has room, else CAPTURE
                 into the staging file (registered before the hold) at PCIe speed; LIST,
                 EXPORT the snapshot (or, after a capture, the memory itself) as fds that
                 gpuos and the keeper hold, RELEASE it all in the process.  The driver then
                 checkpoints a process that holds almost no device memory.
    give_back()  --leave-running, or a failure after hand_out(): new memory of the
                 process's own FILLed from the snapshot on the device (or the handed-out
                 memory MAPped back, or FILLed from the staging file), RESUME
    capture_snapshot()  after the stop, the process running: the snapshot straight into
                 the chunk store (the copier), or into the staging file (agent)
    source()     the staging file, for the store to cut into chunks
    discard()    the fds and the staging file go (the image, or the process, has the data)

Restore: filler.py streams the image's memory into new memory at the same addresses.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import GpuosError
from ..intercept import ring as R
from ..manifest import FileEntry, MovableMemory, MovableRange
from ..store.chunks import ChunkStore
from ..store.content import Source, StreamIn
from . import keeper
from .copier import Copier, CopierError
from .agent import Agent, AgentError, agent_available, out_of_memory

STAGING_DIR = Path("/dev/shm")
MARGIN = 256 << 20  # room for allocations made between stage() and hand_out()


def movable_bytes(pid: int) -> int:
    """The physical bytes of the process's movable allocations, from its ring header."""
    ring = R.Ring.open_pid(pid)
    try:
        return ring.header().movable_bytes
    finally:
        ring.close()


@dataclass
class Handout:
    pid: int
    staging: Path  # tmpfs file: the captured contents, back to back in `ranges` order
    size: int      # bytes of the staging file (0: none made; the copier writes the image)
    ranges: list[MovableRange] = field(default_factory=list)
    fds: list[int] = field(default_factory=list)  # the physical memory, held by gpuos
    captured: int = 0  # bytes captured
    capture_s: float = 0.0
    released: bool = False
    snapshot: bool = False  # a device-side snapshot waits to be captured after the stop
    shadow_fds: list[int] = field(default_factory=list)  # the snapshot's memory, while handed out
    agent: Agent | None = None  # the connection that keeps a given-back snapshot until captured
    copier: Copier | None = None  # gpuos's own context to copy a snapshot out (copier.py)
    stored: FileEntry | None = None  # the copier put it into the chunk store: its file entry
    prepared: int = 0  # bytes of the staging file the agent has registered
    keeper: str = ""  # the keeper that holds copies of `shadow_fds` or `fds` (keeper.py)
    keeper_inbox: socket.socket | None = None  # until the keeper has them


def movable_pids(gpu_pids: list[int]) -> list[int]:
    """The CUDA processes whose memory gpuos can move (they serve the agent)."""
    return [p for p in gpu_pids if agent_available(p)]


def stage(pid: int, op_id: str, register: bool, gpu_uuid: str | None = None) -> Handout:
    """Get ready while the process runs.  register (the capture will happen in the stop):
    the staging file, its pages allocated, registered by the agent now (pinning runs at a
    few GB/s); the connection stays open in Handout.agent (its end unregisters).  Else (a
    snapshot, copied out after the stop): gpuos's own copier on the process's GPU if it can
    make one (the copy then does not touch the process, and needs no staging file), else
    the staging file for the agent to copy into."""
    h = Handout(pid=pid, staging=STAGING_DIR / f"gpuos-{op_id}-{pid}.mem", size=0, keeper=f"{op_id}-{pid}")
    try:
        h.keeper_inbox = keeper.spawn(h.keeper)
        if not register:
            try:
                h.copier = Copier(gpu_uuid)
                return h
            except (CopierError, OSError):
                h.copier = None  # the agent copies it
        fd = _staging_file(h, movable_bytes(pid) * 5 // 4 + MARGIN)
        try:
            if register:
                h.agent = Agent(pid)
                h.agent.prepare(fd, h.size)
                h.prepared = h.size
        finally:
            os.close(fd)
    except BaseException:
        if h.agent is not None:
            h.agent.close()
        if h.copier is not None:
            h.copier.close()
        if h.keeper_inbox is not None:
            h.keeper_inbox.close()
        h.staging.unlink(missing_ok=True)
        raise
    return h


def _staging_file(h: Handout, size: int) -> int:
    """The staging file (made if need be) of at least `size` bytes, its pages allocated; an
    open descriptor of it."""
    fd = os.open(h.staging, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        if size > h.size:
            os.posix_fallocate(fd, 0, size)  # the pages now, not while the process is stopped
            h.size = size
    except BaseException:
        os.close(fd)
        raise
    return fd


def hand_out(h: Handout, snapshot: bool) -> None:
    """HOLD, then SNAPSHOT (device-to-device, if asked and the device has room) or CAPTURE
    (to the host, at PCIe speed), EXPORT, RELEASE.  On failure before RELEASE the process
    goes on (the connection's end resumes it and drops a snapshot)."""
    fd = -1
    ag, h.agent = h.agent or Agent(h.pid), None
    try:
        with ag:
            _, nbytes = ag.hold(detach=True)
            if snapshot:
                try:
                    ag.snapshot()
                    h.snapshot = True
                except AgentError as exc:
                    if not out_of_memory(exc):
                        raise
            if h.snapshot and h.copier is None and nbytes > h.size:
                os.close(_staging_file(h, nbytes))  # it grew past the margin since stage()
            if not h.snapshot:  # to the host, now (no room for a copy on the device)
                fd = _staging_file(h, nbytes)
                if h.prepared < nbytes:
                    ag.prepare(fd, h.size)
                    h.prepared = h.size
                r = ag.capture()
                h.captured, h.capture_s = r.bytes, r.ns / 1e9
            h.ranges = [MovableRange(a.base, a.size, a.reserved, a.device, a.last_use) for a in ag.list()]
            if h.snapshot:  # the snapshot is the memory's one copy once released
                h.shadow_fds = ag.export(shadows=True)
            else:  # the staging file has it; the memory itself gives it back faster (MAP)
                try:
                    h.fds = ag.export()
                except AgentError:
                    h.fds = []  # memory it imported (the driver will not export it): FILL back
            inbox, h.keeper_inbox = h.keeper_inbox, None
            keeper.give(inbox, h.shadow_fds or h.fds)  # so that a gpuos killed from now on loses nothing
            ag.release()
            h.released = True
            ag.unprepare()
    finally:
        if fd >= 0:
            os.close(fd)


class SnapshotLost(GpuosError):
    """The process runs on its snapshot's memory: there was no room to copy it back."""


def give_back(h: Handout) -> None:
    """Memory back at the same addresses, then RESUME.  After a snapshot: the snapshot
    MAPped back into the agent, new memory of the process's own FILLed from it on the
    device (memory a process imported cannot be handed out again at the next checkpoint);
    else MAP of the handed-out memory, or FILL from the staging file.  A snapshot's
    connection stays open for capture_snapshot() when the agent copies it: the agent drops
    a snapshot whose client is gone.  SnapshotLost: no room for new memory, so the
    process was given the snapshot itself, and there is no consistent copy to save."""
    lost = False
    if h.released:
        ag = Agent(h.pid)
        try:
            if h.snapshot:
                ag.map(h.shadow_fds, shadows=True)
                try:
                    ag.fill(from_shadows=True)
                except AgentError as exc:
                    if not out_of_memory(exc):
                        raise
                    ag.map(h.shadow_fds)  # the process goes on, on the snapshot's memory
                    lost = True
            elif h.fds:
                ag.map(h.fds)
            else:
                fd = _staging_file(h, h.captured)
                try:
                    ag.prepare(fd, h.size)
                    ag.fill()
                    ag.unprepare()
                finally:
                    os.close(fd)
            h.released = False
            ag.resume()
            if h.copier or lost:
                ag.drop()  # the snapshot is gpuos's alone now (h.shadow_fds)
        except BaseException:
            ag.close()
            raise
        if h.snapshot and not h.copier and not lost:
            h.agent = ag
        else:
            ag.close()
    _close(h)
    keeper.drop(h.keeper)
    if lost:
        h.snapshot = False
        raise SnapshotLost(f"pid {h.pid}: no room on the GPU for its memory after the stop, so it runs on "
                           "its snapshot, and no consistent copy is left to save")


def capture_snapshot(h: Handout, image_dir: Path, chunks: ChunkStore) -> None:
    """After the stop, the process running: the snapshot by gpuos's copier straight into
    the chunk store (cut as it comes, never a file); or else by the agent into the staging
    file."""
    if h.copier is not None:
        t0 = time.monotonic()
        fds, h.shadow_fds = h.shadow_fds, []  # the copier's now: each goes once copied
        total = sum(r.reserved for r in h.ranges)
        into = StreamIn(chunks, staged_source(h.staging, MovableMemory(h.pid, memory_entry(h).file, total, h.ranges)))
        try:
            h.captured = h.copier.copy(fds, [r.reserved for r in h.ranges], into.feed)
            h.stored = into.close()
        except BaseException:
            into.abort()
            raise
        finally:
            _close_snapshot(h)
        h.capture_s, h.snapshot = time.monotonic() - t0, False
        return
    fd = os.open(h.staging, os.O_RDWR)
    ag, h.agent = h.agent, None
    try:
        ag.prepare(fd, h.size)
        r = ag.capture()
        ag.unprepare()
    finally:
        ag.close()
        os.close(fd)
    h.captured, h.capture_s, h.snapshot = r.bytes, r.ns / 1e9, False


def _close(h: Handout) -> None:
    """gpuos's hold on the process's memory (and on a snapshot the agent copies)."""
    for fd in h.fds + ([] if h.copier else h.shadow_fds):
        os.close(fd)
    h.fds = []
    if not h.copier:
        h.shadow_fds = []


def _close_snapshot(h: Handout) -> None:
    for fd in h.shadow_fds:
        os.close(fd)
    h.shadow_fds = []
    if h.copier is not None:
        h.copier.close()
        h.copier = None


def memory_entry(h: Handout) -> MovableMemory:
    """Its manifest entry, once captured (journaled: recovery can finish the image)."""
    return MovableMemory(pid=h.pid, file=f"gpu-memory-{h.pid}.bin", bytes=h.captured, ranges=h.ranges)


def source(h: Handout) -> Source:
    """The captured contents in the staging file, for the store to take them from."""
    return staged_source(h.staging, memory_entry(h))


def staged_source(path: Path, mem: MovableMemory) -> Source:
    """The contents captured into `path`, as the store takes them: cut at every
    allocation's start, so that an allocation's chunks do not depend on its neighbours."""
    return Source(mem.file, path, mem.bytes, tuple(mem.offsets()[1:-1]))




def discard(h: Handout) -> None:
    _close(h)
    _close_snapshot(h)
    if h.keeper_inbox is not None:
        h.keeper_inbox.close()
    keeper.drop(h.keeper)
    if h.agent is not None:  # a snapshot never captured goes with it
        h.agent.close()
        h.agent = None
    h.staging.unlink(missing_ok=True)


def recover(pid: int, staging: Path, entry: dict | None, keeper_name: str = "") -> str:
    """After a gpuos died mid-checkpoint (the driver's side already put back): a process
    left held with its memory released gets the same memory back from the keeper, or else
    new memory filled from the staging file (if the capture completed); every held process
    is resumed."""
    kept = keeper.fetch(keeper_name) if keeper_name else None
    try:
        if not agent_available(pid):
            return f"pid {pid}: no agent (gone, or never handed out)"
        with Agent(pid) as ag:
            try:
                ag.list()
            except AgentError:
                return f"pid {pid}: was not held"
            if kept:
                try:
                    ag.map(kept)
                    ag.drop()  # a snapshot handed out with it is of no use now
                    ag.resume()
                    return f"pid {pid}: its GPU memory mapped back from the keeper, resumed"
                except AgentError as exc:
                    if "mapped" not in exc.message:
                        raise
            if entry is None:
                ag.resume()  # nothing captured, and nothing released
                return f"pid {pid}: resumed"
            return _refill(ag, pid, staging)
    finally:
        for fd in kept or []:
            os.close(fd)


def _refill(ag: Agent, pid: int, staging: Path) -> str:
    fd = os.open(staging, os.O_RDWR)
    try:
        ag.prepare(fd, os.fstat(fd).st_size)
        try:
            ag.fill()
            what = "its GPU memory filled from the capture, resumed"
        except AgentError as exc:
            if "mapped" not in exc.message:
                raise
            what = "resumed"
        ag.unprepare()
    finally:
        os.close(fd)
    ag.resume()
    return f"pid {pid}: {what}"
