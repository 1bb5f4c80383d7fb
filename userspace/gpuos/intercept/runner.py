"""`gpuos run`: start a command with libgpuos preloaded and serve its control socket.

Every process of the command's tree that makes a CUDA driver call connects to our
socket (GPUOS_CTL, in a fresh 0700 directory) and hands us its ring (libgpuos/include/
gpuos_ctl.h).  We check each peer with SO_PEERCRED, keep the rings, and when asked
drain them into the launch log and the validation summary.  We only read the rings: a
slow `gpuos run` loses log records (counted in the report), it never slows the
application down.
"""

from __future__ import annotations

import errno
import os
import selectors
import shutil
import signal
import socket
import struct
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..errors import GpuosError, LibgpuosMissing
from . import ring as R
from ..managed import AheadFeeder
from .log import LaunchLogWriter
from .report import ProcessReport, ValidationSummary

CTL_MAGIC = 0x4C54434F
CTL_VERSION = 1
CTL_VALIDATE = 1
HELLO = struct.Struct("<IIIIQII256s")
REPLY = struct.Struct("<II")
DRAIN_INTERVAL_S = 0.05
# Slots when nobody drains the ring (no --log, no --validate): a ring that stays in the
# CPU's caches costs each launch less; `gpuos trace launches` still sees the recent past.
UNDRAINED_RING_SLOTS = 1 << 16


def libgpuos_path() -> Path:
    """The libgpuos.so to preload: $GPUOS_LIBGPUOS, else the one shipped in the package."""
    env = os.environ.get("GPUOS_LIBGPUOS")
    path = Path(env) if env else Path(__file__).resolve().parent.parent / "_native" / "libgpuos.so"
    if not path.is_file():
        raise LibgpuosMissing(
            f"libgpuos.so not found at {path}"
            + ("" if env else " (build it: pip install the gpuos checkout, or make -C libgpuos)"))
    return path


@dataclass
class RunOptions:
    cmd: list[str]
    log: Path | None = None
    validate: bool = False
    touched: bool = False  # validation measures what launches touch (GPUOS_VALIDATE=touched, touched.c)
    touch_all: list[str] = field(default_factory=list)
    dump_params: list[str] = field(default_factory=list)
    ring_slots: int | None = None
    record_cpus: str | None = None
    lib: Path | None = None
    paused: bool = False  # every process starts with ops_paused set
    memory: str = "movable"  # GPUOS_MEMORY: "movable" (libgpuos/src/memory.c) or "driver"
    gpu_memory: int | None = None  # GPUOS_GPU_MEMORY: bytes of movable memory resident at most (resident.c)
    evict: str = "future"  # GPUOS_GPU_MEMORY_EVICT: "future" (learned sequence) or "lru"
    share: str | None = None  # GPUOS_SHARE: the group sharing the pool (share.c)
    slice_ms: int | None = None  # GPUOS_SHARE_SLICE_MS: a new group's time slice
    managed_ahead: bool = False  # feed managed memory's working sets to the patched driver (managed/)


@dataclass
class Tracked:
    """One process of the command's tree that connected."""

    pid: int
    ppid: int
    exe: str
    conn: socket.socket
    ring: R.Ring
    reader: R.RingReader | None
    logged_funcs: set[int] = field(default_factory=set)
    ended: bool = False
    feeder: AheadFeeder | None = None


@dataclass
class RunResult:
    cmd: list[str]
    returncode: int
    wall_s: float
    processes: list[ProcessReport]
    validation: ValidationSummary | None
    log_records: int
    log_lost: int  # records the log could not get (the ring lapped us, or torn copies)
    # --managed-ahead: {"why_not": str | None, "processes": {pid: {"as_id", **Stats}}}
    managed_ahead: dict | None = None

    def to_json(self) -> dict:
        return {"cmd": self.cmd, "returncode": self.returncode, "wall_s": round(self.wall_s, 3),
                "processes": [asdict(p) for p in self.processes],
                "validation": self.validation.to_json() if self.validation else None,
                "log_records": self.log_records, "log_lost": self.log_lost,
                "managed_ahead": self.managed_ahead}


def _check_cmd(cmd: list[str]) -> None:
    if not cmd:
        raise GpuosError("no command given (gpuos run -- CMD ARGS...)")
    if "/" not in cmd[0] and shutil.which(cmd[0]) is None:
        raise GpuosError(f"command not found: {cmd[0]}")


class Supervisor:
    def __init__(self, opts: RunOptions):
        _check_cmd(opts.cmd)
        self.opts = opts
        self.lib = opts.lib or libgpuos_path()
        if any(c in str(self.lib) for c in " :"):
            raise GpuosError(f"libgpuos path {self.lib} has a space or colon; LD_PRELOAD cannot name it")
        self.drain = opts.log is not None or opts.validate or opts.managed_ahead
        self.kernel = None  # --managed-ahead: gpuos.ko's netlink client, and its events
        self.events = None
        self.ahead_why_not: str | None = None
        self.procs: dict[int, Tracked] = {}
        self.summary = ValidationSummary(touched=opts.touched) if opts.validate else None
        self.log: LaunchLogWriter | None = None
        self.sel = selectors.DefaultSelector()

    def _env(self, ctl: Path) -> dict[str, str]:
        env = dict(os.environ)
        pre = env.get("LD_PRELOAD", "").strip()
        env["LD_PRELOAD"] = f"{self.lib} {pre}".strip()
        # ASan refuses to start when a preload comes before its runtime; libgpuos defines
        # no allocation function, so the order changes nothing ASan intercepts.
        asan = env.get("ASAN_OPTIONS", "")
        if "verify_asan_link_order" not in asan:
            env["ASAN_OPTIONS"] = f"{asan}:verify_asan_link_order=0".lstrip(":")
        env["GPUOS_CTL"] = str(ctl)
        for var in ("GPUOS_VALIDATE", "GPUOS_TOUCH_ALL", "GPUOS_DUMP_PARAMS", "GPUOS_RING_SLOTS", "GPUOS_GPU_MEMORY",
                    "GPUOS_GPU_MEMORY_EVICT", "GPUOS_SHARE", "GPUOS_SHARE_SLICE_MS"):
            env.pop(var, None)  # only what this run asks for
        env["GPUOS_MEMORY"] = self.opts.memory
        if self.opts.gpu_memory:
            env["GPUOS_GPU_MEMORY"] = str(self.opts.gpu_memory)
            env["GPUOS_GPU_MEMORY_EVICT"] = self.opts.evict
        if self.opts.share:
            env["GPUOS_SHARE"] = self.opts.share
        if self.opts.slice_ms:
            env["GPUOS_SHARE_SLICE_MS"] = str(self.opts.slice_ms)
        if self.opts.validate:
            env["GPUOS_VALIDATE"] = "touched" if self.opts.touched else "1"
        if self.opts.touch_all:
            env["GPUOS_TOUCH_ALL"] = ",".join(self.opts.touch_all)
        if self.opts.dump_params:
            env["GPUOS_DUMP_PARAMS"] = ",".join(self.opts.dump_params)
        slots = self.opts.ring_slots or (None if self.drain else UNDRAINED_RING_SLOTS)
        if slots:
            env["GPUOS_RING_SLOTS"] = str(slots)
        if self.opts.record_cpus:
            env["GPUOS_RECORD_CPUS"] = self.opts.record_cpus
        return env

    def run(self) -> RunResult:
        tmp = Path(tempfile.mkdtemp(prefix="gpuos-run-"))  # mode 0700
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        ctl = tmp / "ctl.sock"
        old = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
        try:
            listener.bind(str(ctl))
            listener.listen(64)
            listener.setblocking(False)
            self.sel.register(listener, selectors.EVENT_READ, "listen")
            if self.opts.log:
                try:
                    self.log = LaunchLogWriter(self.opts.log, self.opts.cmd, self.opts.validate)
                except OSError as exc:
                    raise GpuosError(f"cannot write the log {self.opts.log}: {exc.strerror}") from exc
            if self.opts.managed_ahead:
                self._open_kernel()
            start = time.monotonic()
            try:
                child = subprocess.Popen(self.opts.cmd, env=self._env(ctl))
            except OSError as exc:
                raise GpuosError(f"cannot start {self.opts.cmd[0]}: {exc.strerror}") from exc
            # Ctrl-C reaches the child through the terminal; we stay to write the report.
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            for s in (signal.SIGTERM, signal.SIGHUP):
                signal.signal(s, lambda sig, _f: child.send_signal(sig))
            rc = self._loop(child)
            wall = time.monotonic() - start
            return self._finish(rc, wall)
        finally:
            for s, h in old.items():
                signal.signal(s, h)
            for t in self.procs.values():
                t.conn.close()
            listener.close()
            self.sel.close()
            if self.events:
                self.events.close()
            if self.kernel:
                self.kernel.close()
            if self.log:
                self.log.close()
            shutil.rmtree(tmp, ignore_errors=True)

    def _loop(self, child: subprocess.Popen) -> int:
        pidfd = os.pidfd_open(child.pid)
        self.sel.register(pidfd, selectors.EVENT_READ, "child")
        try:
            while True:
                for key, _ in self.sel.select(DRAIN_INTERVAL_S if self.drain else None):
                    if key.data == "listen":
                        self._accept(key.fileobj)
                    elif key.data == "events":
                        self._events()
                    elif key.data == "child":
                        rc = child.wait()
                        self._drain_all()
                        return rc if rc >= 0 else 128 - rc
                    else:
                        self._conn_event(key.data)
                if self.drain:
                    self._drain_all()
        finally:
            self.sel.unregister(pidfd)
            os.close(pidfd)

    def _open_kernel(self) -> None:
        """gpuos.ko for --managed-ahead: its events (a fault names a process's address space)
        and its requests.  Without it the command runs as without the option, and says why."""
        from ..kernel.netlink import GpuosNetlink

        try:
            self.kernel = GpuosNetlink()
            self.events = self.kernel.subscribe()
        except GpuosError as exc:
            self.ahead_why_not = exc.message
            if self.kernel:
                self.kernel.close()
            self.kernel = None
            return
        self.sel.register(self.events, selectors.EVENT_READ, "events")

    def _events(self) -> None:
        try:
            while (ev := self.events.next(timeout=0)) is not None:
                for t in self.procs.values():
                    if t.feeder:
                        t.feeder.event(ev)
        except GpuosError as exc:  # gpuos.ko unloaded, say: no more address spaces learnt
            self.sel.unregister(self.events)
            self.ahead_why_not = self.ahead_why_not or exc.message

    def _accept(self, listener: socket.socket) -> None:
        try:
            conn, _ = listener.accept()
        except BlockingIOError:
            return
        try:
            self._handshake(conn)
        except (OSError, ValueError, R.RingError):
            conn.close()

    def _handshake(self, conn: socket.socket) -> None:
        conn.settimeout(5)
        cpid, cuid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
        msg, fds, _, _ = socket.recv_fds(conn, HELLO.size, 1)
        try:
            if cuid not in (os.getuid(), 0):
                raise ValueError(f"peer uid {cuid}")
            if len(msg) != HELLO.size or len(fds) != 1:
                raise ValueError("short hello")
            magic, version, pid, ppid, _size, _flags, _state, exe = HELLO.unpack(msg)
            if magic != CTL_MAGIC or version != CTL_VERSION or pid != cpid:
                conn.sendall(REPLY.pack(CTL_MAGIC, errno.EPROTO))
                raise ValueError("bad hello")
            ring = R.Ring(fds[0])
        finally:
            for fd in fds:
                os.close(fd)
        if self.opts.paused:  # before the reply: the process has recorded nothing yet
            R.set_ops_paused(pid, True)
        conn.sendall(REPLY.pack(CTL_MAGIC, 0))
        conn.setblocking(False)
        t = Tracked(pid, ppid, exe.split(b"\0", 1)[0].decode("utf-8", "replace"), conn, ring,
                    R.RingReader(ring, from_start=True) if self.drain else None)
        if self.opts.managed_ahead:  # GPU 0 of nvidia-uvm's numbering: one GPU per process for now
            t.feeder = AheadFeeder(pid, 0, self.kernel, why_not=self.ahead_why_not)
        self.procs[pid] = t
        self.sel.register(conn, selectors.EVENT_READ, t)
        if self.log:
            self.log.write({"type": "proc", "event": "start", "pid": pid, "ppid": ppid, "exe": t.exe})

    def _conn_event(self, t: Tracked) -> None:
        try:
            data = t.conn.recv(4096)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:  # the process exited (or closed its end)
            self.sel.unregister(t.conn)
            self._drain(t)
            self._end(t)

    def _end(self, t: Tracked) -> None:
        if t.ended:
            return
        t.ended = True
        if t.feeder:
            t.feeder.close()
        if self.log:
            h = t.ring.header()
            state, incomplete = self._state(t, h)
            self.log.write({"type": "proc", "event": "end", "pid": t.pid, "state": state,
                            "incomplete": incomplete, "reason": h.reason or None,
                            "counters": h.counters})

    @staticmethod
    def _state(t: Tracked, h: R.RingHeader) -> tuple[str, list[str]]:
        """on | incomplete | off, and why incomplete: the library's reasons, and this
        reader's own loss (the ring lapped it: records are missing from the log)."""
        reasons = h.incomplete_reasons
        if t.reader is not None and (t.reader.stats.skipped_slots or t.reader.stats.torn):
            reasons.append("reader-lapped")
        if h.state == R.TRACK_OFF:
            return "off", reasons
        return ("incomplete" if reasons else "on"), reasons

    def _drain_all(self) -> None:
        for t in self.procs.values():
            self._drain(t)

    def _name(self, t: Tracked, func: int | None) -> str:
        if func is None:
            return "?"
        fn = t.ring.function(func)
        return (fn.name if fn and fn.name else None) or f"function#{func}"

    def _drain(self, t: Tracked) -> None:
        if t.reader is None:
            return
        launches = []
        for rtype, flags, ts, tid, body in t.reader.poll():
            rec = R.decode(rtype, flags, ts, tid, body)
            if t.feeder and rtype == R.LAUNCH:
                launches.append(rec)
            func = rec.get("func")
            if self.summary is not None:
                if rtype == R.LAUNCH:
                    self.summary.launched(self._name(t, func))
                elif rtype == R.VALIDATE:
                    name = self._name(t, func) if rec["op"] == "launch" else f"({rec['op']})"
                    self.summary.add(name, rec)
            if self.log:
                if func is not None and func not in t.logged_funcs:
                    fn = t.ring.function(func)
                    if fn is not None:
                        t.logged_funcs.add(func)
                        self.log.write({"type": "function", "pid": t.pid, "id": fn.id,
                                        "handle": fn.handle, "name": fn.name,
                                        "nparams": fn.nparams, "params_bytes": fn.params_bytes})
                rec["pid"] = t.pid
                self.log.write(rec)
        if t.feeder and launches:
            t.feeder.records(launches)
            t.feeder.step()

    def _finish(self, rc: int, wall: float) -> RunResult:
        procs = []
        for t in self.procs.values():
            self._end(t)
            h = t.ring.header()
            counters = dict(h.counters, records_lost=h.lost, movable_fallbacks=h.movable_fallbacks)
            state, incomplete = self._state(t, h)
            procs.append(ProcessReport(t.pid, t.ppid, t.exe, state, h.reason or None, counters,
                                       incomplete, h.memory_mode))
        readers = [t.reader for t in self.procs.values() if t.reader]
        ahead = None
        if self.opts.managed_ahead:
            feeders = [t.feeder for t in self.procs.values() if t.feeder]
            ahead = {"why_not": self.ahead_why_not or next((f.why_not for f in feeders if f.why_not), None),
                     "processes": {str(f.pid): {"as_id": f.as_id, **asdict(f.stats)} for f in feeders}}
        return RunResult(self.opts.cmd, rc, wall, procs, self.summary,
                         log_records=sum(r.stats.records for r in readers),
                         log_lost=sum(r.stats.skipped_slots + r.stats.torn for r in readers),
                         managed_ahead=ahead)
