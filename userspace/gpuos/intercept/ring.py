"""Reading libgpuos's launch ring (libgpuos/include/gpuos_ring.h, format version 3).

The ring is a memfd shared with the traced process.  We map it read-only and follow
the writer protocol described in the header: a record starts in a slot whose sequence
word is ``(index + 1) | START``; a copy is only trusted if the writer has not claimed
any of its slots again by the time we finished copying.  Readers never write records,
so many can follow one ring and none can slow the application down; the one field
written from outside is the header's ``ops_paused`` (`OpsPause`).

The struct layouts below mirror the C header; tests/unit/test_intercept_ring.py
compiles the header and checks every size and offset.
"""

from __future__ import annotations

import mmap
import os
import struct
import time
from dataclasses import dataclass, field
from typing import Iterator

MAGIC = 0x31474E4952534F47
VERSION = 3
HDR_SIZE = 4096
SLOT_SIZE = 64
SLOT_PAYLOAD = 56
SLOT_START = 1 << 63
MEMFD_NAME = "gpuos-ring"
CHUNK = 4096  # GPUOS_VALIDATE_CHUNK

TRACK_ON, TRACK_OFF, TRACK_INCOMPLETE = 1, 2, 3
TRACK_STATES = {TRACK_ON: "on", TRACK_OFF: "off", TRACK_INCOMPLETE: "incomplete"}
INCOMPLETE = {1 << 0: "unknown-entry-point", 1 << 1: "record-lost",
              1 << 2: "unhooked-writer"}  # GPUOS_INCOMPLETE_*
RING_VALIDATE = 1
RING_TOUCHED = 2  # GPUOS_RING_TOUCHED: validation measures what launches touch
MEMORY_MODES = {0: "driver", 1: "movable"}  # hdr.memory_mode
ALLOC_F_MOVABLE = 1  # GPUOS_ALLOC_F_MOVABLE: an ALLOC/FREE record's flag
ALLOC_F_MEASURED = 2  # GPUOS_ALLOC_F_MEASURED: managed memory whose touches are measured

HDR = struct.Struct("<QIIIIIIQQIi256sQQQQIIQII10QIIIIQQ")  # ..., ops_paused, incomplete, memory
OPS_PAUSED_OFFSET = 448  # hdr.ops_paused (u32)
COUNTERS = ("launches", "copies", "allocs", "frees", "graph_launches", "unknown_layout",
            "unmatched_procs", "validated", "validate_skipped", "misses")
FUNC_ENT = struct.Struct("<QIHHII")
REC_HDR = struct.Struct("<HHIQII")

PAD, ALLOC, FREE, OBJECT, LAUNCH, COPY, GRAPH, VALIDATE, STATUS, PARAMS, TOUCHED = range(11)
REC_NAMES = {PAD: "pad", ALLOC: "alloc", FREE: "free", OBJECT: "object", LAUNCH: "launch",
             COPY: "copy", GRAPH: "graph", VALIDATE: "validate", STATUS: "status",
             PARAMS: "params", TOUCHED: "touched"}

ALLOC_BODY = struct.Struct("<5QIi")
OBJECT_BODY = struct.Struct("<QQII")
LAUNCH_BODY = struct.Struct("<5Q10I")
BUF = struct.Struct("<4QHHI")
COPY_BODY = struct.Struct("<7QII")
GRAPH_BODY = struct.Struct("<3QII")
VALIDATE_BODY = struct.Struct("<6Q4I")
MISS = struct.Struct("<4Q")
STATUS_BODY = struct.Struct("<Ii256s")
PARAMS_BODY = struct.Struct("<QII")
PARAM = struct.Struct("<II")
PARAMS_FLAGS = {1 << 0: "extra", 1 << 1: "truncated"}
TOUCHED_BODY = struct.Struct("<3QII")
RUN = struct.Struct("<QII")
TOUCHED_FLAGS = {1 << 0: "dropped", 1 << 1: "remote"}  # GPUOS_TOUCHED_*: touches may be missing
TOUCH_ACCESS = {1 << 0: "read", 1 << 1: "write", 1 << 2: "atomic", 1 << 3: "prefetch"}
TOUCH_PAGE = 4096

ALLOC_KINDS = {1: "device", 2: "pitch", 3: "async", 4: "managed", 5: "host",
               6: "host-registered", 7: "vmm-reserve", 8: "vmm-map", 9: "vmm-create",
               10: "graph"}
OBJ_TYPES = {1: "module", 2: "library", 3: "function", 4: "kernel", 5: "stream", 6: "event",
             7: "graph-exec", 8: "context"}
OBJ_FLAGS = {1: "created", 2: "destroyed"}
LAUNCH_FLAGS = {1 << 0: "layout-unknown", 1 << 1: "touch-all", 1 << 2: "truncated",
                1 << 3: "graph", 1 << 4: "captured", 1 << 5: "ex", 1 << 6: "cooperative",
                1 << 7: "extra"}
BUF_FLAGS = {1 << 0: "managed", 1 << 1: "host", 1 << 2: "exact", 1 << 3: "write",
             1 << 4: "read"}
COPY_KINDS = {1: "htod", 2: "dtoh", 3: "dtod", 4: "htoh", 5: "unified", 6: "peer",
              7: "memset", 8: "2d", 9: "3d", 10: "batch"}
COPY_FLAGS = {1 << 0: "async", 1 << 1: "graph", 1 << 2: "captured"}
GRAPH_FLAGS = {1 << 0: "incomplete", 1 << 1: "captured"}
SKIP_REASONS = {0: None, 1: "capture", 2: "no-memory", 3: "error", 4: "other-context", 5: "busy",
                6: "not-measured"}
OP_TYPES = {LAUNCH: "launch", COPY: "copy", GRAPH: "graph"}
NO_FUNC = 0xFFFFFFFF


def flag_names(value: int, names: dict[int, str]) -> list[str]:
    return [name for bit, name in names.items() if value & bit]


def _entries(body: bytes, head: struct.Struct, entry: struct.Struct, n: int) -> Iterator[tuple]:
    """The n fixed-size entries that follow a record's head (fewer if the body is short)."""
    for i in range(n):
        off = head.size + i * entry.size
        if off + entry.size > len(body):
            return
        yield entry.unpack_from(body, off)


def _cstr(raw: bytes) -> str:
    return raw.split(b"\0", 1)[0].decode("utf-8", "replace")


class RingError(Exception):
    """Not a libgpuos ring, or one of another format version."""


@dataclass
class RingHeader:
    pid: int
    nslots: int
    flags: int
    head: int
    lost: int
    state: int
    reason_errno: int
    reason: str
    start_realtime_ns: int
    start_mono_ns: int
    strtab_off: int
    func_cap: int
    func_count: int
    driver_version: int
    counters: dict[str, int] = field(default_factory=dict)
    ops_paused: bool = False
    incomplete: int = 0  # GPUOS_INCOMPLETE_* bits
    memory_mode: str = "driver"  # "movable": cuMemAlloc served by gpuos (libgpuos/src/memory.c)
    movable_bytes: int = 0  # physical bytes of live movable allocations
    movable_fallbacks: int = 0  # allocations left to the driver because a VMM step failed

    @property
    def tracking(self) -> bool:
        """Recording (completely or not)."""
        return self.state in (TRACK_ON, TRACK_INCOMPLETE)

    @property
    def state_name(self) -> str:
        return TRACK_STATES.get(self.state, f"unknown ({self.state})")

    @property
    def incomplete_reasons(self) -> list[str]:
        return flag_names(self.incomplete, INCOMPLETE)

    @property
    def validate(self) -> bool:
        return bool(self.flags & RING_VALIDATE)


@dataclass
class Function:
    id: int
    handle: int
    name: str | None
    nparams: int | None  # None: layout unknown
    params_bytes: int


def decode(rtype: int, flags: int, ts_ns: int, tid: int, body: bytes) -> dict:
    """One record as the dict the launch log writes (docs/interception.md, "Launch log")."""
    rec: dict = {"type": REC_NAMES.get(rtype, f"unknown-{rtype}"), "ts_ns": ts_ns, "tid": tid}
    if rtype in (ALLOC, FREE):
        base, size, ctx, stream, aux, kind, device = ALLOC_BODY.unpack_from(body)
        rec.update(base=base, size=size, ctx=ctx, stream=stream, aux=aux,
                   kind=ALLOC_KINDS.get(kind, kind), device=device)
        if flags & ALLOC_F_MOVABLE:
            rec["movable"] = True
        if flags & ALLOC_F_MEASURED:
            rec["measured"] = True
    elif rtype == OBJECT:
        handle, parent, objtype, func_id = OBJECT_BODY.unpack_from(body)
        rec.update(handle=handle, parent=parent, object=OBJ_TYPES.get(objtype, objtype),
                   op=flag_names(flags, OBJ_FLAGS)[0] if flags & 3 else None,
                   func=None if func_id == NO_FUNC else func_id)
    elif rtype == LAUNCH:
        (seq, stream, ctx, graph_exec, arg_hash, func_id, gx, gy, gz, bx, by, bz, shmem, nbuf,
         _) = LAUNCH_BODY.unpack_from(body)
        bufs = []
        for base, size, ptr, length, param, bflags, poff in _entries(body, LAUNCH_BODY, BUF, nbuf):
            bufs.append({"base": base, "size": size, "ptr": ptr, "len": length,
                         "param": None if param == 0xFFFF else param, "offset": poff,
                         "flags": flag_names(bflags, BUF_FLAGS)})
        rec.update(seq=seq, func=func_id, grid=[gx, gy, gz], block=[bx, by, bz], shmem=shmem,
                   stream=stream, ctx=ctx, graph_exec=graph_exec, arg_hash=arg_hash,
                   flags=flag_names(flags, LAUNCH_FLAGS), bufs=bufs)
    elif rtype == COPY:
        seq, stream, dst, src, dst_len, src_len, graph_exec, kind, value = \
            COPY_BODY.unpack_from(body)
        rec.update(seq=seq, kind=COPY_KINDS.get(kind, kind), flags=flag_names(flags, COPY_FLAGS),
                   stream=stream, dst=dst, src=src, dst_len=dst_len, src_len=src_len,
                   graph_exec=graph_exec, value=value)
    elif rtype == GRAPH:
        seq, graph_exec, stream, nkernels, ncopies = GRAPH_BODY.unpack_from(body)
        rec.update(seq=seq, graph_exec=graph_exec, stream=stream, nkernels=nkernels,
                   ncopies=ncopies, flags=flag_names(flags, GRAPH_FLAGS))
    elif rtype == VALIDATE:
        (seq, changed, predicted, over, missed, tracked, func_id, nmiss, skip,
         op_type) = VALIDATE_BODY.unpack_from(body)
        misses = []
        for base, size, first, length in _entries(body, VALIDATE_BODY, MISS, nmiss):
            misses.append({"base": base, "size": size, "first": first, "len": length})
        rec.update(seq=seq, op=OP_TYPES.get(op_type, op_type),
                   func=None if func_id == NO_FUNC else func_id,
                   skipped=bool(flags & 1), skip_reason=SKIP_REASONS.get(skip, skip),
                   changed_bytes=changed, predicted_bytes=predicted,
                   overpredicted_bytes=over, missed_bytes=missed, tracked_bytes=tracked,
                   misses=misses)
    elif rtype == PARAMS:
        seq, func_id, nparams = PARAMS_BODY.unpack_from(body)
        params, data = [], PARAMS_BODY.size + nparams * PARAM.size
        for i in range(nparams):
            off, size = PARAM.unpack_from(body, PARAMS_BODY.size + i * PARAM.size)
            params.append({"offset": off, "size": size, "hex": body[data:data + size].hex()})
            data += size
        rec.update(seq=seq, func=None if func_id == NO_FUNC else func_id,
                   flags=flag_names(flags, PARAMS_FLAGS), params=params)
    elif rtype == TOUCHED:
        seq, faults, gap, func_id, nrun = TOUCHED_BODY.unpack_from(body)
        runs = []
        for start, pages, access in _entries(body, TOUCHED_BODY, RUN, nrun):
            runs.append({"start": start, "len": pages * TOUCH_PAGE,
                         "access": flag_names(access, TOUCH_ACCESS)})
        rec.update(seq=seq, func=None if func_id == NO_FUNC else func_id, faults=faults, gap=gap,
                   flags=flag_names(flags, TOUCHED_FLAGS), runs=runs)
    elif rtype == STATUS:
        state, err, reason = STATUS_BODY.unpack_from(body)
        rec.update(state=TRACK_STATES.get(state, str(state)), err=err, reason=_cstr(reason))
        if state == TRACK_INCOMPLETE:
            rec["incomplete"] = flag_names(err, INCOMPLETE)
    return rec


def _ring_size(fd: int) -> int:
    """The size of the memfd fd, checked to hold at least a ring header (so that mapping
    the header is safe)."""
    size = os.fstat(fd).st_size
    if size < HDR_SIZE:
        raise RingError("too small to be a libgpuos ring")
    return size


def _check_header(buf, size: int) -> int:
    """The slot count of the ring whose header is at the start of buf (a memfd of size
    bytes); RingError when it is not a ring this gpuos reads."""
    magic, version, hdr_size, slot_size, nslots = struct.unpack_from("<QIIII", buf)
    if magic != MAGIC:
        raise RingError("not a libgpuos ring (bad magic)")
    if version != VERSION or hdr_size != HDR_SIZE or slot_size != SLOT_SIZE:
        raise RingError(f"ring format version {version} (this gpuos reads {VERSION})")
    if nslots & (nslots - 1) or HDR_SIZE + nslots * SLOT_SIZE > size:
        raise RingError("ring header is inconsistent")
    return nslots


class Ring:
    """A read-only view of one process's ring."""

    def __init__(self, fd: int):
        size = _ring_size(fd)
        self.map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
        self.nslots = _check_header(self.map, size)
        self.functions: dict[int, Function] = {}

    @classmethod
    def open_pid(cls, pid: int) -> "Ring":
        """The ring of a running process, through /proc/PID/fd (same user or root)."""
        fd = open_proc_ring_fd(pid)
        try:
            return cls(fd)
        finally:
            os.close(fd)

    def close(self) -> None:
        self.map.close()

    def header(self) -> RingHeader:
        f = HDR.unpack_from(self.map)
        return RingHeader(pid=f[5], nslots=f[4], flags=f[6], head=f[7], lost=f[8], state=f[9],
                          reason_errno=f[10], reason=_cstr(f[11]), start_realtime_ns=f[12],
                          start_mono_ns=f[13], strtab_off=f[14], func_cap=f[16],
                          func_count=f[17], driver_version=f[19],
                          counters=dict(zip(COUNTERS, f[21:31])), ops_paused=bool(f[31]),
                          incomplete=f[32], memory_mode=MEMORY_MODES.get(f[33], str(f[33])),
                          movable_bytes=f[35], movable_fallbacks=f[36])

    def head(self) -> int:
        return struct.unpack_from("<Q", self.map, 32)[0]

    def function(self, func_id: int) -> Function | None:
        """The function table entry `func_id`, once its writer has published it."""
        if func_id in self.functions:
            return self.functions[func_id]
        h = self.header()
        if func_id >= min(h.func_count, h.func_cap):
            return None
        off = h.strtab_off + func_id * FUNC_ENT.size
        handle, name_off, name_len, nparams, params_bytes, ready = FUNC_ENT.unpack_from(self.map, off)
        if not ready:
            return None
        name = None
        if name_len:
            start = h.strtab_off + h.func_cap * FUNC_ENT.size + name_off
            name = self.map[start:start + name_len].decode("utf-8", "replace")
        fn = Function(func_id, handle, name, None if nparams == 0xFFFF else nparams, params_bytes)
        self.functions[func_id] = fn
        return fn


@dataclass
class ReadStats:
    records: int = 0
    skipped_slots: int = 0   # lapped by the writer before we read them
    torn: int = 0            # overwritten while we copied them


class RingReader:
    """Follows a ring from a cursor; `poll()` returns the records committed since."""

    STALL_S = 1.0  # a claimed slot not committed for this long: its writer died there

    def __init__(self, ring: Ring, from_start: bool = True):
        self.ring = ring
        head = ring.head()
        self.cursor = max(0, head - ring.nslots) if from_start else head
        self.stats = ReadStats()
        self._stalled_at: tuple[int, float] | None = None

    def _seq(self, index: int) -> int:
        return struct.unpack_from("<Q", self.ring.map, HDR_SIZE + (index % self.ring.nslots) * SLOT_SIZE)[0]

    def _payload(self, start: int, nslots: int) -> bytes:
        m, base = self.ring.map, start % self.ring.nslots
        return b"".join(m[HDR_SIZE + (base + i) * SLOT_SIZE + 8:HDR_SIZE + (base + i + 1) * SLOT_SIZE]
                        for i in range(nslots))

    def poll(self, limit: int = 1 << 30) -> Iterator[tuple[int, int, int, int, bytes]]:
        """Yield (type, flags, ts_ns, tid, body) for each new record, oldest first."""
        ring, n = self.ring, 0
        while n < limit:
            head = ring.head()
            if self.cursor >= head:
                return
            if head - self.cursor > ring.nslots:  # lapped: jump to what is still there
                self._skip_to(head - ring.nslots)
                continue
            seq = self._seq(self.cursor)
            index = seq & ~SLOT_START
            if index < self.cursor + 1:  # claimed, not yet committed
                if not self._stalled(head):
                    return
                self._skip_to(self.cursor + 1)
                continue
            if index > self.cursor + 1 or not seq & SLOT_START:
                self._skip_to(self.cursor + 1)
                continue
            first = self._payload(self.cursor, 1)
            rtype, flags, size, ts, tid, _ = REC_HDR.unpack_from(first)
            nslots = max(1, -(-size // SLOT_PAYLOAD))
            data = first if nslots == 1 else self._payload(self.cursor, nslots)
            if ring.head() > self.cursor + ring.nslots or size < REC_HDR.size:
                self.stats.torn += 1
                self._skip_to(self.cursor + 1)
                continue
            self.cursor += nslots
            self._stalled_at = None
            if rtype == PAD:
                continue
            n += 1
            self.stats.records += 1
            yield rtype, flags, ts, tid, data[REC_HDR.size:size]

    def _skip_to(self, cursor: int) -> None:
        """Move to the next record start at or after `cursor`."""
        head = self.ring.head()
        while cursor < head and self._seq(cursor) != ((cursor + 1) | SLOT_START):
            cursor += 1
        self.stats.skipped_slots += cursor - self.cursor
        self.cursor = cursor
        self._stalled_at = None

    def _stalled(self, head: int) -> bool:
        now = time.monotonic()
        if self._stalled_at is None or self._stalled_at[0] != self.cursor:
            self._stalled_at = (self.cursor, now)
            return False
        return now - self._stalled_at[1] > self.STALL_S and head > self.cursor + 1


class OpsPause:
    """The switch that pauses and resumes the recording of operations in process `pid`
    (the ring header's ops_paused), mapped once: launches, copies, memsets and graph
    launches go straight to the driver while paused; allocations are still tracked, so
    records are exact again once resumed.  Raises what `open_proc_ring_fd` raises, and
    RingError for a ring in validation mode (validation sees every operation; it cannot
    be paused).  One store per switch: the paired benchmark switches at every step."""

    def __init__(self, pid: int):
        fd = open_proc_ring_fd(pid, writable=True)
        try:
            size = _ring_size(fd)
            self._hdr = mmap.mmap(fd, HDR_SIZE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        try:
            _check_header(self._hdr, size)
            if HDR.unpack_from(self._hdr)[6] & RING_VALIDATE:  # hdr.flags
                raise RingError(f"process {pid} runs under --validate: its operations cannot be paused")
        except RingError:
            self._hdr.close()
            raise

    def set(self, paused: bool) -> bool:
        """Pause (or resume); returns the previous state."""
        was = bool(struct.unpack_from("<I", self._hdr, OPS_PAUSED_OFFSET)[0])
        struct.pack_into("<I", self._hdr, OPS_PAUSED_OFFSET, int(paused))
        return was

    def close(self) -> None:
        self._hdr.close()

    def __enter__(self) -> "OpsPause":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def set_ops_paused(pid: int, paused: bool) -> bool:
    """Pause (or resume) the recording of operations in process `pid` once (OpsPause);
    returns the previous state."""
    with OpsPause(pid) as switch:
        return switch.set(paused)


def open_proc_ring_fd(pid: int, writable: bool = False) -> int:
    """Open the ring memfd of process `pid` (read-only unless `writable`), through
    /proc/PID/fd.

    Raises FileNotFoundError when the process does not exist, LookupError when it has
    no ring (libgpuos not loaded, or no CUDA call yet), PermissionError when the
    kernel refuses (another user's process and we are not root).
    """
    fd_dir = f"/proc/{pid}/fd"
    names = os.listdir(fd_dir)
    for name in names:
        try:
            target = os.readlink(f"{fd_dir}/{name}")
        except FileNotFoundError:
            continue
        if target.startswith(f"/memfd:{MEMFD_NAME} "):
            return os.open(f"{fd_dir}/{name}", (os.O_RDWR if writable else os.O_RDONLY) | os.O_CLOEXEC)
    raise LookupError(f"process {pid} has no libgpuos ring")
