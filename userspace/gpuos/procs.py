"""What /proc says about processes: trees, threads, state, CUDA use."""

from __future__ import annotations

import os
import re
import stat as stat_mod
from dataclasses import dataclass
from pathlib import Path

from .errors import NoSuchProcess, NotPermitted

PROC = Path("/proc")


@dataclass
class ProcStat:
    pid: int
    comm: str
    state: str  # R, S, D, Z, T, ...
    ppid: int
    session: int
    tty_nr: int  # 0: no controlling terminal
    starttime: int  # clock ticks since boot: (pid, starttime) names a process uniquely


def stat(pid: int) -> ProcStat:
    try:
        raw = (PROC / str(pid) / "stat").read_text()
    except FileNotFoundError:
        raise NoSuchProcess(f"no process with pid {pid}") from None
    # comm is in parentheses and may itself contain ') '; split at the last one.
    head, _, rest = raw.rpartition(")")
    comm = head.split("(", 1)[1]
    fields = rest.split()
    return ProcStat(pid=pid, comm=comm, state=fields[0], ppid=int(fields[1]),
                    session=int(fields[3]), tty_nr=int(fields[4]), starttime=int(fields[19]))


def age(pid: int) -> float:
    """Seconds since the process started."""
    uptime = float((PROC / "uptime").read_text().split()[0])
    return uptime - stat(pid).starttime / os.sysconf("SC_CLK_TCK")


def exists(pid: int) -> bool:
    return (PROC / str(pid)).exists()


def alive(pid: int) -> bool:
    """Exists and is not a zombie."""
    try:
        return stat(pid).state != "Z"
    except NoSuchProcess:
        return False


PF_EXITING = 0x4  # include/linux/sched.h: the thread has begun to exit


def _leaving(stat_text: str) -> bool:
    fields = stat_text.rpartition(")")[2].split()
    return fields[0] in ("Z", "X", "x") or bool(int(fields[6]) & PF_EXITING)


def ending(pid: int) -> bool:
    """Gone, or every thread of it a zombie or exiting: no code of its own runs again, though
    its exit (closing its GPU files: the driver's teardown of its context, 0.1-0.4 s under
    MPS on an H200) may still be under way.  Every thread, not only the leader's: a leader
    that called pthread_exit is a zombie while the others run on; a process that exits
    (exit_group, a fatal signal) cannot start new threads."""
    task = PROC / str(pid) / "task"
    try:
        if not _leaving((PROC / str(pid) / "stat").read_text()):
            return False
        before = set(os.listdir(task))
    except FileNotFoundError:
        return True
    for tid in before:
        try:
            if not _leaving((task / tid / "stat").read_text()):
                return False
        except FileNotFoundError:
            continue  # that thread is gone
    try:
        return set(os.listdir(task)) <= before  # no thread started while we read
    except FileNotFoundError:
        return True


def comm(pid: int) -> str | None:
    """The process's name (its comm), or None when it is gone or cannot be read."""
    try:
        return (PROC / str(pid) / "comm").read_text().strip() or None
    except OSError:
        return None


def read_environ(pid: int, proc: Path = PROC) -> dict[str, str] | None:
    """pid's environment as it started (None: gone, or not ours to read)."""
    try:
        raw = (proc / str(pid) / "environ").read_bytes()
    except OSError:
        return None
    env = {}
    for item in raw.split(b"\0"):
        k, sep, v = item.partition(b"=")
        if sep:
            env[k.decode(errors="replace")] = v.decode(errors="replace")
    return env


def cmdline(pid: int) -> list[str]:
    try:
        raw = (PROC / str(pid) / "cmdline").read_bytes()
    except FileNotFoundError:
        raise NoSuchProcess(f"no process with pid {pid}") from None
    return [a.decode(errors="replace") for a in raw.split(b"\0") if a]


def all_pids() -> list[int]:
    """Every process's pid now (the entries of /proc that are numbers)."""
    return [int(d) for d in os.listdir(PROC) if d.isdigit()]


def tids(pid: int) -> list[int]:
    try:
        return sorted(int(t) for t in os.listdir(PROC / str(pid) / "task"))
    except FileNotFoundError:
        raise NoSuchProcess(f"no process with pid {pid}") from None


def thread_states(pid: int) -> dict[int, str]:
    """Each thread's state letter (R, S, T stopped, t traced, ...), for threads still there."""
    out = {}
    for tid in tids(pid):
        try:
            raw = (PROC / str(pid) / "task" / str(tid) / "stat").read_text()
        except FileNotFoundError:
            continue
        out[tid] = raw.rpartition(")")[2].split()[0]
    return out


def children(pid: int) -> list[int]:
    kids: set[int] = set()
    task_dir = PROC / str(pid) / "task"
    try:
        for tid in os.listdir(task_dir):
            try:
                kids.update(int(c) for c in (task_dir / tid / "children").read_text().split())
            except FileNotFoundError:
                continue
    except FileNotFoundError:
        raise NoSuchProcess(f"no process with pid {pid}") from None
    return sorted(kids)


def tree(pid: int) -> list[int]:
    """pid and all its descendants, parents before children."""
    order, queue = [], [pid]
    while queue:
        p = queue.pop(0)
        order.append(p)
        try:
            queue.extend(children(p))
        except NoSuchProcess:
            order.remove(p)
    return order


def ns_pids(pid: int, tid: int | None = None) -> list[int]:
    """The task's ids from ours to its innermost pid namespace (``NSpid``): one entry for a
    task of our own namespace; the last is the id the task itself sees."""
    where = PROC / str(pid) / ("task/" + str(tid) if tid is not None else "") / "status"
    try:
        text = where.read_text()
    except (FileNotFoundError, ProcessLookupError):
        raise NoSuchProcess(f"no process with pid {pid}") from None
    m = re.search(r"^NSpid:\s*(.*)$", text, re.M)
    return [int(x) for x in m.group(1).split()] if m else [pid]


def own_pid(pid: int) -> int:
    """The id process ``pid`` (ours) has in its own pid namespace: what its getpid() says."""
    return ns_pids(pid)[-1]


def thread_by_own_id(pid: int, own_tid: int) -> int:
    """The id here of the thread of ``pid`` that calls itself ``own_tid`` (a process in a pid
    namespace of its own reports its threads by its namespace's ids)."""
    if len(ns_pids(pid)) == 1:
        return own_tid
    for tid in tids(pid):
        try:
            if ns_pids(pid, tid)[-1] == own_tid:
                return tid
        except NoSuchProcess:
            continue
    if own_tid in tids(pid):  # named by our ids after all
        return own_tid
    raise NoSuchProcess(f"pid {pid} has no thread {own_tid} in its namespace")


@dataclass
class Mapping:
    """One line of /proc/PID/maps."""
    start: int
    end: int
    perms: str  # e.g. r-xp
    path: str  # "" for anonymous memory; "[vdso]", "... (deleted)" as the kernel writes them


def mappings(pid: int) -> list[Mapping]:
    found = []
    try:
        with open(PROC / str(pid) / "maps") as f:
            for line in f:
                parts = line.split(None, 5)
                start, end = (int(x, 16) for x in parts[0].split("-"))
                found.append(Mapping(start, end, parts[1],
                                     parts[5].rstrip("\n") if len(parts) == 6 else ""))
    except FileNotFoundError:
        raise NoSuchProcess(f"no process with pid {pid}") from None
    except PermissionError:
        raise NotPermitted(f"not permitted to inspect pid {pid} (run as root)") from None
    return found


def open_files(pid: int) -> dict[int, str]:
    """fd -> what it refers to (the link in /proc/PID/fd), for the fds still open."""
    fd_dir = PROC / str(pid) / "fd"
    try:
        fds = os.listdir(fd_dir)
    except FileNotFoundError:
        raise NoSuchProcess(f"no process with pid {pid}") from None
    except PermissionError:
        raise NotPermitted(f"not permitted to inspect pid {pid} (run as root)") from None
    found = {}
    for fd in fds:
        try:
            found[int(fd)] = os.readlink(fd_dir / fd)
        except OSError:
            continue  # closed meanwhile
    return found


def uses_cuda(pid: int) -> bool:
    """Whether the process has the CUDA driver library mapped."""
    return any("libcuda.so" in m.path for m in mappings(pid))


def check_target(pid: int) -> ProcStat:
    """A live process we may checkpoint: exists, not a zombie, and we may trace it."""
    if pid <= 0:
        raise NoSuchProcess(f"invalid pid {pid}")
    st = stat(pid)
    if st.state == "Z":
        raise NoSuchProcess(f"pid {pid} is a zombie (exited, not yet reaped by its parent {st.ppid})")
    if pid == os.getpid():
        raise NotPermitted("gpuos cannot checkpoint itself")
    if os.geteuid() != 0:
        raise NotPermitted("checkpointing needs root (CRIU and the driver's checkpoint API)")
    return st


# Terminal devices by major number: 4 virtual consoles and serial lines, 136-143 pty slaves.
TTY_MAJORS = {4, *range(136, 144)}


def terminals(pid: int) -> list[tuple[str, int, int]]:
    """The terminals the process has open: (path, rdev, st_dev of the node's file system)."""
    found = {}
    for fd, path in open_files(pid).items():
        try:
            st = os.stat(PROC / str(pid) / "fd" / str(fd))
        except OSError:
            continue  # closed meanwhile
        if stat_mod.S_ISCHR(st.st_mode) and os.major(st.st_rdev) in TTY_MAJORS:
            found[st.st_rdev] = (path, st.st_rdev, st.st_dev)
    return list(found.values())
