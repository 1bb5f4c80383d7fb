"""Where a set of processes' threads wait in the kernel: /proc sampled every few ms.

A bench that wants to know what holds a process up (a released standby's first iteration,
an MPS server's reply) starts a ``WaitSampler`` on those pids around the moment that
matters.  Each sample reads, for every thread, /proc/PID/task/TID/syscall (the call it is
blocked in and its arguments) and, as root, /proc/PID/task/TID/stack (the kernel stack
where it waits).  A thread seen in the same call with the same kernel stack on
consecutive samples is one *wait*; ``waits()`` gives those that lasted at least
``min_s``, with the call's file (an ioctl's /dev node, a socket), the ioctl's command and
the first kernel frames: which driver path a process waited in, and for how long.
Sampling, not tracing: a wait shorter than the period may be missed, and its ends are
known to the period.
"""

from __future__ import annotations

import bisect
import os
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field

from gpuos import procs
from gpuos.errors import NoSuchProcess

SYSCALLS_X86_64 = {0: "read", 1: "write", 7: "poll", 16: "ioctl", 23: "select", 44: "sendto",
                   45: "recvfrom", 46: "sendmsg", 47: "recvmsg", 202: "futex", 232: "epoll_wait",
                   257: "openat", 270: "pselect6", 271: "ppoll", 281: "epoll_pwait", 3: "close",
                   9: "mmap", 11: "munmap", 10: "mprotect", 35: "nanosleep", 230: "clock_nanosleep"}
FD_CALLS = {"read", "write", "ioctl", "sendto", "recvfrom", "sendmsg", "recvmsg", "close", "mmap"}
IDLE = {"futex", "nanosleep", "clock_nanosleep", "epoll_wait", "epoll_pwait", "poll", "ppoll",
        "select", "pselect6"}
FRAMES = 6
USER_FRAMES = 160
# The NVIDIA driver's ioctls (nv_escape.h, nv-ioctl-numbers.h): the type byte 'F' and, in
# the argument each points at, the RM control's command or the RM allocation's class (a
# 32-bit word at offset 8 of NVOS54_PARAMETERS, at 12 of NVOS21/NVOS64_PARAMETERS and of
# NVOS02_PARAMETERS, the memory allocation's: 0x3e system memory, 0x40 video memory, 0x71
# an OS descriptor, memory the process already has).
NV_IOCTL_TYPE = 0x46
NV_ESC_WORD = {0x2a: ("rm-control", 8), 0x2b: ("rm-alloc", 12), 0x37: ("rm-alloc", 12),
               0x29: ("rm-free", 8), 0x27: ("rm-alloc-memory", 12)}


@dataclass
class Wait:
    pid: int
    tid: int
    comm: str
    call: str           # the system call's name (or number), "running" when in none
    file: str           # its file descriptor's target, for calls on one ("" if none)
    arg: str            # an ioctl's command (hex; for the NVIDIA driver's also what it asks: nv_ioctl)
    stack: list[str]    # the first kernel frames, offsets cut
    from_s: float       # first and last sample that saw it, seconds from the sampler's t0
    to_s: float
    user: list[str] = field(default_factory=list)  # an NVIDIA ioctl's caller: user_frames

    @property
    def seconds(self) -> float:
        return self.to_s - self.from_s


def parse_syscall(text: str) -> tuple[str, list[str]]:
    """/proc/.../syscall: ("running", []) or (call name, its arguments as hex)."""
    parts = text.split()
    if not parts or parts[0] == "running":
        return "running", []
    if parts[0] == "-1":  # blocked, but not in a system call
        return "-1", []
    nr = int(parts[0])
    return SYSCALLS_X86_64.get(nr, str(nr)), parts[1:7]


def parse_stack(text: str, frames: int = FRAMES) -> list[str]:
    """/proc/.../stack: the first frames' function names ("[<0>] f+0x1/0x2" -> "f")."""
    out = []
    for line in text.splitlines():
        name = line.split("] ", 1)[-1].strip()
        name = name.split("+", 1)[0]
        if name:
            out.append(name)
        if len(out) == frames:
            break
    return out


def nv_ioctl(cmd: int, word: int | None) -> str:
    """An NVIDIA ioctl's command as "rm-control 0x20800a01" (its escape, and the RM command
    or class read from its argument), or "" when it is none of those."""
    if (cmd >> 8) & 0xff != NV_IOCTL_TYPE or (cmd & 0xff) not in NV_ESC_WORD:
        return ""
    what, _ = NV_ESC_WORD[cmd & 0xff]
    return f"{what} {word:#x}" if word is not None else what


def _peek_u32(pid: int, addr: int) -> int | None:
    """The 32-bit word at addr in pid's memory (root), or None."""
    try:
        with open(f"/proc/{pid}/mem", "rb", buffering=0) as f:
            f.seek(addr)
            b = f.read(4)
        return int.from_bytes(b, "little") if len(b) == 4 else None
    except (OSError, ValueError, OverflowError):
        return None


def exec_maps(pid: int) -> list[tuple[int, int, int, str]]:
    """pid's executable file mappings: (start, end, file offset, the file's path)."""
    out = []
    for line in _read(f"/proc/{pid}/maps").splitlines():
        f = line.split(None, 5)
        if len(f) == 6 and "x" in f[1] and f[5].startswith("/"):
            start, end = (int(x, 16) for x in f[0].split("-"))
            out.append((start, end, int(f[2], 16), f[5].strip()))
    return out


def user_frames(pid: int, tid: int, maps: list[tuple[int, int, int, str]], frames: int = USER_FRAMES,
                words: int = 16384) -> list[str]:
    """Where a thread blocked in a system call was called from, by a scan of its user
    stack (root): the program counter and the words from the stack pointer up that point
    into executable file mappings, as "path+offset" (the offset in the file: `addr2line -e`
    or `nm` on the machine names it), consecutive repeats dropped.  A heuristic, not an
    unwinder: a stale return address on the stack shows up too."""
    f = _read(f"/proc/{pid}/task/{tid}/syscall").split()
    if len(f) < 9 or not maps:
        return []
    sp, pc = int(f[-2], 16), int(f[-1], 16)
    try:
        with open(f"/proc/{pid}/mem", "rb", buffering=0) as m:
            m.seek(sp)
            raw = m.read(words * 8)
    except (OSError, ValueError, OverflowError):
        raw = b""
    starts = [m[0] for m in maps]  # /proc/PID/maps lists them by address: found by bisection
    out: list[str] = []
    for addr in [pc, *(int.from_bytes(raw[i:i + 8], "little") for i in range(0, len(raw) - 7, 8))]:
        k = bisect.bisect_right(starts, addr) - 1
        if k < 0 or addr >= maps[k][1]:
            continue
        start, _, off, name = maps[k]
        hit = f"{name}+{addr - start + off:#x}"
        if not out or out[-1] != hit:
            out.append(hit)
            if len(out) == frames:
                break
    return out


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


class WaitSampler:
    """Samples pids' threads every period_s on a thread of its own (start/stop)."""

    def __init__(self, pids: dict[int, str], period_s: float = 0.003, t0: float | None = None):
        self.pids = dict(pids)          # pid -> what it is (for the report)
        self.period_s = period_s
        self.t0 = t0
        self._open: dict[tuple[int, int], Wait] = {}
        self._maps: dict[int, list] = {}  # pid -> exec_maps, for user_frames
        self._done: list[Wait] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.samples = 0

    def start(self) -> None:
        if self.t0 is None:
            self.t0 = time.time()
        self._thread = threading.Thread(target=self._run, name="kwait", daemon=True)
        self._thread.start()

    def add(self, pid: int, role: str) -> None:
        """Sample pid too from now on (a process started after start())."""
        self.pids = self.pids | {pid: role}  # a new dict: the sampler's loop iterates the old

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        self._done.extend(self._open.values())
        self._open.clear()

    @staticmethod
    def _file(pid: int, fd: str) -> str:
        """What descriptor fd (hex, as /proc/.../syscall gives it) of pid is, now."""
        try:
            return os.readlink(f"/proc/{pid}/fd/{int(fd, 16)}")
        except (OSError, ValueError):
            return ""

    def sample_once(self, now: float) -> None:
        seen = set()
        for pid in self.pids:
            try:
                tids = procs.tids(pid)
            except NoSuchProcess:
                continue
            for tid in tids:
                base = f"/proc/{pid}/task/{tid}"
                call, args = parse_syscall(_read(f"{base}/syscall"))
                if call in IDLE:
                    continue
                stack = parse_stack(_read(f"{base}/stack"))
                file = self._file(pid, args[0]) if call in FD_CALLS and args else ""
                arg = ""
                if call == "ioctl" and len(args) > 2:
                    cmd, ptr = int(args[1], 16), int(args[2], 16)
                    esc = NV_ESC_WORD.get(cmd & 0xff)
                    word = _peek_u32(pid, ptr + esc[1]) if esc and (cmd >> 8) & 0xff == NV_IOCTL_TYPE else None
                    arg = " ".join(x for x in (args[1], nv_ioctl(cmd, word)) if x)
                key = (pid, tid)
                seen.add(key)
                w = self._open.get(key)
                if w and (w.call, w.file, w.arg, w.stack) == (call, file, arg, stack):
                    w.to_s = now - self.t0
                    continue
                if w:
                    self._done.append(w)
                comm = _read(f"{base}/comm").strip()
                user = []
                if call == "ioctl" and (file.startswith("/dev/nvidia") or arg.count(" ")):
                    if pid not in self._maps:  # read once a process: its libraries loaded by now
                        self._maps[pid] = exec_maps(pid)
                    user = user_frames(pid, tid, self._maps[pid])
                self._open[key] = Wait(pid, tid, comm, call, file, arg, stack, now - self.t0, now - self.t0, user)
        for key in list(self._open):
            if key not in seen:
                self._done.append(self._open.pop(key))
        self.samples += 1

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample_once(time.time())
            self._stop.wait(self.period_s)

    def waits(self, min_s: float = 0.02, since: float | None = None, every: str = "",
              window: tuple[float, float] = (0.0, 1.0)) -> list[dict]:
        """The waits that lasted min_s or more, earliest first, each with its pid's role;
        times in seconds from `since` (a unix time; default the sampler's start).  Roles
        that begin with `every` (if given) keep every wait that overlaps `window`, however
        short (one sample)."""
        shift = (self.t0 or 0.0) - (since if since is not None else (self.t0 or 0.0))
        out = []
        for w in sorted(self._done, key=lambda w: (w.from_s, w.pid, w.tid)):
            short_ok = every and self.pids.get(w.pid, "").startswith(every) and \
                w.to_s + shift >= window[0] and w.from_s + shift <= window[1]
            if w.call != "running" and (w.seconds >= min_s or short_ok):
                out.append(asdict(w) | {"seconds": round(w.seconds, 4), "role": self.pids.get(w.pid, ""),
                                        "from_s": round(w.from_s + shift, 4), "to_s": round(w.to_s + shift, 4)})
        return out



def symbol_names(frames: list[str]) -> dict[str, str]:
    """Each "path+0xoffset" frame's nearest symbol at or below it ("name+0xdelta"; the
    dynamic symbols where a library is stripped), from `nm` on this machine: run where the
    libraries are.  The offset is taken as the symbol's address (a library's code is
    mapped at its file offset, as GNU ld and lld lay it out)."""
    by_path: dict[str, list[int]] = {}
    for f in frames:
        path, _, off = f.rpartition("+")
        by_path.setdefault(path, []).append(int(off, 16))
    out = {}
    for path, offs in by_path.items():
        syms = []
        for flags in (["-n", "--defined-only"], ["-D", "-n", "--defined-only"]):
            try:
                text = subprocess.run(["nm", *flags, path], capture_output=True, text=True, timeout=60).stdout
            except (OSError, subprocess.TimeoutExpired):
                text = ""
            syms = [(int(a, 16), n) for a, t, n in (ln.split(None, 2) for ln in text.splitlines() if ln.count(" ") >= 2)
                    if t.lower() in "tw" and int(a, 16)]
            if syms:
                break
        addrs = [a for a, _ in syms]
        for off in offs:
            i = bisect.bisect_right(addrs, off) - 1
            out[f"{path}+{off:#x}"] = f"{syms[i][1]}+{off - syms[i][0]:#x}" if i >= 0 else "?"
    return out


if __name__ == "__main__":
    # python3 kwait.py RESULT.json: the user frames of every wait in a benchmark's JSON
    # (mps_faults --kernel-waits), named on this machine, printed as "frame  name"
    import json
    found: list[str] = []
    def walk(x):
        if isinstance(x, dict):
            found.extend(x.get("user") or [])
            for v in x.values():
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)
    walk(json.load(open(sys.argv[1])))
    for frame, name in symbol_names(sorted(set(found))).items():
        print(frame, name)
