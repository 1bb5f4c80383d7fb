"""Which process's GPU work faulted: event trackers on other processes' VA spaces, through
the stock driver's UVM tools interface (root).

UVM translates a replayable MMU fault of the SMs (instance pointer, subcontext) to the VA
space it came from, and records it there only: at the cancel, as a UvmEventTypeFatalFault,
written into the trackers of that VA space before the channel is torn down. A tracker
bound to each MPS client's VA space therefore names the faulting client, which RM's Xid
line does not always do. Measured on an H100 (580.159.04) under MPS with an out-of-bounds
write: only the injector's tracker received the fatal fault, 0.16 ms after it; the
victims' and the server's received only the replay broadcast, which names no one
(docs/notes-uvm-tools.md; the probe with every event: tools/probes/uvm_tools_probe.py).

How: each /dev/nvidia-uvm file of the process is copied into this one (pidfd_open +
pidfd_getfd), a tracker is made on /dev/nvidia-uvm-tools for it
(UVM_TOOLS_INIT_EVENT_TRACKER_V2 on a queue and a control page of our own memory), and
only fatal-fault events are enabled: nothing else is recorded, so the process pays
nothing while it runs. A tracker holds a reference to the VA space, so a process's
trackers are closed as soon as it exits, on a thread of their own: the last reference
to an exited process's VA space is then ours, and its close is the driver's teardown of
that VA space. After a fault under MPS that may take long: the MPS supervisor's loop,
which closed them itself, showed no event for 4.7 s after an N = 8 fault (H200,
2026-11-27). SM exceptions (Xid 13/43) never reach UVM and are not seen here.

Layouts are those of NVIDIA's open kernel modules, 580.142, `kernel-open/` (the line
numbers in the comments); the probe's --self-test checks them against gcc's sizes.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import os
import platform
import select
import stat
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable

from .. import procs
from .model import FaultClass, FaultEvent, MmuFault

UVM_TOOLS_INIT_EVENT_TRACKER = 56           # uvm_ioctl.h:822
UVM_TOOLS_SET_NOTIFICATION_THRESHOLD = 57   # uvm_ioctl.h:837
UVM_TOOLS_EVENT_QUEUE_ENABLE_EVENTS = 58    # uvm_ioctl.h:847
UVM_TOOLS_INIT_EVENT_TRACKER_V2 = 76        # uvm_ioctl.h:1094
NVIDIA_UVM_PRIMARY_MINOR = 0                # uvm_common.h:46
UVM_EVENT_NUM_TYPES_ALL = 64                # uvm_types.h:312
EVENT_FATAL_FAULT = 6                       # uvm_types.h:281-313
ENTRY_SIZE = {1: 64, 2: 72}                 # UvmEventEntry / _V2, uvm_types.h:1302-1368
TOOLS_PATH = "/dev/nvidia-uvm-tools"
SOURCE = "uvm-tracker"                      # FaultEvent.source of the faults named here

# uvm_types.h:270-279, 407-433, 435-450
ACCESS_TYPES = {0: "invalid", 1: "read", 2: "write", 3: "atomic", 4: "prefetch"}
FAULT_TYPES = {0: "invalid", 1: "invalid_pde", 2: "invalid_pte", 3: "write", 4: "atomic",
               5: "invalid_pde_size", 6: "limit_violation", 7: "unbound_inst_block",
               8: "priv_violation", 9: "pitch_mask_violation", 10: "work_creation",
               11: "unsupported_aperture", 12: "compression_failure", 13: "unsupported_kind",
               14: "region_violation", 15: "poison", 16: "cc_violation"}
FATAL_REASONS = {0: "invalid", 1: "invalid_address", 2: "invalid_permissions",
                 3: "invalid_fault_type", 4: "out_of_memory", 5: "internal_error",
                 6: "invalid_operation"}

# pidfd_open/pidfd_getfd use the common numbering on both arches
SYSCALLS = {
    "x86_64": {"pidfd_open": 434, "pidfd_getfd": 438, "kcmp": 312},
    "aarch64": {"pidfd_open": 434, "pidfd_getfd": 438, "kcmp": 272},
}
KCMP_FILE = 0
PAGE = mmap.PAGESIZE

U8, U16, U32, U64 = ctypes.c_uint8, ctypes.c_uint16, ctypes.c_uint32, ctypes.c_uint64


def _struct(name, fields):
    return type(name, (ctypes.Structure,), {"_fields_": fields})


NvProcessorUuid = _struct("NvProcessorUuid", [("uuid", U8 * 16)])  # common/inc/nvCpuUuid.h:29-40
InitEventTrackerParams = _struct("UVM_TOOLS_INIT_EVENT_TRACKER_PARAMS", [   # uvm_ioctl.h:823-832
    ("queueBuffer", U64), ("queueBufferSize", U64), ("controlBuffer", U64),
    ("processor", NvProcessorUuid), ("allProcessors", U32), ("uvmFd", U32), ("rmStatus", U32)])
SetThresholdParams = _struct("UVM_TOOLS_SET_NOTIFICATION_THRESHOLD_PARAMS", [  # uvm_ioctl.h:838-842
    ("notificationThreshold", U32), ("rmStatus", U32)])
EnableEventsParams = _struct("UVM_TOOLS_EVENT_QUEUE_ENABLE_EVENTS_PARAMS", [  # uvm_ioctl.h:848-852
    ("eventTypeFlags", U64), ("rmStatus", U32)])
ControlData = _struct("UvmToolsEventControlData", [  # uvm_types.h:1401-1412
    ("get_ahead", U32), ("get_behind", U32), ("put_ahead", U32), ("put_behind", U32),
    ("dropped", U64 * UVM_EVENT_NUM_TYPES_ALL)])
FatalFaultInfoV2 = _struct("UvmEventFatalFaultInfo_V2", [  # uvm_types.h:753-770
    ("eventType", U8), ("faultType", U8), ("accessType", U8), ("reason", U8),
    ("processorIndex", U16), ("padding16bits", U16), ("address", U64), ("timeStamp", U64)])


def ioctl_struct(fd: int, request: int, params: ctypes.Structure) -> ctypes.Structure:
    """ioctl with a copy of params; returns the struct the driver wrote back. Raises
    OSError. (UVM ioctls return 0 and put an NV_STATUS in rmStatus: uvm_api.h:45-67.)"""
    buf = bytearray(bytes(params))
    fcntl.ioctl(fd, request, buf, True)
    return type(params).from_buffer_copy(bytes(buf))


class Sys:
    """pidfd_open, pidfd_getfd, kcmp through libc's syscall()."""

    def __init__(self):
        arch = platform.machine()
        if arch not in SYSCALLS:
            raise OSError(errno.ENOSYS, f"no syscall numbers for {arch} (x86_64, aarch64 known)")
        self.nr = SYSCALLS[arch]
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.libc.syscall.restype = ctypes.c_long

    def _call(self, name: str, *args) -> int:
        r = self.libc.syscall(ctypes.c_long(self.nr[name]), *[ctypes.c_long(a) for a in args])
        if r < 0:
            e = ctypes.get_errno()
            raise OSError(e, f"{name}: {os.strerror(e)}")
        return r

    def pidfd_open(self, pid: int) -> int:
        return self._call("pidfd_open", pid, 0)

    def pidfd_getfd(self, pidfd: int, fd: int) -> int:
        return self._call("pidfd_getfd", pidfd, fd, 0)

    def same_file(self, fd1: int, fd2: int) -> bool:
        me = os.getpid()
        return self._call("kcmp", me, me, KCMP_FILE, fd1, fd2) == 0


def uvm_major() -> int | None:
    try:
        with open("/proc/devices") as f:
            for line in f:
                parts = line.split()
                if len(parts) == 2 and parts[1] == "nvidia-uvm":
                    return int(parts[0])
    except OSError:
        pass
    return None


def uvm_fds(pid: int, major: int | None = None) -> list[int]:
    """The fd numbers of pid's /dev/nvidia-uvm files (none before its first CUDA context)."""
    major = uvm_major() if major is None else major
    out = []
    try:
        names = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return out
    for n in sorted(int(x) for x in names):
        path = f"/proc/{pid}/fd/{n}"
        try:
            st = os.stat(path)
            if stat.S_ISCHR(st.st_mode) and major is not None:
                if os.major(st.st_rdev) == major and os.minor(st.st_rdev) == NVIDIA_UVM_PRIMARY_MINOR:
                    out.append(n)
            elif os.readlink(path) == "/dev/nvidia-uvm":
                out.append(n)
        except OSError:
            continue
    return out


class Queue:
    """A tracker's queue and control buffers: anonymous private mappings of this process
    (page aligned, as the driver's map_user_pages needs), read and advanced here."""

    def __init__(self, entries: int, version: int):
        self.version = version
        self.entries = entries
        self.entry_size = ENTRY_SIZE[version]
        qlen = (entries * self.entry_size + PAGE - 1) // PAGE * PAGE
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
        prot = mmap.PROT_READ | mmap.PROT_WRITE
        self.qmap = mmap.mmap(-1, qlen, flags=flags, prot=prot)
        self.cmap = mmap.mmap(-1, PAGE, flags=flags, prot=prot)
        self._qview = (ctypes.c_char * qlen).from_buffer(self.qmap)
        self.ctrl = ControlData.from_buffer(self.cmap)
        self.qaddr = ctypes.addressof(self._qview)
        self.caddr = ctypes.addressof(self.ctrl)
        self.get = 0

    def pending(self) -> int:
        return (self.ctrl.put_behind - self.get) & (self.entries - 1)

    def drain(self) -> list[bytes]:
        """Entries from get to put_behind, then get_ahead = get_behind = put (uvm_tools.c:448-499)."""
        mask = self.entries - 1
        put = self.ctrl.put_behind & mask
        out = []
        i = self.get
        while i != put:
            off = i * self.entry_size
            out.append(bytes(self.qmap[off:off + self.entry_size]))
            i = (i + 1) & mask
        self.get = put
        self.ctrl.get_behind = put
        self.ctrl.get_ahead = put
        return out

    def close(self) -> None:
        # Only after the tracker fd is closed (the driver unpins then, uvm_tools.c:384-446).
        del self.ctrl, self._qview
        self.qmap.close()
        self.cmap.close()


@dataclass(frozen=True)
class FatalFault:
    """A fatal GPU fault recorded in a process's VA space: that process's work faulted."""

    pid: int
    address: int
    access: str        # read | write | atomic | prefetch
    fault_type: str    # e.g. invalid_pde
    reason: str        # e.g. invalid_address
    timestamp_ns: int  # CLOCK_MONOTONIC_RAW (uvm_linux.h:136-142)


def decode_fatal(raw: bytes, pid: int) -> FatalFault | None:
    """A v2 queue entry, if it is a fatal fault."""
    if not raw or raw[0] != EVENT_FATAL_FAULT:
        return None
    f = FatalFaultInfoV2.from_buffer_copy(raw[:ctypes.sizeof(FatalFaultInfoV2)])
    return FatalFault(pid=pid, address=f.address, access=ACCESS_TYPES.get(f.accessType, "?"),
                      fault_type=FAULT_TYPES.get(f.faultType, "?"),
                      reason=FATAL_REASONS.get(f.reason, "?"), timestamp_ns=f.timeStamp)


class TrackerError(OSError):
    """A tracker could not be made (not root, no tools device, an older driver)."""


@dataclass
class _Tracker:
    tools_fd: int
    uvm_fd: int  # our copy of the process's uvm file
    queue: Queue

    def close(self) -> None:
        os.close(self.tools_fd)  # first: the driver unpins the queue then
        os.close(self.uvm_fd)
        self.queue.close()


@dataclass
class _Process:
    pidfd: int
    trackers: list[_Tracker]
    fds: frozenset[int]  # its uvm fd numbers already tracked


class FaultTrackers:
    """Fatal-fault trackers on the VA spaces of chosen processes.

    track(pids) follows exactly these processes: trackers for any uvm file they opened
    since, none kept for a process that exited or left the set. poll() returns the fatal
    faults recorded since, each naming the process whose VA space took it. Needs root
    (pidfd_getfd needs ptrace rights over the process). Not thread-safe."""

    def __init__(self, entries: int = 64):
        self.sys = Sys()
        self.entries = entries
        self.major = uvm_major()
        self.procs: dict[int, _Process] = {}  # those with a tracker
        self.failed: dict[int, str] = {}  # pid -> why it has no tracker (said once)
        self.late: list[FatalFault] = []  # read from a process's trackers as they closed
        self._closing: list[_Process] = []  # dropped, for the closer thread
        self._closing_cv = threading.Condition()
        self._closer: threading.Thread | None = None

    def track(self, pids: Iterable[int]) -> list[str]:
        """Follow these processes; returns notes (why one could not be tracked, once each)."""
        want = set(pids)
        notes: list[str] = []
        for pid in [p for p in self.procs if p not in want or self._exited(p)]:
            self._drop(pid)
        for pid in want:
            fds = uvm_fds(pid, self.major)
            p = self.procs.get(pid)
            new = [fd for fd in fds if p is None or fd not in p.fds]
            if not new:
                continue
            try:
                if p is None:
                    p = self.procs[pid] = _Process(self.sys.pidfd_open(pid), [], frozenset())
                for fd in new:
                    p.trackers.append(self._tracker(p.pidfd, fd))
                    p.fds = p.fds | {fd}
            except OSError as exc:
                if self.failed.get(pid) != str(exc):
                    self.failed[pid] = str(exc)
                    notes.append(f"no fault tracker on pid {pid}: {exc}")
                if p is not None and not p.trackers:
                    # Not followed yet (its fds are tried again at the next call): a uvm
                    # file opened but not initialised yet refuses a tracker (NV_STATUS
                    # 0x16: on an H200, the benchmark's injectors 0.05-0.17 s before their
                    # faults, and standbys), and the supervisor looks sooner at a young
                    # process that is not in procs.
                    os.close(self.procs.pop(pid).pidfd)
        return notes

    def _tracker(self, pidfd: int, fd: int) -> _Tracker:
        local = self.sys.pidfd_getfd(pidfd, fd)
        try:
            tools = os.open(TOOLS_PATH, os.O_RDWR | os.O_CLOEXEC)
        except OSError:
            os.close(local)
            raise
        q = Queue(self.entries, 2)
        try:
            r = ioctl_struct(tools, UVM_TOOLS_INIT_EVENT_TRACKER_V2, InitEventTrackerParams(
                queueBuffer=q.qaddr, queueBufferSize=q.entries, controlBuffer=q.caddr, uvmFd=local))
            if r.rmStatus:
                raise TrackerError(errno.EINVAL, f"UVM_TOOLS_INIT_EVENT_TRACKER_V2: NV_STATUS 0x{r.rmStatus:x}")
            ioctl_struct(tools, UVM_TOOLS_SET_NOTIFICATION_THRESHOLD, SetThresholdParams(notificationThreshold=1))
            r = ioctl_struct(tools, UVM_TOOLS_EVENT_QUEUE_ENABLE_EVENTS,
                             EnableEventsParams(eventTypeFlags=1 << EVENT_FATAL_FAULT))
            if r.rmStatus:
                raise TrackerError(errno.EINVAL, f"UVM_TOOLS_EVENT_QUEUE_ENABLE_EVENTS: NV_STATUS 0x{r.rmStatus:x}")
        except OSError:
            os.close(tools)
            os.close(local)
            q.close()
            raise
        return _Tracker(tools, local, q)

    def _exited(self, pid: int) -> bool:
        r, _, _ = select.select([self.procs[pid].pidfd], [], [], 0)
        return bool(r)

    def _drop(self, pid: int) -> None:
        """Let pid's trackers go (a fault it took just before it exited is kept for poll);
        the closer thread closes them (module doc: the close may be the VA space's teardown)."""
        self.late += self._read(pid)
        with self._closing_cv:
            self._closing.append(self.procs.pop(pid))
            if self._closer is None:
                self._closer = threading.Thread(target=self._close_dropped, daemon=True,
                                                name="gpuos-uvm-tracker-closer")
                self._closer.start()
            self._closing_cv.notify()

    def _close_dropped(self) -> None:
        while True:
            with self._closing_cv:
                while not self._closing:
                    self._closing_cv.wait()
                p = self._closing[0]
            for t in p.trackers:
                t.close()
            os.close(p.pidfd)
            with self._closing_cv:
                self._closing.pop(0)
                self._closing_cv.notify_all()

    def wait_closed(self, timeout: float | None = None) -> bool:
        """Whether every dropped process's trackers are closed (waiting up to timeout)."""
        with self._closing_cv:
            return self._closing_cv.wait_for(lambda: not self._closing, timeout)

    def _read(self, pid: int) -> list[FatalFault]:
        out = []
        for t in self.procs[pid].trackers:
            if t.queue.pending():
                out += [f for f in (decode_fatal(raw, pid) for raw in t.queue.drain()) if f]
        return out

    def fds(self) -> list[int]:
        """The trackers' tools files: each readable once its queue holds an event."""
        return [t.tools_fd for p in self.procs.values() for t in p.trackers]

    def poll(self) -> list[FatalFault]:
        out, self.late = self.late, []
        for pid in self.procs:
            out += self._read(pid)
        return out

    def close(self, timeout: float = 10.0) -> None:
        """Let every tracker go, and wait up to timeout for their closes (a teardown the
        driver does not finish is left to the closer thread, which does not keep the
        program from exiting)."""
        for pid in list(self.procs):
            self._drop(pid)
        self.wait_closed(timeout)


def recorded_at(timestamp_ns: int, now: float | None = None, now_raw_ns: int | None = None) -> float:
    """When UVM recorded a fault, in seconds since the epoch: its timestamp is
    CLOCK_MONOTONIC_RAW (on an H200, consecutive faults' timestamps differed by their
    wall-clock spacing to the millisecond).  The time of reading instead when the
    timestamp is not plausible: none, in the future, or over an hour old."""
    now = time.time() if now is None else now
    raw = time.clock_gettime_ns(time.CLOCK_MONOTONIC_RAW) if now_raw_ns is None else now_raw_ns
    age = (raw - timestamp_ns) / 1e9
    return now - age if timestamp_ns > 0 and 0 <= age < 3600 else now


def fault_event(f: FatalFault) -> FaultEvent:
    """A fatal fault as the fault stream's event: the MMU fault RM reports as Xid 31, of
    f.pid for certain (its address space took it)."""
    return FaultEvent(
        xid=31, pci="", time=recorded_at(f.timestamp_ns), source=SOURCE, fault_class=FaultClass.MEMORY,
        action="the process whose address space took the fault: the faulter, under MPS too",
        pid=f.pid, process=procs.comm(f.pid),
        mmu=MmuFault(engine="GPC (replayable)", address=f.address, fault_type=f.fault_type,
                     access_type=f.access),
        text=f"fatal GPU fault in the address space of pid {f.pid}: {f.access} at {f.address:#x} "
             f"({f.fault_type}, {f.reason})",
        extra={"reason": f.reason, "timestamp_raw_ns": f.timestamp_ns},
        name="fatal GPU memory fault (UVM fault tracker)")


class TrackerFaultSource:
    """Fault trackers on every CUDA process, as FaultEvents from a thread (like
    KmodFaultSource): every `every` seconds the processes `pids` gives (all of them) are
    looked at, and those with a /dev/nvidia-uvm file are followed (FaultTrackers.track)."""

    def __init__(self, every: float = 0.5, pids: Callable[[], Iterable[int]] = procs.all_pids) -> None:
        if os.geteuid() != 0:
            raise PermissionError(errno.EPERM, "fault trackers need root (pidfd_getfd of other processes)")
        if not os.path.exists(TOOLS_PATH):
            raise FileNotFoundError(errno.ENOENT, f"{TOOLS_PATH} does not exist (no nvidia-uvm)")
        self.trackers = FaultTrackers()
        self.every = every
        self.pids = pids
        self.error: str | None = None  # why the thread stopped, if it did
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, callback: Callable[[FaultEvent], None]) -> None:
        self._thread = threading.Thread(target=self._run, args=(callback,), name="gpuos-uvm-trackers",
                                        daemon=True)
        self._thread.start()

    def _run(self, callback: Callable[[FaultEvent], None]) -> None:
        try:
            next_scan = 0.0
            while not self._stop.is_set():
                for f in self.trackers.poll():
                    callback(fault_event(f))
                if time.monotonic() >= next_scan:
                    next_scan = time.monotonic() + self.every
                    self.trackers.track(self.pids())  # a process it cannot follow: left out
                self._stop.wait(0.05)
        except Exception as exc:  # noqa: BLE001 - said once by the stream; the others go on
            self.error = f"UVM fault trackers: {exc}"

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        self.trackers.close()
