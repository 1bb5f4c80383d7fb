"""Fault events for the MPS supervisor.

Three kinds of source, all optional:

- the fault stream of gpuos.faults (kernel log Xid lines and NVML events, classified
  and joined: faults/watch.py), read in the supervisor's loop;
- fault trackers on the clients' VA spaces (faults/uvm_tools.py, root): a fatal MMU
  fault there names the faulting client for certain, which the Xid line need not;
- feed files (`gpuos mps start --fault-feed FILE`): JSON lines of fault events as
  `gpuos faults watch --json` prints them or the fault journal stores them, followed
  from where the last supervisor stopped reading (the offsets are in the state file).

Nothing is dropped: a line that is not a fault event the supervisor understands
becomes an event of class "unknown" carrying its text.
"""

from __future__ import annotations

import ctypes
import json
import os
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Protocol

from .. import procs
from .gpu import GpuRef
from .store import tail


class FaultSource(Protocol):
    """What the supervisor needs of a source: poll() -> (fault dicts, notes); fds(), readable
    when poll may have something (the supervisor wakes on them); close()."""

    def poll(self) -> tuple[list[dict], list[str]]: ...
    def fds(self) -> list[int]: ...
    def close(self) -> None: ...


def _norm_pci(pci: str) -> str:
    try:
        from ..faults.kmsg import normalize_pci
        return normalize_pci(pci)
    except ImportError:  # pragma: no cover - the faults package is part of gpuos
        return pci.strip().lower()


def gpu_match(ev: dict, gpu: GpuRef) -> bool | None:
    """Whether a fault event names gpu: True, False, or None when it cannot be told."""
    uuid, pci = ev.get("gpu_uuid"), ev.get("pci")
    if uuid and gpu.uuid:
        return str(uuid).lower() == gpu.uuid.lower()
    if pci and gpu.pci:
        return _norm_pci(str(pci)) == _norm_pci(gpu.pci)
    return None


def event_dict(ev: Any) -> dict:
    """A FaultEvent (or a dict of one) as a plain dict with fault_class a string."""
    if isinstance(ev, dict):
        d = dict(ev)
    elif hasattr(ev, "to_json"):
        d = ev.to_json()
    else:
        from dataclasses import asdict
        d = asdict(ev)
    fc = d.get("fault_class")
    d["fault_class"] = getattr(fc, "value", fc) or "unknown"
    return d


def unknown_event(text: str, source: str, **extra: Any) -> dict:
    return {"xid": None, "fault_class": "unknown", "source": source, "text": text,
            "pci": "", "action": "reported; not understood by the MPS supervisor", "extra": extra}


def parse_feed_line(line: str, source: str) -> dict | None:
    """One feed line as a fault dict; None for records that are not faults (journal notes)."""
    line = line.strip()
    if not line:
        return None
    try:
        rec = json.loads(line)
    except ValueError:
        return unknown_event(line, source)
    if not isinstance(rec, dict):
        return unknown_event(line, source)
    kind = rec.get("type")
    if kind == "kmsg-gap":
        return unknown_event(f"kernel log records lost (seq {rec.get('first')}..{rec.get('last')})",
                             source, kmsg_gap=rec)
    if kind not in (None, "fault"):
        return None  # another writer's record in the fault journal (e.g. our own "mps-...")
    if "xid" not in rec and "fault_class" not in rec:
        return unknown_event(line, source)
    try:
        from ..faults.model import FaultEvent
        from ..faults.xid import classify
        fields = dict(rec)
        fields.setdefault("pci", "")
        fields.setdefault("time", 0.0)
        fields.setdefault("source", source)
        fields.setdefault("action", "")
        had_class = fields.get("fault_class") not in (None, "")
        ev = FaultEvent.from_json(fields)
        if not had_class and ev.xid is not None:
            ev = classify(ev)
        d = ev.to_json()
    except Exception:  # an older or newer shape: keep what it says
        d = dict(rec)
        d.setdefault("fault_class", "unknown")
    d.pop("type", None)
    return event_dict(d)


class DirWatch:
    """inotify on directories: its fd is readable once a file in them was written, made or
    moved in (Linux; where inotify is missing, fd is -1 and the poll interval does)."""

    IN_MODIFY, IN_MOVED_TO, IN_CREATE = 0x2, 0x80, 0x100

    def __init__(self, dirs: Iterable[str]):
        self.fd = -1
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        except (OSError, AttributeError):
            return
        if fd < 0:
            return
        for d in dirs:  # a directory that cannot be watched: its files wait for the poll
            libc.inotify_add_watch(fd, os.fsencode(d), self.IN_MODIFY | self.IN_MOVED_TO | self.IN_CREATE)
        self.fd = fd

    def drain(self) -> None:
        while self.fd >= 0:
            try:
                if not os.read(self.fd, 65536):
                    return
            except BlockingIOError:
                return

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class FeedFiles:
    """Follows JSON-lines files of fault events from stored byte offsets; their directories
    watched (DirWatch), so that a new event wakes the supervisor."""

    def __init__(self, paths: list[str], offsets: dict[str, int] | None = None):
        self.paths = [str(Path(p).absolute()) for p in paths]
        self.watch = DirWatch(sorted({os.path.dirname(p) for p in self.paths}))
        self.offsets: dict[str, int] = dict(offsets or {})
        for p in self.paths:
            if p not in self.offsets:  # first time: from the end, history is not news
                try:
                    self.offsets[p] = os.path.getsize(p)
                except OSError:
                    self.offsets[p] = 0

    def poll(self) -> tuple[list[dict], list[str]]:
        self.watch.drain()  # before reading: a write after this wakes the next turn
        out: list[dict] = []
        notes: list[str] = []
        for p in self.paths:
            off = self.offsets.get(p, 0)
            try:
                size = os.path.getsize(p)
            except OSError:
                continue
            if size < off:
                notes.append(f"fault feed {p} shrank (rotated or truncated): reading it from its start")
                off = 0
            for off, line in tail(Path(p), off):
                ev = parse_feed_line(line, f"feed:{p}")
                if ev is not None:
                    out.append(ev)
            self.offsets[p] = off
        return out, notes

    def fds(self) -> list[int]:
        return [self.watch.fd] if self.watch.fd >= 0 else []

    def close(self) -> None:
        self.watch.close()


class StreamSource:
    """gpuos.faults.watch.FaultStream on the kernel log and/or NVML, polled without waiting."""

    def __init__(self, kmsg: bool, nvml: bool):
        from ..faults import kmsg as kmsg_mod
        from ..faults.nvml import NvmlSource, NvmlUnavailable
        from ..faults.watch import FaultStream
        self.notes: list[str] = []
        klog = nv = None
        if kmsg:
            try:
                klog = kmsg_mod.open_kernel_log()
            except kmsg_mod.KernelLogUnavailable as exc:
                self.notes.append(f"kernel log unavailable: {exc.message}")
        if nvml:
            try:
                nv = NvmlSource()
            except NvmlUnavailable as exc:
                self.notes.append(f"NVML events unavailable: {exc}")
        # settle 0: an Xid is acted on as soon as its first lines are read, not once its
        # lines have been quiet for faults.watch's 0.25 s (the standbys' take-over waits for
        # it); a line of it read later is one more event, an echo to the machine (state._echo).
        self.stream = FaultStream(klog, nv, settle=0.0) if (klog or nv) else None

    def poll(self) -> tuple[list[dict], list[str]]:
        notes, self.notes = self.notes, []
        if self.stream is None:
            return [], notes
        from ..faults.kmsg import KmsgGap
        from ..faults.watch import Notice
        out: list[dict] = []
        for item in self.stream.poll(0):
            if isinstance(item, KmsgGap):
                out.append(unknown_event(item.describe(), "kmsg", kmsg_gap=item.to_json()))
            elif isinstance(item, Notice):
                notes.append(item.text)
            else:
                out.append(event_dict(item))
        return out, notes

    def fds(self) -> list[int]:
        return self.stream.fds() if self.stream is not None else []

    def close(self) -> None:
        if self.stream is not None:
            self.stream.close()


class TrackerSource:
    """Fatal faults that UVM's tools trackers on the clients' VA spaces took
    (gpuos.faults.uvm_tools: root, stock driver): each names the faulting process for
    certain. `pids` gives the processes to follow at each poll (the server's clients)."""

    def __init__(self, pids: Callable[[], Iterable[int]], trackers: Any = None):
        if trackers is None:
            from ..faults.uvm_tools import FaultTrackers
            trackers = FaultTrackers()
        self.pids = pids
        self.trackers = trackers
        self.untracked: list[int] = []  # followed, but no tracker yet (no CUDA context yet)

    def poll(self) -> tuple[list[dict], list[str]]:
        from ..faults.uvm_tools import fault_event
        faults = [event_dict(fault_event(f)) for f in self.trackers.poll()]
        pids = list(self.pids())
        notes = self.trackers.track(pids)  # after the poll: a leaver's faults are kept
        self.untracked = [p for p in pids if p not in self.trackers.procs]
        return faults, notes

    def fds(self) -> list[int]:
        return self.trackers.fds()

    def close(self) -> None:
        self.trackers.close()


PEER_YOUNG_S = 2.0  # a process this young may still exec: its environment is read again


class MpsPeers:
    """Processes whose environment names one of the supervisor's pipe directories as
    CUDA_MPS_PIPE_DIRECTORY: clients of its servers, those gpuos did not start included,
    found at each scan instead of at the next MPS client list (every status_poll
    seconds), so that a fault tracker follows them from their first CUDA call.  Measured
    on an H200: the benchmark's injector, such a client, faulted 0.4 s after it started,
    before any client list showed it; the supervisor's incident then went by NVML's Xid,
    which named a victim, 0.13 s after the fault, while a tracker had it in 6 ms.

    A process's environment is read at each scan while the scan has known it for less
    than PEER_YOUNG_S (a fork may still exec), then its answer is kept until it is gone:
    a scan reads only /proc's listing and the new processes' environments."""

    def __init__(self, pipe_dirs: Iterable[str], proc: Path = Path("/proc"),
                 clock: Callable[[], float] = time.monotonic):
        self.pipe_dirs = frozenset(pipe_dirs)
        self.proc = proc
        self.clock = clock
        self.seen: dict[int, tuple[float, bool]] = {}  # pid -> (first seen, names a pipe of ours)

    def scan(self) -> list[int]:
        now = self.clock()
        try:
            names = os.listdir(self.proc)
        except OSError:
            return []
        out, alive = [], set()
        for name in names:
            if not name.isdigit():
                continue
            pid = int(name)
            alive.add(pid)
            first, ours = self.seen.get(pid, (now, False))
            if pid not in self.seen or now - first < PEER_YOUNG_S:
                ours = self._names_ours(pid)
                self.seen[pid] = (first, ours)
            if ours:
                out.append(pid)
        for pid in self.seen.keys() - alive:
            del self.seen[pid]
        return out

    def _names_ours(self, pid: int) -> bool:
        env = procs.read_environ(pid, self.proc)  # None: gone, or not ours to read
        return env is not None and env.get("CUDA_MPS_PIPE_DIRECTORY") in self.pipe_dirs


def client_of(pid: int | None, clients: set[int]) -> int | None:
    """The client a process that is not one belongs to: the one whose session it runs in
    (gpuos starts each client in a session of its own), else the nearest of its ancestors
    (a child that made a session of its own), so that a fault of a client's child (a
    shell's, a launcher's worker) names that client; None if none does, or the process is
    gone."""
    if pid is None or pid in clients:
        return None
    p = pid
    for depth in range(64):  # ancestors: far fewer in practice; a bound against a loop
        try:
            st = procs.stat(p)
        except (procs.NoSuchProcess, OSError, ValueError, IndexError):
            return None
        if depth == 0 and st.session in clients:
            return st.session
        if st.ppid in clients:
            return st.ppid
        if st.ppid <= 1:
            return None
        p = st.ppid
    return None


def open_sources(feeds: list[str], offsets: dict[str, int], kmsg: bool, nvml: bool,
                 note: Callable[[str], None], tracked: Callable[[], Iterable[int]] | None = None
                 ) -> tuple[list[FaultSource], FeedFiles | None]:
    """The supervisor's sources; with `tracked`, fault trackers on those processes (root)."""
    sources: list[FaultSource] = []
    files = FeedFiles(feeds, offsets) if feeds else None
    if files is not None:
        sources.append(files)
    if kmsg or nvml:
        try:
            sources.append(StreamSource(kmsg, nvml))
        except ImportError as exc:  # pragma: no cover - the faults package is part of gpuos
            note(f"fault stream unavailable: {exc}")
    if tracked is not None:
        if os.geteuid() != 0:
            note("fault trackers need root: the faulting client is not named")
        else:
            try:
                sources.append(TrackerSource(tracked))
            except OSError as exc:
                note(f"fault trackers unavailable: {exc}")
    if not sources:
        note("no fault source: incidents are found from server and client exits only")
    return sources, files
