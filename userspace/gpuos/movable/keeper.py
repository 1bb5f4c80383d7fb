"""The keeper: holds a process's handed-out device memory while gpuos checkpoints it.

Between RELEASE and the memory's return, the only references to a process's movable
memory are file descriptors.  If they lived only in gpuos, a gpuos killed in that
window would take the process's memory with it.  So `gpuos checkpoint` starts a keeper,
a process of its own session that gpuos's death does not end, and gives it a copy of
every descriptor before the RELEASE; `gpuos recover` fetches them from it and maps
them back.  The keeper serves an abstract unix socket "gpuos-keeper-<op id>" (same uid
or root): a connection that sends b"GET" receives the descriptors (in batches of
FDS_PER_MSG, after a count) and the keeper exits; b"DROP" makes it exit.  Unclaimed, it
exits after KEEP_S.

    python3 -m gpuos.movable.keeper OP_ID FD   (FD: a socket to receive the descriptors on)
"""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import sys
import time

FDS_PER_MSG = 200
KEEP_S = 24 * 3600
COUNT = struct.Struct("<I")


def keeper_address(op_id: str) -> bytes:
    return f"\0gpuos-keeper-{op_id}".encode()


def spawn(op_id: str) -> socket.socket:
    """Start a keeper for this name (before the stop: starting Python takes a while); the
    socket to give() it the descriptors on.  Closing it unused ends the keeper."""
    mine, theirs = socket.socketpair()
    with theirs:
        subprocess.Popen([sys.executable, "-m", "gpuos.movable.keeper", op_id, str(theirs.fileno())],
                         pass_fds=[theirs.fileno()], start_new_session=True, stdin=subprocess.DEVNULL,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return mine


def give(inbox: socket.socket, fds: list[int]) -> None:
    """Copies of fds to the keeper; returns once it holds them and serves."""
    with inbox:
        inbox.settimeout(60)
        inbox.sendall(COUNT.pack(len(fds)))
        for first in range(0, len(fds), FDS_PER_MSG):
            socket.send_fds(inbox, [b"F"], fds[first:first + FDS_PER_MSG])
        if inbox.recv(1) != b"K":
            raise OSError("the keeper did not take the descriptors")


def _request(op_id: str, what: bytes, timeout: float = 30.0) -> socket.socket | None:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect(keeper_address(op_id))
    except OSError:
        s.close()
        return None
    s.sendall(what)
    return s


def fetch(op_id: str) -> list[int] | None:
    """The descriptors the keeper of op_id holds (it then exits); None: no keeper."""
    s = _request(op_id, b"GET")
    if s is None:
        return None
    with s:
        (n,) = COUNT.unpack(_exact(s, COUNT.size))
        fds: list[int] = []
        while len(fds) < n:
            _, got, _, _ = socket.recv_fds(s, 1, FDS_PER_MSG)
            if not got:
                raise OSError("the keeper closed before sending every descriptor")
            fds.extend(got)
        return fds


def drop(op_id: str) -> None:
    """The keeper of op_id lets go (the memory is back where it belongs)."""
    s = _request(op_id, b"DROP")
    if s is not None:
        with s:
            s.recv(1)  # it closes when done


def _exact(s: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        data = s.recv(n - len(buf))
        if not data:
            raise OSError("the keeper closed the connection")
        buf += data
    return buf


def main(op_id: str, fd: int) -> int:
    with socket.socket(fileno=fd) as inbox:
        try:
            (n,) = COUNT.unpack(_exact(inbox, COUNT.size))
        except OSError:
            return 0  # closed unused: nothing to keep
        held: list[int] = []
        while len(held) < n:
            _, got, _, _ = socket.recv_fds(inbox, 1, FDS_PER_MSG)
            if not got:
                return 1
            held.extend(got)
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(keeper_address(op_id))
        server.listen(4)
        inbox.sendall(b"K")
    deadline = time.monotonic() + KEEP_S
    server.settimeout(60)
    while time.monotonic() < deadline:
        try:
            conn, _ = server.accept()
        except TimeoutError:
            continue
        with conn:
            uid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[1]
            if uid not in (0, os.getuid()):
                continue
            what = conn.recv(8)
            if what == b"GET":
                conn.sendall(COUNT.pack(len(held)))
                for first in range(0, len(held), FDS_PER_MSG):
                    socket.send_fds(conn, [b"F"], held[first:first + FDS_PER_MSG])
                return 0
            if what == b"DROP":
                return 0
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2])))
