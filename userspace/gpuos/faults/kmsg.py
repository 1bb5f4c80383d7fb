"""The kernel log as a source of GPU faults: `NVRM: Xid` lines into FaultEvents.

Three layers:

- parsing: a /dev/kmsg record ("prio,seq,usec,flags;message" plus " KEY=value" lines)
  or a line of text (`dmesg`, `dmesg -r`, `journalctl -k`) into a LogRecord, and the
  message of an Xid line into its parts (parse_xid, parse_details);
- XidAssembler: Xid lines into events.  The driver prints one fault as several lines
  (Xid 13: one per SM that raised a warp exception, then "Graphics Exception: ESR
  ..."; Xid 45: one per channel of the process); lines of the same Xid on the same GPU
  close together (by sequence number and kernel time) and not naming another process
  or another MMU fault enrich the first line's event instead of making new ones;
- readers: KmsgReader follows /dev/kmsg (or a file of its records or of dmesg text),
  DmesgPoller runs `dmesg -r` now and then where /dev/kmsg cannot be opened.
  open_kernel_log picks one.
"""

from __future__ import annotations

import errno
import os
import re
import stat
import subprocess
import time
from dataclasses import dataclass, field
from typing import Callable, Union

from .model import FaultClass, FaultEvent, MmuFault
from .xid import classify

DEV_KMSG = "/dev/kmsg"


@dataclass
class LogRecord:
    """One kernel log record."""

    message: str
    seq: int | None = None          # /dev/kmsg's sequence number
    usec: int | None = None         # kernel timestamp: microseconds since boot
    level: int | None = None        # 0 (emerg) .. 7 (debug)
    fields: dict[str, str] = field(default_factory=dict)  # kmsg's KEY=value lines


@dataclass
class KmsgGap:
    """Records the kernel overwrote before we read them (/dev/kmsg said EPIPE).

    first..last are their sequence numbers, when known.  Faults among them are lost.
    """

    first: int | None
    last: int | None

    @property
    def count(self) -> int | None:
        if self.first is None or self.last is None:
            return None
        return self.last - self.first + 1

    def describe(self) -> str:
        if self.count is None:
            return "the kernel log overflowed: records were lost before they could be read " \
                   "(GPU faults among them are missing)"
        return f"the kernel log overflowed: missed {self.count} record" \
               f"{'s' if self.count != 1 else ''} (seq {self.first}..{self.last}; GPU faults " \
               "among them are missing)"

    def to_json(self) -> dict:
        return {"first": self.first, "last": self.last, "count": self.count}


# -- parsing ---------------------------------------------------------------------

_KMSG_HEADER = re.compile(r"^(\d+),(\d+),(\d+),[^;]*;")
_RAW_PREFIX = re.compile(r"^<(\d+)>")                       # dmesg -r
_TIMESTAMP = re.compile(r"^\[\s*(\d+)\.(\d+)\]\s?")          # dmesg
_ESCAPE = re.compile(r"\\x([0-9a-fA-F]{2})")


def _unescape(text: str) -> str:
    """/dev/kmsg writes non-printable bytes (and backslash) as \\xNN."""
    if "\\x" not in text:
        return text
    raw = _ESCAPE.sub(lambda m: chr(int(m.group(1), 16)), text)
    return raw.encode("latin-1", "replace").decode("utf-8", "replace")


def parse_kmsg_record(raw: bytes | str) -> LogRecord | None:
    """A record as read(2) from /dev/kmsg returns it; None if it is not one."""
    text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
    lines = text.split("\n")
    m = _KMSG_HEADER.match(lines[0])
    if not m:
        return None
    prio, seq, usec = int(m.group(1)), int(m.group(2)), int(m.group(3))
    fields = {}
    for line in lines[1:]:
        if line.startswith(" ") and "=" in line:
            k, _, v = line[1:].partition("=")
            fields[k] = _unescape(v)
    return LogRecord(message=_unescape(lines[0][m.end():]), seq=seq, usec=usec,
                     level=prio & 7, fields=fields)


def parse_text_line(line: str) -> LogRecord:
    """A line of `dmesg`, `dmesg -r`, `journalctl -k` or any other text."""
    line = line.rstrip("\n")
    level = None
    m = _RAW_PREFIX.match(line)
    if m:
        level = int(m.group(1)) & 7
        line = line[m.end():]
    usec = None
    m = _TIMESTAMP.match(line)
    if m:
        usec = int(m.group(1)) * 1_000_000 + int(m.group(2).ljust(6, "0")[:6])
        line = line[m.end():]
    return LogRecord(message=line, usec=usec, level=level)


def parse_line(text: bytes | str) -> LogRecord:
    """A /dev/kmsg record if it looks like one, else a line of text."""
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    return parse_kmsg_record(text) or parse_text_line(text)


@dataclass
class XidLine:
    """The parts of one `NVRM: Xid` line."""

    pci: str                        # "0000:00:06", lower case
    xid: int
    pid: int | None
    process: str | None
    message: str                    # what follows "pid=..., name=..., " (or the Xid number)
    gpu_instance: int | None = None     # MIG: "GPU-I:02"
    compute_instance: int | None = None  # MIG: "GPU-CI:01"


# NVRM: Xid (PCI:0000:00:06): 31, pid=574, name=python3, channel 0x0000000f, ...
# NVRM: Xid (PCI:0000:00:06 GPU-I:02 GPU-CI:01): 31, pid=..., name=..., ...   (MIG)
# NVRM: Xid (PCI:0000:3b:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.
# NVRM: Xid (PCI:0000:02:00): 13, Graphics SM Warp Exception on (GPC 1, TPC 0, SM 1): ...  (older)
# NVRM: Xid (0000:03:00): 14, Channel 00000001                                             (older)
_XID = re.compile(
    r"NVRM: Xid \((?:PCI:)?(?P<pci>[0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2})(?:\.[0-7])?"
    r"(?:\s+GPU-I:(?P<gi>\d+))?(?:\s+GPU-CI:(?P<ci>\d+))?[^)]*\):\s*(?P<xid>\d+)(?:,\s*(?P<rest>.*))?$")
_PID = re.compile(r"^pid=(?P<pid>'<unknown>'|<unknown>|\d+)(?:,\s*name=(?P<name>[^,]*?))?"
                  r"(?:,\s*(?P<rest>.*))?$")

_CHANNEL = re.compile(r"\b(?:channel|Channel|Ch|ChID|ChId)\s+(?:0x)?(?P<ch>[0-9a-fA-F]+)\b")
_INTR = re.compile(r"\bintr\s+(?P<intr>[0-9a-fA-F]+)\b")
_MMU = re.compile(r"MMU Fault: ENGINE (?P<engine>.+?) faulted @ (?:0x)?(?P<addr>[0-9a-fA-F_]+)\. "
                  r"Fault is of type (?P<type>\w+) (?P<access>\w+)")
_SM = re.compile(r"Graphics SM (?P<kind>Warp|Global) Exception on \(GPC (?P<gpc>\d+), TPC (?P<tpc>\d+), "
                 r"SM (?P<sm>\d+)\):\s*(?P<error>.*)$")
_ESR = re.compile(r"Graphics Exception: ESR (?P<esr>.*)$")
_RECOVERY = re.compile(r"recovery action changed from (?P<from_code>0x[0-9a-fA-F]+) \((?P<from>[^)]*)\) "
                       r"to (?P<to_code>0x[0-9a-fA-F]+) \((?P<to>[^)]*)\)")


def normalize_pci(pci: str) -> str:
    """"00000000:3B:00.0" (NVML), "0000:3b:00" (the driver) -> "0000:3b:00"."""
    parts = pci.strip().lower().split(":")
    if len(parts) != 3:
        return pci.strip().lower()
    domain, bus, dev = parts
    dev = dev.split(".")[0]
    try:
        return f"{int(domain, 16):04x}:{int(bus, 16):02x}:{int(dev, 16):02x}"
    except ValueError:
        return pci.strip().lower()


def parse_xid(message: str) -> XidLine | None:
    """The parts of an Xid line, or None if the message is not one."""
    m = _XID.search(message)
    if not m:
        return None
    rest = (m.group("rest") or "").strip()
    pid = process = None
    p = _PID.match(rest)
    if p:
        if p.group("pid").isdigit():
            pid = int(p.group("pid"))
        name = (p.group("name") or "").strip()
        process = None if name in ("<unknown>", "'<unknown>'", "") else name
        rest = (p.group("rest") or "").strip()
    return XidLine(pci=normalize_pci(m.group("pci")), xid=int(m.group("xid")), pid=pid,
                   process=process, message=rest,
                   gpu_instance=int(m.group("gi")) if m.group("gi") else None,
                   compute_instance=int(m.group("ci")) if m.group("ci") else None)


def parse_details(message: str) -> dict:
    """What the message of an Xid line tells: channel, intr, mmu, sm, esr, recovery."""
    out: dict = {}
    mmu = _MMU.search(message)
    if mmu:
        out["mmu"] = MmuFault(engine=mmu.group("engine").strip(),
                              address=int(mmu.group("addr").replace("_", ""), 16),
                              fault_type=mmu.group("type"), access_type=mmu.group("access"))
    ch = _CHANNEL.search(message)
    if ch:
        out["channel"] = int(ch.group("ch"), 16)
    intr = _INTR.search(message)
    if intr:
        out["intr"] = intr.group("intr")
    sm = _SM.search(message)
    if sm:
        out["sm"] = {"kind": sm.group("kind").lower(), "gpc": int(sm.group("gpc")),
                     "tpc": int(sm.group("tpc")), "sm": int(sm.group("sm")),
                     "error": sm.group("error").strip().rstrip(".")}
    esr = _ESR.search(message)
    if esr:
        out["esr"] = esr.group("esr").strip()
    rec = _RECOVERY.search(message)
    if rec:
        out["recovery_action"] = rec.group("to")
        out["recovery_action_from"] = rec.group("from")
    return out


# -- assembling lines into events -------------------------------------------------

MAX_TEXT_LINES = 32      # lines of raw text kept per event (all are counted)


@dataclass
class _Open:
    event: FaultEvent
    last_seq: int | None
    last_usec: int | None
    opened: float            # clock() when its first line came
    last: float              # clock() when its last line came
    lines: int = 1


class XidAssembler:
    """Kernel log records in, FaultEvents out, continuation lines merged.

    feed() takes each record (other lines are ignored) and returns the events it
    closed; flush() returns those quiet for `settle` seconds of `clock`; drain()
    returns every open one.  A line continues an open event of the same GPU and Xid
    when its sequence number is at most `max_seq_gap` past the event's last line
    (and its kernel time at most `max_usec_gap` after it), it names no other pid,
    and it brings no second MMU fault.  An event stays open at most `max_open`
    seconds.  Times: the kernel's timestamp turned into wall time with `boot_time`
    (time.time() at boot), else `wall()`.
    """

    def __init__(self, *, boot_time: float | None = None, settle: float = 0.25,
                 clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time, max_seq_gap: int = 16,
                 max_usec_gap: int = 1_000_000, max_open: float = 2.0):
        self.boot_time = boot_time_estimate() if boot_time is None else boot_time
        self.settle, self.clock, self.wall = settle, clock, wall
        self.max_seq_gap, self.max_usec_gap, self.max_open = max_seq_gap, max_usec_gap, max_open
        self._open: dict[tuple[str, int], _Open] = {}

    def feed(self, rec: LogRecord) -> list[FaultEvent]:
        line = parse_xid(rec.message)
        if line is None:
            return []
        now = self.clock()
        details = parse_details(line.message)
        key = (line.pci, line.xid)
        done: list[FaultEvent] = []
        cur = self._open.get(key)
        if cur is not None and self._continues(cur, rec, line, details, now):
            self._merge(cur, rec, line, details, now)
            return done
        if cur is not None:
            done.append(self._close(key))
        self._open[key] = _Open(self._new_event(rec, line, details), rec.seq, rec.usec, now, now)
        return done

    def flush(self) -> list[FaultEvent]:
        now = self.clock()
        quiet = [k for k, o in self._open.items()
                 if now - o.last >= self.settle or now - o.opened >= self.max_open]
        return [self._close(k) for k in sorted(quiet, key=lambda k: self._open[k].opened)]

    def drain(self) -> list[FaultEvent]:
        keys = sorted(self._open, key=lambda k: self._open[k].opened)
        return [self._close(k) for k in keys]

    @property
    def pending(self) -> int:
        return len(self._open)

    # -- inside
    def _time(self, rec: LogRecord) -> float:
        if rec.usec is not None and self.boot_time is not None:
            return self.boot_time + rec.usec / 1e6
        return self.wall()

    def _new_event(self, rec: LogRecord, line: XidLine, details: dict) -> FaultEvent:
        extra: dict = {"lines": 1}
        if line.gpu_instance is not None:
            extra["gpu_instance"] = line.gpu_instance
        if line.compute_instance is not None:
            extra["compute_instance"] = line.compute_instance
        for k in ("intr", "esr", "recovery_action", "recovery_action_from"):
            if k in details:
                extra[k] = details[k]
        if "sm" in details:
            extra["sm_errors"] = [details["sm"]]
        if "channel" in details:
            extra["channels"] = [details["channel"]]
        ev = FaultEvent(xid=line.xid, pci=line.pci, time=self._time(rec), source="kmsg",
                        fault_class=FaultClass.UNKNOWN, action="", pid=line.pid,
                        process=line.process, channel=details.get("channel"),
                        mmu=details.get("mmu"), text=rec.message.strip(), seq=rec.seq, extra=extra)
        return classify(ev)

    def _continues(self, cur: _Open, rec: LogRecord, line: XidLine, details: dict,
                   now: float) -> bool:
        ev = cur.event
        if now - cur.opened >= self.max_open:
            return False
        if rec.seq is not None and cur.last_seq is not None and \
                not 0 < rec.seq - cur.last_seq <= self.max_seq_gap:
            return False
        if rec.usec is not None and cur.last_usec is not None and \
                not 0 <= rec.usec - cur.last_usec <= self.max_usec_gap:
            return False
        if line.pid is not None and ev.pid is not None and line.pid != ev.pid:
            return False
        if "mmu" in details and ev.mmu is not None:
            return False  # a second MMU fault is a fault of its own
        if "recovery_action" in details and "recovery_action" in ev.extra:
            return False
        return True

    def _merge(self, cur: _Open, rec: LogRecord, line: XidLine, details: dict,
               now: float) -> None:
        ev = cur.event
        cur.lines += 1
        cur.last = now
        if rec.seq is not None:
            cur.last_seq = rec.seq
        if rec.usec is not None:
            cur.last_usec = rec.usec
        ev.extra["lines"] = cur.lines
        if cur.lines <= MAX_TEXT_LINES:
            ev.text += "\n" + rec.message.strip()
        if ev.pid is None and line.pid is not None:
            ev.pid = line.pid
        if ev.process is None and line.process is not None:
            ev.process = line.process
        if ev.mmu is None and "mmu" in details:
            ev.mmu = details["mmu"]
        if "channel" in details:
            if ev.channel is None:
                ev.channel = details["channel"]
            chans = ev.extra.setdefault("channels", [])
            if details["channel"] not in chans:
                chans.append(details["channel"])
        if "sm" in details:
            errs = ev.extra.setdefault("sm_errors", [])
            if len(errs) < MAX_TEXT_LINES:
                errs.append(details["sm"])
        for k in ("intr", "esr", "recovery_action", "recovery_action_from"):
            if k in details and k not in ev.extra:
                ev.extra[k] = details[k]
        classify(ev)  # an MMU fault or recovery action may have come with this line

    def _close(self, key: tuple[str, int]) -> FaultEvent:
        return self._open.pop(key).event


def boot_time_estimate() -> float | None:
    """time.time() at boot, to turn kernel timestamps (CLOCK_MONOTONIC-like) into wall time.

    printk stamps records with local_clock(), which runs with CLOCK_MONOTONIC (neither
    counts suspend); the estimate is off by the time the host spent suspended.
    """
    try:
        return time.time() - time.clock_gettime(time.CLOCK_MONOTONIC)
    except (AttributeError, OSError):
        return None


# -- readers -----------------------------------------------------------------------

Item = Union[LogRecord, KmsgGap]


class KernelLogUnavailable(Exception):
    """Neither /dev/kmsg nor `dmesg` can be read; `permission` when for lack of rights."""

    def __init__(self, message: str, permission: bool):
        super().__init__(message)
        self.message, self.permission = message, permission


class KmsgReader:
    """Follows /dev/kmsg without blocking, or reads a file of its records or of dmesg text.

    From now on (the default) or, with from_start, from the oldest record the kernel
    still holds.  read() returns what is there, never waits; select()/poll() on
    fileno() to wait.  When the kernel overwrote records before we read them, read()
    returns a KmsgGap before the next record.  On a regular file (a saved log, tests),
    reading ends at its end: `exhausted` turns true.
    """

    BUFSIZE = 1 << 16

    def __init__(self, path: str = DEV_KMSG, from_start: bool = False):
        self.path = path
        self._read = os.read  # tests replace it to play the kernel (EPIPE, EAGAIN)
        self.fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        self.is_file = stat.S_ISREG(os.fstat(self.fd).st_mode)
        self.exhausted = False
        self.last_seq: int | None = None
        self._overflowed = False
        self._partial = b""
        if not from_start:
            os.lseek(self.fd, 0, os.SEEK_END)

    def fileno(self) -> int:
        return self.fd

    @property
    def name(self) -> str:
        return self.path

    def read(self) -> list[Item]:
        out: list[Item] = []
        while not self.exhausted:
            try:
                chunk = self._read(self.fd, self.BUFSIZE)
            except BlockingIOError:
                break
            except BrokenPipeError:       # EPIPE: the kernel overwrote records we had not read
                self._overflowed = True
                continue
            except OSError as exc:
                if exc.errno == errno.EINTR:
                    continue
                raise
            if not chunk:
                if self.is_file:
                    self.exhausted = True
                    if self._partial:
                        self._emit(self._partial, out)
                        self._partial = b""
                break
            if self.is_file:
                chunk, self._partial = self._partial + chunk, b""
                cut = chunk.rfind(b"\n")
                chunk, self._partial = chunk[:cut + 1], chunk[cut + 1:]
            self._emit(chunk, out)
        return out

    def _emit(self, chunk: bytes, out: list[Item]) -> None:
        # /dev/kmsg gives one record per read: a header line, then " KEY=value" lines.
        # A file holds many; a line that does not start with a space starts a record.
        records: list[list[str]] = []
        for line in chunk.decode("utf-8", "replace").split("\n"):
            if not line:
                continue
            if line.startswith(" ") and records and _KMSG_HEADER.match(records[-1][0]):
                records[-1].append(line)
            else:
                records.append([line])
        for lines in records:
            rec = parse_line("\n".join(lines))
            if rec.seq is not None:
                if self._overflowed or (self.last_seq is not None and rec.seq > self.last_seq + 1):
                    first = None if self.last_seq is None else self.last_seq + 1
                    if first is None or first <= rec.seq - 1:
                        out.append(KmsgGap(first, rec.seq - 1))
                self._overflowed = False
                if self.last_seq is not None and rec.seq <= self.last_seq:
                    continue  # seen already
                self.last_seq = rec.seq
            out.append(rec)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def run_dmesg() -> str:
    """`dmesg -r`: the kernel's buffer, raw (syslog(2) when /dev/kmsg is not there)."""
    try:
        res = subprocess.run(["dmesg", "-r"], capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        raise FileNotFoundError("dmesg not found") from None
    if res.returncode != 0:
        msg = (res.stderr.strip().splitlines() or [f"exit status {res.returncode}"])[-1]
        if "not permitted" in msg.lower() or "permission" in msg.lower():
            raise PermissionError(msg)
        raise OSError(msg)
    return res.stdout


class DmesgPoller:
    """The fallback where /dev/kmsg cannot be opened: `dmesg -r` every `interval` seconds.

    New lines are those stamped later than the last one seen (dmesg output carries no
    sequence numbers; lines with the same stamp are counted).  Needs the kernel's
    timestamps (printk.time, on by default).  No overflow detection.
    """

    fd = None
    exhausted = False
    name = "dmesg -r"

    def __init__(self, from_start: bool = False, interval: float = 1.0,
                 run: Callable[[], str] = run_dmesg, clock: Callable[[], float] = time.monotonic):
        self.interval, self.run, self.clock = interval, run, clock
        self._last_usec: int | None = None
        self._at_last = 0          # lines already seen with stamp == _last_usec
        self._next = 0.0
        first = self._new_lines(run())  # raises if dmesg cannot be read
        self._pending = first if from_start else []
        self._next = clock() + interval

    def fileno(self) -> None:
        return None

    def read(self) -> list[Item]:
        out, self._pending = self._pending, []
        if self.clock() >= self._next:
            self._next = self.clock() + self.interval
            out += self._new_lines(self.run())
        return out

    def _new_lines(self, text: str) -> list[Item]:
        recs = [parse_text_line(line) for line in text.splitlines() if line.strip()]
        out: list[Item] = []
        counts: dict[int, int] = {}
        for rec in recs:
            if rec.usec is None:
                continue
            counts[rec.usec] = counts.get(rec.usec, 0) + 1
            if self._last_usec is None or rec.usec > self._last_usec or \
                    (rec.usec == self._last_usec and counts[rec.usec] > self._at_last):
                out.append(rec)
        if counts:  # the newest stamp, and how many lines carry it
            self._last_usec = max(counts)
            self._at_last = counts[self._last_usec]
        return out

    def close(self) -> None:
        pass


def open_kernel_log(from_start: bool = False, path: str | None = None,
                    dmesg: Callable[[], str] = run_dmesg,
                    opener: Callable[..., KmsgReader] = KmsgReader):
    """KmsgReader on `path` (default /dev/kmsg); else, for /dev/kmsg only, DmesgPoller.

    Raises KernelLogUnavailable saying why neither works.
    """
    if path is not None:
        try:
            return opener(path, from_start=from_start)
        except OSError as exc:
            raise KernelLogUnavailable(f"cannot read {path}: {exc.strerror or exc}",
                                       isinstance(exc, PermissionError)) from None
    try:
        return opener(DEV_KMSG, from_start=from_start)
    except OSError as exc:
        kmsg_err = exc
    try:
        return DmesgPoller(from_start=from_start, run=dmesg)
    except OSError as exc:
        permission = isinstance(kmsg_err, PermissionError) or isinstance(exc, PermissionError)
        raise KernelLogUnavailable(
            f"cannot read the kernel log: {DEV_KMSG}: {kmsg_err.strerror or kmsg_err}; "
            f"dmesg -r: {exc}" + ("; reading it needs root or CAP_SYSLOG when "
                                  "kernel.dmesg_restrict is 1" if permission else ""),
            permission) from None
