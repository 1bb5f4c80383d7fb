"""The first process of a replica's namespaces: ``python -m gpuos.nsinit FD -- CRIU...``.

A replica (``gpuos restore --replicas N``) is a copy of an image's processes with the
pids, network and /proc of its own, so that N copies of one tree (same pids, same
listening sockets, same agent name) can run side by side, as in N containers. gpuos
starts this program with new network and mount namespaces and a new pid namespace for
its children (``replica_preexec``, before exec). It forks once: the child is pid 1 of
the new pid namespace, and the parent writes ``init HOST_PID`` on FD and exits at once.

Pid 1 makes its mounts private, mounts a /proc of the new pid namespace (CRIU creates
the image's pids through it) and brings up loopback, runs CRIU's restore as its child,
writes ``criu RC`` on FD and closes it. The restored tree's root is reparented to pid 1
when CRIU exits; pid 1 reaps until nothing is left in the namespace, and passes SIGTERM,
SIGINT and SIGHUP on to every process of it. When pid 1 ends, the kernel ends the
namespace: a replica never outlives its init.

Only the standard library: it must start fast, N times at once.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import signal
import socket
import struct
import subprocess
import sys

CLONE_NEWNS, CLONE_NEWPID, CLONE_NEWNET = 0x00020000, 0x20000000, 0x40000000
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REC, MS_PRIVATE = 2, 4, 8, 0x4000, 1 << 18
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 1


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def replica_preexec() -> None:
    """In the child gpuos forks for this program, before exec: new namespaces (the pid one
    for its children) and a session of its own."""
    libc = _libc()
    _check(libc.unshare(CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET), "unshare")
    os.setsid()


def _loopback_up() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        req = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(s, SIOCGIFFLAGS, req))[1]
        fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags | IFF_UP))


def _pid1(report: int, criu: list[str]) -> int:
    libc = _libc()
    _check(libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None), "making mounts private")
    _check(libc.mount(b"proc", b"/proc", b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None), "mounting /proc")
    _loopback_up()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda s, _f: os.kill(-1, s))  # -1 from pid 1: everyone in the namespace
    rc = subprocess.run(criu, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL, pass_fds=()).returncode
    os.write(report, f"criu {rc}\n".encode())
    os.close(report)
    while True:
        try:
            os.wait()
        except ChildProcessError:
            return 0
        except InterruptedError:
            continue


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print("usage: python -m gpuos.nsinit FD -- CRIU-COMMAND...", file=sys.stderr)
        return 2
    report, criu = int(argv[0]), argv[2:]
    pid = os.fork()
    if pid == 0:
        try:
            code = _pid1(report, criu)
        except BaseException as exc:  # noqa: BLE001 - said on the report fd, the only listener
            try:
                os.write(report, f"error {exc}\n".encode())
            except OSError:
                pass
            code = 1
        os._exit(code)
    os.write(report, f"init {pid}\n".encode())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
