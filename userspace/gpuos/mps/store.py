"""The supervisor's files: its state (atomic rewrites), its event log, its lock.

state.json is replaced whole at every step: written beside and renamed over the old
one; a reader sees the old state or the new, never half of one.  A reader refuses a
format_version it does not know.  events.jsonl grows by one line per event.
supervisor.lock is flocked by the running supervisor; a lock that can be taken means
none runs.

Nothing is fsynced.  What the files describe (MPS daemons, clients, standbys) does not
outlive the machine: a killed supervisor is resumed from the page cache, and after a
reboot the state is set aside anyway (`gpuos mps start`, boot_id).  An fsync, on the
other hand, is time on the recovery's path: every step persists before it acts, so a
standby's release waited for the state file's two fsyncs and one per event before it
(about seven).  A state file that a crash of the machine left unreadable is set aside
like one from before the boot (StateStore.load).
"""

from __future__ import annotations

import fcntl
import json
import os
import shlex
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from ..errors import GpuosError
from ..locks import flock_within
from .gpu import MpsDirs

FORMAT_VERSION = 1


def boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _written_before_boot(path: Path) -> bool:
    try:
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return path.stat().st_mtime < time.time() - uptime
    except (OSError, ValueError, IndexError):
        return False


def write_atomic(path: Path, data: bytes, mode: int = 0o644) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    os.rename(tmp, path)


def write_json_atomic(path: Path, obj: Any, mode: int = 0o644) -> None:
    write_atomic(path, (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode(), mode)


@dataclass
class SavedState:
    """state.json: the machine's snapshot and what the runtime needs besides."""

    gpu: dict
    machine: dict
    boot_id: str = ""
    supervisor: dict | None = None        # {pid, starttime} of the supervisor that wrote it
    compute_mode: dict | None = None      # {previous, set}: what `--exclusive` changed
    options: dict | None = None           # runtime options: fault feeds, sources, poll
    updated: float = 0.0

    def to_dict(self) -> dict:
        return {"format_version": FORMAT_VERSION, "gpu": self.gpu, "machine": self.machine,
                "boot_id": self.boot_id, "supervisor": self.supervisor,
                "compute_mode": self.compute_mode, "options": self.options or {},
                "updated": self.updated}

    @classmethod
    def from_dict(cls, d: dict) -> "SavedState":
        v = d.get("format_version")
        if v != FORMAT_VERSION:
            raise GpuosError(f"MPS state file format_version {v!r} unknown to this gpuos "
                             f"(it reads {FORMAT_VERSION})")
        return cls(gpu=d["gpu"], machine=d["machine"], boot_id=d.get("boot_id", ""),
                   supervisor=d.get("supervisor"), compute_mode=d.get("compute_mode"),
                   options=d.get("options") or {}, updated=d.get("updated", 0.0))


class StateStore:
    def __init__(self, dirs: MpsDirs):
        self.dirs = dirs

    def load(self) -> SavedState | None:
        try:
            raw = self.dirs.state.read_text()
        except FileNotFoundError:
            return None
        try:
            return SavedState.from_dict(json.loads(raw))
        except (ValueError, KeyError, TypeError) as exc:
            if _written_before_boot(self.dirs.state):
                self.archive("unreadable-previous-boot")  # a crash of the machine cut it short
                return None
            raise GpuosError(f"{self.dirs.state}: not a gpuos MPS state file ({exc})") from None

    def save(self, st: SavedState) -> None:
        st.updated = time.time()
        write_json_atomic(self.dirs.state, st.to_dict())

    def archive(self, why: str) -> Path | None:
        """Move the state aside (state-<time>.json), e.g. one from before a reboot."""
        if not self.dirs.state.exists():
            return None
        dest = self.dirs.root / f"state-{time.strftime('%Y%m%dT%H%M%S')}-{why}.json"
        os.rename(self.dirs.state, dest)
        return dest


class EventLog:
    """events.jsonl, and a mirror (the fault journal) when one is given."""

    def __init__(self, path: Path, mirror: Callable[[dict], None] | None = None):
        self.path = path
        self.mirror = mirror
        self.mirror_error: str | None = None

    def append(self, event: dict) -> None:
        line = (json.dumps(event, sort_keys=True, default=str) + "\n").encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)
        if self.mirror is not None:
            try:
                self.mirror(event)
            except Exception as exc:  # the journal is a copy: never lose our own log for it
                self.mirror_error = str(exc)

    def read(self, last: int | None = None) -> list[dict]:
        try:
            lines = self.path.read_text().splitlines()
        except FileNotFoundError:
            return []
        out = []
        for ln in lines[-last:] if last else lines:
            try:
                out.append(json.loads(ln))
            except ValueError:
                out.append({"event": "unreadable-line", "text": ln})
        return out


def _fault_text(f: dict) -> str:
    xid = f"Xid {f.get('xid')}" if f.get("xid") is not None else "NVML"
    who = f" pid {f['pid']}" if f.get("pid") is not None else ""
    return f"{xid} {f.get('fault_class', 'unknown')}{who}"


def describe_event(ev: dict) -> str:
    """One event for people: time, incident, name, the fields that matter."""
    when = time.strftime("%H:%M:%S", time.localtime(ev.get("time", 0)))
    inc = f"[{ev['incident']}] " if ev.get("incident") else ""
    name = ev.get("event", "?")
    skip = {"time", "gpu", "event", "state", "incident"}
    if name in ("fault", "fault-other-gpu"):
        f = ev.get("fault") or {}
        detail = _fault_text(f) + (" (not known to be this GPU's)" if not ev.get("attributed", True)
                                   else "") + (" UNKNOWN Xid" if ev.get("unknown") else "")
    elif name == "incident-opened":
        detail = (f"cause {ev.get('cause')}; faults: "
                  f"{', '.join(_fault_text(f) for f in ev.get('faults', [])) or '-'}; victims: "
                  + (", ".join(f"{v['client'] or 'pid'} {v['pid']}" for v in ev.get("victims", []))
                     or "none"))
    elif name == "incident-closed":
        lost = [f"{v['client'] or v['pid']} {v['lost_s']:.1f} s" for v in ev.get("victims", [])
                if v.get("lost_s") is not None]
        detail = f"{ev.get('outcome')} in {ev.get('seconds')} s" + (
            f"; work lost: {', '.join(lost)}" if lost else "")
    elif name == "state":
        detail = f"{ev.get('previous')} -> {ev.get('state')}: {ev.get('why')}"
    else:
        detail = " ".join(f"{k}={shlex.join(v) if k == 'cmd' and isinstance(v, list) else v}"
                          for k, v in ev.items() if k not in skip and v not in (None, [], {}, ""))
    return f"{when} {inc}{name} {detail}".rstrip()


def tail(path: Path, start: int = 0) -> Iterator[tuple[int, str]]:
    """Complete lines of path from byte offset start: (offset after the line, line)."""
    try:
        with open(path, "rb") as f:
            f.seek(start)
            data = f.read()
    except FileNotFoundError:
        return
    pos = start
    while True:
        nl = data.find(b"\n", pos - start)
        if nl < 0:
            return
        line = data[pos - start:nl]
        pos = start + nl + 1
        yield pos, line.decode(errors="replace")


# -- the supervisor's lock -----------------------------------------------------------------

class SupervisorLock:
    """flock on supervisor.lock; the holder writes its pid in it."""

    def __init__(self, dirs: MpsDirs):
        self.dirs = dirs
        self.fd: int | None = None

    def try_acquire(self, patience: float = 1.0) -> bool:
        """Whether the lock was taken.  supervisor_pid() holds it shared for an instant
        to look (measured: a supervisor that tried during `gpuos mps start`'s look exited
        "another supervisor runs", in a fresh home): a lock held that briefly is waited
        for, up to `patience` seconds; a running supervisor holds it for good."""
        self.dirs.root.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.dirs.lock, os.O_RDWR | os.O_CREAT, 0o644)
        if not flock_within(fd, patience, 0.005):
            os.close(fd)
            return False
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        os.set_inheritable(fd, False)
        self.fd = fd
        return True

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def supervisor_pid(dirs: MpsDirs) -> int | None:
    """The pid of the supervisor holding dirs' lock, or None if none runs."""
    try:
        fd = os.open(dirs.lock, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                return int(os.pread(fd, 32, 0).split()[0])
            except (ValueError, IndexError):
                return -1
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)
