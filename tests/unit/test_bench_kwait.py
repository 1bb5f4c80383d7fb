"""bench/kwait.py: where threads wait in the kernel, sampled from /proc (this host's own
threads: a wait it makes on purpose must be found, with its call, file and length)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import kwait  # noqa: E402


def test_parse_syscall_and_stack():
    assert kwait.parse_syscall("running") == ("running", [])
    assert kwait.parse_syscall("16 0x5 0xc0304627 0x7ffd 0x0 0x0 0x0 0x7ffd 0x7f00") == \
        ("ioctl", ["0x5", "0xc0304627", "0x7ffd", "0x0", "0x0", "0x0"])
    assert kwait.parse_syscall("999 0x1")[0] == "999"
    stack = "[<0>] rm_ioctl+0x1a/0x40 [nvidia]\n[<0>] nvidia_ioctl+0x55/0x90 [nvidia]\n[<0>] __x64_sys_ioctl+0x8d/0xc0\n"
    assert kwait.parse_stack(stack) == ["rm_ioctl", "nvidia_ioctl", "__x64_sys_ioctl"]
    assert kwait.parse_stack(stack, frames=1) == ["rm_ioctl"]


def test_a_blocking_read_is_one_wait_of_its_length():
    r, w = os.pipe()
    ready = threading.Event()

    def reader():
        ready.set()
        os.read(r, 1)

    t = threading.Thread(target=reader)
    t.start()
    ready.wait()
    time.sleep(0.02)
    s = kwait.WaitSampler({os.getpid(): "me"}, period_s=0.002)
    t0 = time.time()
    s.start()
    time.sleep(0.15)
    os.write(w, b"x")
    t.join()
    time.sleep(0.03)
    s.stop()
    waits = [x for x in s.waits(min_s=0.05, since=t0) if x["call"] == "read" and x["tid"] == t.native_id]
    assert len(waits) == 1, s.waits(min_s=0.0)
    x = waits[0]
    assert x["file"].startswith("pipe:") and x["role"] == "me"
    assert 0.1 <= x["seconds"] <= 0.2 and -0.01 <= x["from_s"] <= 0.03
    assert s.samples > 10
    os.close(r)
    os.close(w)


def test_nvidia_ioctls_are_named_by_what_they_ask():
    assert kwait.nv_ioctl(0xC020462A, 0x20800A01) == "rm-control 0x20800a01"
    assert kwait.nv_ioctl(0xC030462B, 0xC86F) == "rm-alloc 0xc86f"
    assert kwait.nv_ioctl(0xC0384627, 0x71) == "rm-alloc-memory 0x71"
    assert kwait.nv_ioctl(0xC020462A, None) == "rm-control"
    assert kwait.nv_ioctl(0x5413, 7) == ""          # TIOCGWINSZ: not the driver's
    assert kwait.nv_ioctl(0xC0084600, 7) == ""      # 'F', an escape not decoded


def test_peek_reads_this_process_memory():
    import ctypes
    v = ctypes.c_uint32(0xDEADBEEF)
    assert kwait._peek_u32(os.getpid(), ctypes.addressof(v)) == 0xDEADBEEF
    assert kwait._peek_u32(os.getpid(), 0) is None


def test_a_process_added_later_is_sampled_from_then_on():
    """add(): a process started after the sampler (the faulter) is sampled too: a child
    blocked in a read of a pipe."""
    import subprocess

    p = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read(1)"],
                         stdin=subprocess.PIPE)
    try:
        time.sleep(0.3)
        s = kwait.WaitSampler({}, period_s=0.001, t0=time.time())
        s.sample_once(time.time())
        assert not s._open
        s.add(p.pid, "faulter")
        s.sample_once(time.time())
        assert [w.call for (pid, _), w in s._open.items() if pid == p.pid] == ["read"]
    finally:
        p.kill()
        p.wait()


def test_a_blocked_calls_caller_is_found_on_its_user_stack():
    """kwait.user_frames: a child blocked in read(2) on a pipe; the scan of its user stack
    finds the C library (the read's program counter) and, above it, the interpreter that
    called it, each as a file and an offset in it."""
    child = subprocess.Popen([sys.executable, "-c", "import os; os.read(0, 1)"], stdin=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            call, _ = kwait.parse_syscall(Path(f"/proc/{child.pid}/syscall").read_text())
            if call == "read":
                break
            time.sleep(0.01)
        frames = kwait.user_frames(child.pid, child.pid, kwait.exec_maps(child.pid))
    finally:
        child.kill()
        child.wait()
    names = [Path(f).name for f in frames]
    assert names and names[0].startswith("libc"), frames
    assert all("+0x" in f for f in frames) and all(a != b for a, b in zip(frames, frames[1:])), frames
    assert any(not n.startswith("libc") for n in names), frames  # its callers, above the C library
