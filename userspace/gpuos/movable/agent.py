"""The client of libgpuos's movable-memory agent (libgpuos/include/gpuos_agent.h, mirrored
here; tests/unit/test_movable_agent.py checks the layouts against the header)."""

from __future__ import annotations

import ctypes
import os
import socket
import struct
import threading
from dataclasses import dataclass

from .. import procs
from ..errors import GpuosError

MAGIC = 0x544E4741
NAME = "gpuos-agent-"
FDS_PER_MSG = 200
HOLD_DETACH = 1
(HOLD, LIST, CAPTURE, EXPORT, RELEASE, MAP, FILL, RESUME, PREPARE, UNPREPARE, SNAPSHOT, DROP,
 FILL_PARTS, MEM_STATS) = range(1, 15)
COMMANDS = {HOLD: "HOLD", LIST: "LIST", CAPTURE: "CAPTURE", EXPORT: "EXPORT", RELEASE: "RELEASE",
            MAP: "MAP", FILL: "FILL", RESUME: "RESUME", PREPARE: "PREPARE", UNPREPARE: "UNPREPARE",
            SNAPSHOT: "SNAPSHOT", DROP: "DROP", FILL_PARTS: "FILL_PARTS", MEM_STATS: "MEM_STATS"}
SHADOWS = 1 << 63  # EXPORT's and MAP's arg: the snapshot's memory
FILL_LATER = 1 << 62  # FILL's arg: new memory, its contents by FILL_PARTS
RESUME_FILLING = 1  # RESUME's arg: the application goes on while its memory is filled
PART_SHADOW = 1  # a FILL_PARTS part's flags: its bytes come from the shadow, on the device
PARTS_MAX = 4096
NONE_WANTED = (1 << 64) - 1
REQ = struct.Struct("<IIQ")
REPLY = struct.Struct("<IiIIQQQ200s")
ALLOC = struct.Struct("<QQQQiIQ")
PART = struct.Struct("<IIQQQ")  # index, flags, offset, length, stage
MEM_STATS_FIELDS = ("limit", "allocations", "reserved_bytes", "resident_bytes", "evicted_bytes", "bytes_in",
                    "bytes_out", "swap_ins", "evictions", "launches", "calls_swapped", "need_all", "over_limit",
                    "stall_ns", "in_ns", "out_ns", "pageable_hosts", "capture_unchecked", "period", "evictions_future",
                    "lru_only", "reserved_peak", "clean_bytes", "ahead_bytes", "ahead_hits", "ahead_unused",
                    "ahead_waits", "host_prepared", "ahead_ns", "map_ns", "batch_bytes", "batch_ns", "ahead_map_ns",
                    "room_ns", "maps", "create_ns", "access_ns", "release_ns")
STALL_BUCKETS = 24  # GPUOS_STALL_BUCKETS
MEM_STATS_STRUCT = struct.Struct("<" + "Q" * (len(MEM_STATS_FIELDS) + STALL_BUCKETS))


CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


class AgentError(GpuosError):
    """The agent refused or failed a command (the application is not harmed)."""


def out_of_memory(exc: AgentError) -> bool:
    """The agent had no device memory for it (its ENOMEM, or the driver's own words)."""
    return "ENOMEM" in exc.message or "OUT_OF_MEMORY" in exc.message


@dataclass(frozen=True)
class MovableAlloc:
    base: int
    size: int      # as the application asked
    reserved: int  # its address range and physical memory
    ctx: int
    device: int
    last_use: int  # the seq of the last recorded operation that touched it (0: none)


def log2_hist_percentile(hist: tuple[int, ...], q: float) -> int | None:
    """An upper bound of the q-th percentile of a histogram whose bucket i counts values in
    [2^i, 2^(i+1)) (libgpuos's stall histograms): the top of its bucket; None if empty."""
    total = sum(hist)
    if not total:
        return None
    seen = 0
    for i, n in enumerate(hist):
        seen += n
        if seen >= q / 100 * total:
            return 2 ** (i + 1)
    return 2 ** len(hist)


@dataclass(frozen=True)
class MemStats:
    """The memory scheduler's figures (struct gpuos_res_stats; `gpuos run --gpu-memory`)."""

    limit: int  # 0: no limit, nothing below applies
    allocations: int
    reserved_bytes: int
    resident_bytes: int
    evicted_bytes: int  # contents in host memory only
    bytes_in: int
    bytes_out: int
    swap_ins: int
    evictions: int
    launches: int
    calls_swapped: int  # calls that brought something in
    need_all: int  # calls that needed every allocation (unpredictable)
    over_limit: int  # calls refused: what they need does not fit
    stall_ns: int
    in_ns: int
    out_ns: int
    pageable_hosts: int
    capture_unchecked: int
    period: int  # the learned period of the calls' sequence; 0: none, evictions are LRU
    evictions_future: int  # evictions chosen by the learned sequence (Belady)
    lru_only: int  # 1: the LRU baseline was asked for (GPUOS_GPU_MEMORY_EVICT=lru)
    reserved_peak: int  # the most reserved_bytes has been
    clean_bytes: int  # evicted without a copy: unchanged since their last copy-out
    ahead_bytes: int  # copied in ahead of their use (in bytes_in too)
    ahead_hits: int  # allocations a call found brought in ahead for it
    ahead_unused: int  # brought in ahead, evicted again unused
    ahead_waits: int  # calls that waited for a copy ahead still running
    host_prepared: int  # bytes of pinned host memory made for evictions before any needed it
    ahead_ns: int  # of in_ns, issuing copies ahead and turns' batches (not waited for)
    map_ns: int  # of in_ns - ahead_ns, making and mapping the physical memory copied into
    batch_bytes: int  # of ahead_bytes, those whose batches were timed on the GPU
    batch_ns: int  # those batches' GPU time, first copy's start to last one's end
    ahead_map_ns: int  # of ahead_ns, making and mapping the memory copies ahead and batches went to
    room_ns: int  # turns' batches waiting for the room the others' evictions free
    maps: int  # physical memory made and mapped for copies in (map_ns and ahead_map_ns time them)
    create_ns: int  # of that time, in cuMemCreate
    access_ns: int  # ... in cuMemSetAccess (the rest: cuMemMap, waits for a member's memory)
    release_ns: int  # of out_ns, unmapping and releasing evicted memory
    stall_hist: tuple[int, ...]  # calls that brought memory in, by stall: [2^i, 2^(i+1)) microseconds

    def stall_percentile_us(self, q: float) -> int | None:
        """An upper bound of the q-th percentile of the stalls of calls that brought memory
        in, in microseconds (the top of its histogram bucket); None if none did."""
        return log2_hist_percentile(self.stall_hist, q)


@dataclass(frozen=True)
class Reply:
    status: int
    count: int
    arg: int
    bytes: int
    ns: int
    msg: str


def agent_name(pid: int) -> str:
    """libgpuos names its agent by its pid as the process sees it (a replica's, in a pid
    namespace of its own, is not ours)."""
    try:
        return f"{NAME}{procs.own_pid(pid)}"
    except GpuosError:
        return f"{NAME}{pid}"


def _socket_in_net_of(pid: int) -> socket.socket:
    """A unix socket in the network namespace of ``pid``, where its agent's abstract name
    lives: made on a thread of ours that joined that namespace (a thread's own, setns(2))."""
    try:
        theirs = os.stat(f"/proc/{pid}/ns/net").st_ino
    except OSError:
        theirs = None
    if theirs is None or theirs == os.stat("/proc/self/ns/net").st_ino:
        return socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    made: list = []

    def make() -> None:
        try:
            fd = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
            try:
                if _libc.setns(fd, CLONE_NEWNET) != 0:
                    err = ctypes.get_errno()
                    raise OSError(err, os.strerror(err))
            finally:
                os.close(fd)
            made.append(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM))
        except OSError as exc:
            made.append(exc)

    t = threading.Thread(target=make, name="gpuos-netns")  # the thread ends, its namespace with it
    t.start()
    t.join()
    if isinstance(made[0], OSError):
        raise AgentError(f"cannot join the network namespace of pid {pid}: {made[0].strerror or made[0]}")
    return made[0]


def agent_sockets(pid: int) -> list[str]:
    """The sockets of the process's network namespace named like its agent, as
    "listening" or "not listening" (accepted connections carry the listener's name)."""
    try:
        with open(f"/proc/{pid}/net/unix", "rb") as f:
            name = b" @" + agent_name(pid).encode()
            lines = [ln.split() for ln in f if ln.rstrip().endswith(name)]
    except OSError:
        return []
    return ["listening" if int(ln[3], 16) & 0x10000 else "not listening" for ln in lines]  # __SO_ACCEPTCON


def agent_available(pid: int) -> bool:
    """Does the process serve the agent (under `gpuos run --memory movable`)?"""
    return "listening" in agent_sockets(pid)


class Agent:
    """A connection to the agent of process `pid`.  Closing it while the process is held
    (and its memory mapped) lets the process go on."""

    def __init__(self, pid: int, timeout: float = 120.0):
        self.pid = pid
        self.sock = _socket_in_net_of(pid)
        self.sock.settimeout(timeout)
        try:
            self.sock.connect(b"\0" + agent_name(pid).encode())
        except OSError as exc:
            self.sock.close()
            seen = agent_sockets(pid)
            raise AgentError(f"pid {pid} serves no movable-memory agent ({exc.strerror or exc}"
                             + (f"; its sockets: {', '.join(seen)}" if seen else "")
                             + "): is it running under `gpuos run`?") from None

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> "Agent":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- plumbing ---------------------------------------------------------------------------
    def _recv_exact(self, n: int, fds: list[int] | None = None) -> bytes:
        buf = b""
        while len(buf) < n:
            try:
                if fds is not None:
                    data, got, _, _ = socket.recv_fds(self.sock, n - len(buf), FDS_PER_MSG)
                    fds.extend(got)
                else:
                    data = self.sock.recv(n - len(buf))
            except ConnectionResetError:  # the process ended while it answered
                data = b""
            if not data:
                raise AgentError(f"pid {self.pid}: the agent closed the connection")
            buf += data
        return buf

    def _reply(self, cmd: int, fds: list[int] | None = None) -> Reply:
        magic, status, count, _, arg, nbytes, ns, msg = REPLY.unpack(self._recv_exact(REPLY.size, fds))
        if magic != MAGIC:
            raise AgentError(f"pid {self.pid}: not an agent reply")
        r = Reply(status, count, arg, nbytes, ns, msg.split(b"\0", 1)[0].decode(errors="replace"))
        if status:
            raise AgentError(f"pid {self.pid}: {COMMANDS[cmd]} failed: {r.msg or os.strerror(status)}")
        return r

    def _request(self, cmd: int, arg: int = 0, fds: list[int] | None = None) -> Reply:
        data = REQ.pack(MAGIC, cmd, arg)
        if fds:
            socket.send_fds(self.sock, [data], fds)
        else:
            self.sock.sendall(data)
        return self._reply(cmd)

    # -- commands ---------------------------------------------------------------------------
    def hold(self, detach: bool = False) -> tuple[int, int]:
        """Stop the application at its CUDA calls and drain its GPU work: (allocations, bytes).
        detach: also close its connection to `gpuos run` until RESUME (before a CRIU dump)."""
        r = self._request(HOLD, HOLD_DETACH if detach else 0)
        return r.count, r.bytes

    def resume(self, filling: bool = False) -> None:
        """Let the application go on; filling: while its memory is filled (FILL_PARTS), its
        calls waiting only for what they touch."""
        self._request(RESUME, RESUME_FILLING if filling else 0)

    def mem_stats(self) -> MemStats:
        """The memory scheduler's figures (any time; the application is not stopped)."""
        self._request(MEM_STATS)
        v = MEM_STATS_STRUCT.unpack(self._recv_exact(MEM_STATS_STRUCT.size))
        return MemStats(*v[:len(MEM_STATS_FIELDS)], stall_hist=tuple(v[len(MEM_STATS_FIELDS):]))

    def list(self) -> list[MovableAlloc]:
        r = self._request(LIST)
        raw = self._recv_exact(r.count * ALLOC.size) if r.count else b""
        out = []
        for i in range(r.count):
            base, size, reserved, ctx, device, _, last_use = ALLOC.unpack_from(raw, i * ALLOC.size)
            out.append(MovableAlloc(base, size, reserved, ctx, device, last_use))
        return out

    def prepare(self, memfd: int, size: int) -> Reply:
        """Make memfd (`size` bytes) the staging area: registered (pinned) for the copies.
        Reply.arg is 1 if the driver registered it."""
        return self._request(PREPARE, size, [memfd])

    def unprepare(self) -> None:
        self._request(UNPREPARE)

    def capture(self) -> Reply:
        """Copy every allocation (or, if there is one, the snapshot, which then goes) into
        the staging area, back to back in LIST order.  Reply.arg is 1 if from a snapshot."""
        return self._request(CAPTURE)

    def snapshot(self) -> Reply:
        """(held) Device-to-device copies of every allocation, to capture after RESUME.
        AgentError with ENOMEM: not enough device memory."""
        return self._request(SNAPSHOT)

    def drop(self) -> None:
        self._request(DROP)

    def export(self, shadows: bool = False) -> list[int]:
        """The physical memory of every allocation (or of the snapshot) as fds (the caller
        closes them)."""
        self.sock.sendall(REQ.pack(MAGIC, EXPORT, SHADOWS if shadows else 0))
        fds: list[int] = []
        try:
            while True:
                got: list[int] = []
                r = self._reply(EXPORT, got)
                fds.extend(got)
                if len(got) != r.count:
                    raise AgentError(f"pid {self.pid}: EXPORT sent {len(got)} fds, said {r.count}")
                if r.arg:
                    return fds
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise

    def release(self) -> None:
        self._request(RELEASE)

    def map(self, fds: list[int], shadows: bool = False) -> None:
        """One fd per allocation, in LIST order: mapped as its memory (held, released), or
        with shadows=True as its shadow: the snapshot's, or (no snapshot) memory filled
        elsewhere for FILL_PARTS from the shadows."""
        for first in range(0, max(len(fds), 1), FDS_PER_MSG):  # one MAP even for none
            self._request(MAP, first | (SHADOWS if shadows else 0), fds[first:first + FDS_PER_MSG])

    def fill(self, from_shadows: bool = False) -> Reply:
        """New memory for every allocation (the process's own: exportable again), filled
        from the staging area, or from the snapshot (mapped back) on the device.
        AgentError with ENOMEM: not enough device memory."""
        return self._request(FILL, SHADOWS if from_shadows else 0)

    def fill_later(self) -> Reply:
        """New memory for every allocation, its contents to come by fill_parts."""
        return self._request(FILL, FILL_LATER)

    def send_parts(self, parts: list[tuple[int, int, int, int]], from_shadows: bool = False) -> None:
        """FILL_PARTS of (allocation index, offset, length, staged at): sent; recv_parts
        waits for the reply (so that the next slot can be read meanwhile).  from_shadows:
        the bytes are the shadows' at the same offset (MAPped with shadows=True; staged
        at 0), copied on the device."""
        flags = PART_SHADOW if from_shadows else 0
        self.sock.sendall(REQ.pack(MAGIC, FILL_PARTS, len(parts))
                          + b"".join(PART.pack(i, flags, off, n, at) for i, off, n, at in parts))

    def recv_parts(self) -> Reply:
        """The reply of the FILL_PARTS sent: arg = an allocation the application waits for
        (NONE_WANTED: none), count = calls that waited for everything, msg = why."""
        return self._reply(FILL_PARTS)
