"""Keeping a CUDA process's own threads still while its GPU state is checkpointed.

The driver's checkpoint API does not stop CPU threads: once a process is
checkpointed, the GPU mappings behind its device pointers are gone, and a thread
that touches one dies with SIGSEGV. Most programs never do while their CUDA calls
are blocked by the lock; XLA does within seconds (docs/checkpoint-restore.md, "Why
JAX died"). So from the driver's checkpoint until its restore, gpuos keeps every
thread of the process stopped except the driver's *restore thread*
(``cuCheckpointProcessGetRestoreThreadId``), which carries out the checkpoint and
the restore inside the process. CRIU's CUDA plugin does the same.

Two ways a process is held:

* **ptrace** (``ThreadHold``): every thread is ``PTRACE_SEIZE``d and interrupted;
  the restore thread is then let run with every signal blocked, so no signal
  handler of the application runs on it. The parent is not notified.
* **group stop**: ``ThreadHold.stop()`` hands the process over to CRIU. CRIU must
  seize the threads itself, so gpuos lets go of them without letting any run: it
  sends SIGSTOP while it still holds every thread and only then detaches, so each
  thread leaves ptrace straight into the group stop. CRIU dumps a stopped process
  (and with --leave-running leaves it stopped); ``hold()`` takes a stopped process
  back (SIGCONT while every thread is seized: none runs but the restore thread).

All ptrace requests must come from the thread that seized: the hold is used from
one thread of gpuos. If gpuos dies, the kernel detaches its tracees and they run
again; a group-stopped process stays stopped until recovery takes it back.
"""

from __future__ import annotations

import ctypes
import errno
import os
import signal
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from . import procs
from .cudadrv import CHECKPOINTED, LOCKED
from .errors import GpuosError, NoSuchProcess, NotPermitted

if TYPE_CHECKING:
    from .cudadrv import GpuDriver

PTRACE_CONT, PTRACE_SINGLESTEP, PTRACE_GETREGS, PTRACE_SETREGS, PTRACE_DETACH = 7, 9, 12, 13, 17
PTRACE_SEIZE, PTRACE_INTERRUPT = 0x4206, 0x4207
PTRACE_GETSIGMASK, PTRACE_SETSIGMASK = 0x420A, 0x420B
PTRACE_EVENT_STOP = 128
WALL = 0x40000000
ALL_SIGNALS = ctypes.c_uint64(0xFFFFFFFFFFFFFFFF)  # the kernel never blocks SIGKILL and SIGSTOP

_libc = ctypes.CDLL(None, use_errno=True)
_libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
_libc.ptrace.restype = ctypes.c_long


class _Regs(ctypes.Structure):
    """x86-64 ``struct user_regs_struct``."""
    _fields_ = [(n, ctypes.c_uint64) for n in (
        "r15 r14 r13 r12 rbp rbx r11 r10 r9 r8 rax rcx rdx rsi rdi orig_rax rip cs eflags rsp ss "
        "fs_base gs_base ds es fs gs").split()]


def _ptrace(request: int, tid: int, addr: int = 0, data: object = None) -> int:
    """One ptrace request; returns 0, or the errno."""
    if isinstance(data, (ctypes._SimpleCData, ctypes.Structure)):
        arg = ctypes.cast(ctypes.pointer(data), ctypes.c_void_p)
    else:
        arg = ctypes.c_void_p(data or 0)
    return 0 if _libc.ptrace(request, tid, ctypes.c_void_p(addr), arg) == 0 else ctypes.get_errno()


def _wait_stop(tid: int, deadline: float) -> int | None:
    """Wait until a seized thread stops; return the signal of a signal-delivery stop (which
    must be sent again when the thread is let go) or None for a ptrace event stop. Raises
    NoSuchProcess if it exited."""
    while True:
        try:
            got, status = os.waitpid(tid, WALL | os.WNOHANG)
        except ChildProcessError:
            raise NoSuchProcess(f"thread {tid} is gone") from None
        if got == tid:
            if os.WIFEXITED(status) or os.WIFSIGNALED(status):
                raise NoSuchProcess(f"thread {tid} exited")
            if os.WIFSTOPPED(status):
                sig = os.WSTOPSIG(status)
                if status >> 16 == PTRACE_EVENT_STOP or sig == signal.SIGTRAP:
                    return None
                if sig in (signal.SIGSTOP, signal.SIGTSTP, signal.SIGTTIN, signal.SIGTTOU):
                    return None  # a group stop reported before our interrupt; nothing to re-send
                return sig
        if time.monotonic() > deadline:
            raise GpuosError(f"thread {tid} did not stop under ptrace within the time allowed")
        time.sleep(0.001)


@dataclass
class ThreadHold:
    """Every thread of ``pid`` stopped under ptrace by this process, except ``runner`` (the
    driver's restore thread, if any), which runs with every signal blocked."""

    pid: int
    runner: int | None
    seized: list[int] = field(default_factory=list)
    resend: dict[int, int] = field(default_factory=dict)  # tid -> signal caught while seizing
    runner_mask: ctypes.c_uint64 = field(default_factory=ctypes.c_uint64)
    runner_running: bool = False

    def _seize_all(self, deadline: float) -> None:
        while True:
            new = [t for t in procs.tids(self.pid) if t not in self.seized]
            if not new:
                return
            for tid in new:
                err = _ptrace(PTRACE_SEIZE, tid)
                if err == errno.ESRCH:
                    continue  # exited meanwhile
                if err == errno.EPERM:
                    raise NotPermitted(f"cannot ptrace thread {tid} of pid {self.pid}: another "
                                       "tracer (a debugger?) holds it, or gpuos is not root")
                if err:
                    raise GpuosError(f"ptrace seize of thread {tid} of pid {self.pid}: "
                                     f"{os.strerror(err)}")
                self.seized.append(tid)
                _ptrace(PTRACE_INTERRUPT, tid)
            for tid in new:
                if tid in self.seized:
                    try:
                        sig = _wait_stop(tid, deadline)
                    except NoSuchProcess:
                        self.seized.remove(tid)
                        continue
                    if sig:
                        self.resend[tid] = sig

    def _start_runner(self, notified: bool) -> None:
        if self.runner not in self.seized:
            raise GpuosError(f"the driver's restore thread {self.runner} is not a thread of pid {self.pid}")
        for req, arg in ((PTRACE_GETSIGMASK, self.runner_mask), (PTRACE_SETSIGMASK, ALL_SIGNALS)):
            err = _ptrace(req, self.runner, 8, arg)
            if err:
                raise GpuosError(f"ptrace sigmask of thread {self.runner}: {os.strerror(err)}")
        err = _ptrace(PTRACE_CONT, self.runner)
        if not err and notified:
            # A SIGCONT that came while it was seized is reported first: one more stop.
            _wait_stop(self.runner, time.monotonic() + 5)
            err = _ptrace(PTRACE_CONT, self.runner)
        if err:
            raise GpuosError(f"ptrace cont of thread {self.runner}: {os.strerror(err)}")
        self.runner_running = True

    def _stop_runner(self) -> None:
        if not self.runner_running:
            return
        _ptrace(PTRACE_INTERRUPT, self.runner)
        try:
            sig = _wait_stop(self.runner, time.monotonic() + 10)
        except NoSuchProcess:
            self.seized.remove(self.runner)
            self.runner_running = False
            return
        if sig:
            self.resend[self.runner] = sig
        _ptrace(PTRACE_SETSIGMASK, self.runner, 8, self.runner_mask)
        self.runner_running = False

    def _detach_all(self) -> None:
        for tid in self.seized:
            _ptrace(PTRACE_DETACH, tid)
        self.seized = []

    def _resend(self) -> None:
        for tid, sig in self.resend.items():
            _libc.tgkill(self.pid, tid, sig)  # to the thread that had it; gone is fine
        self.resend = {}

    def syscall(self, nr: int, *args: int) -> int:
        """Make a stopped thread of the process run one system call (x86-64) and return its
        result (negative: -errno); the thread is then exactly where it was, an interrupted
        system call of its own restarted as the kernel would have. The instruction run is a
        ``syscall`` already in the process's vDSO or libc: its memory is not written."""
        tid = next((t for t in self.seized if t != self.runner), None)
        if tid is None or os.uname().machine != "x86_64":
            raise GpuosError(f"cannot run a system call in pid {self.pid} "
                             f"({'no stopped thread' if tid is None else os.uname().machine})")
        saved = _Regs()
        if _ptrace(PTRACE_GETREGS, tid, 0, saved):
            raise GpuosError(f"ptrace getregs of thread {tid} failed")
        regs = _Regs.from_buffer_copy(saved)
        regs.rip = _syscall_instruction(self.pid)
        regs.orig_rax = 2**64 - 1  # not in a system call: no restart of the interrupted one
        regs.rax = nr
        for name, value in zip(("rdi", "rsi", "rdx", "r10", "r8", "r9"), args):
            setattr(regs, name, value & (2**64 - 1))
        try:
            if _ptrace(PTRACE_SETREGS, tid, 0, regs):
                raise GpuosError(f"ptrace setregs of thread {tid} failed")
            for _ in range(64):  # signals that arrive meanwhile stop it first: keep them
                if _ptrace(PTRACE_SINGLESTEP, tid):
                    raise GpuosError(f"ptrace singlestep of thread {tid} failed")
                sig = _wait_stop(tid, time.monotonic() + 10)
                if not sig:
                    break
                self.resend.setdefault(tid, sig)
            done = _Regs()
            _ptrace(PTRACE_GETREGS, tid, 0, done)
            if done.rip != regs.rip + 2:
                raise GpuosError(f"the system call in thread {tid} did not complete")
        finally:
            _ptrace(PTRACE_SETREGS, tid, 0, saved)
        return ctypes.c_int64(done.rax).value

    def release(self) -> None:
        """Let every thread run again."""
        self._stop_runner()
        self._detach_all()
        self._resend()

    def stop(self, timeout: float = 10.0) -> None:
        """Let go of every thread into a group stop (the process is stopped, 'T'), for CRIU."""
        self._stop_runner()
        os.kill(self.pid, signal.SIGSTOP)  # pending: no thread can take it while all are seized
        self._detach_all()
        self._resend()  # queued while stopped; delivered after SIGCONT
        deadline = time.monotonic() + timeout
        while any(s != "T" for s in procs.thread_states(self.pid).values()):
            if time.monotonic() > deadline:
                raise GpuosError(f"pid {self.pid} did not stop after SIGSTOP "
                                 f"(thread states {procs.thread_states(self.pid)})")
            time.sleep(0.001)


def _syscall_instruction(pid: int) -> int:
    """The address of a ``syscall`` instruction (0f 05) in the process's vDSO or libc code."""
    regions = [(m.path != "[vdso]", m.start, m.end) for m in procs.mappings(pid)
               if "x" in m.perms and (m.path == "[vdso]" or "/libc.so" in m.path or "/libc-" in m.path)]
    with open(f"/proc/{pid}/mem", "rb", buffering=0) as mem:
        for _, start, end in sorted(regions):
            for chunk in range(start, end, 1 << 20):
                mem.seek(chunk)
                data = mem.read(min(1 << 20, end - chunk) + 1)
                at = data.find(b"\x0f\x05")
                if at >= 0:
                    return chunk + at
    raise GpuosError(f"found no syscall instruction in pid {pid}'s vDSO or libc")


def hold(pid: int, runner: int | None = None, timeout: float = 10.0) -> ThreadHold:
    """Stop every thread of ``pid`` but ``runner``, whether the process runs or is
    group-stopped (then it is continued, with only ``runner`` running)."""
    h = ThreadHold(pid=pid, runner=runner)
    was_stopped = any(s == "T" for s in procs.thread_states(pid).values())
    try:
        h._seize_all(time.monotonic() + timeout)
        if was_stopped:
            os.kill(pid, signal.SIGCONT)  # clears the group stop; seized threads stay put
        if runner is not None:
            h._start_runner(notified=was_stopped)
    except BaseException:
        if was_stopped:
            os.kill(pid, signal.SIGSTOP)  # back into the group stop it was in, not running
        h._detach_all()
        raise
    return h


def restore_thread(driver: "GpuDriver", pid: int) -> int:
    """The driver's restore thread of ``pid``, by our id: the driver names it as the
    process sees it, which differs for a process in a pid namespace of its own (a replica)."""
    return procs.thread_by_own_id(pid, driver.restore_thread(pid))


def checkpoint_gpu(driver: "GpuDriver", pid: int) -> None:
    """The driver's checkpoint of a locked process, which is left stopped as a whole (for
    CRIU), or, if the checkpoint fails, left locked and running as before."""
    h = hold(pid, restore_thread(driver, pid))
    try:
        driver.checkpoint(pid)
    except BaseException:
        h.release()
        raise
    h.stop()


def resume_gpu(driver: "GpuDriver", pid: int, gpu_pairs: dict[str, str]) -> str:
    """Restore (if checkpointed) and unlock a process, running or stopped, and let it run.
    If that fails, the process is left stopped (never running without its GPU state) and
    the error raised. Returns what was done."""
    # The driver answers through the restore thread: ask only once it runs (a query of a
    # stopped process waits for ever; measured on H100, r580).
    h = hold(pid, restore_thread(driver, pid))
    try:
        state = driver.state(pid)
    except BaseException:
        h.stop()  # unknown: it may be checkpointed, so it must not run
        raise
    if state not in (CHECKPOINTED, LOCKED):
        h.release()
        return f"pid {pid} was {state}; nothing to do"
    try:
        if state == CHECKPOINTED:
            driver.restore(pid, gpu_pairs)
        driver.unlock(pid)
    except BaseException:
        h.stop()
        raise
    h.release()
    return f"restored and unlocked pid {pid} on the GPU" if state == CHECKPOINTED else f"unlocked pid {pid}"
