"""Shared bits of the fake MPS programs (tests/fake_mps): paths, sockets, state files.

The fake control daemon, server and client talk over unix sockets in the pipe
directory, like the real ones; the wire format is the fakes' own:

    pipe/control                      the daemon: one command line in, its answer out
    pipe/nvidia-cuda-mps-control.pid  the daemon's pid (as the real daemon writes it)
    pipe/fake-server-PID.sock         a server: clients stay connected to it
    pipe/fake-server-PID.json         a server's state: {"status": ACTIVE|FAULT, "clients": [pids]}
    pipe/fake-refuse-starts           N: refuse the next N server starts ("always": all)

Sockets are bound and reached relative to the pipe directory (chdir, or
/proc/self/fd/N/NAME), so long test paths do not hit sun_path's 108 bytes.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

PID_FILE = "nvidia-cuda-mps-control.pid"


def pipe_dir() -> Path:
    return Path(os.environ.get("CUDA_MPS_PIPE_DIRECTORY") or "/tmp/nvidia-mps")


def log_dir() -> Path:
    return Path(os.environ.get("CUDA_MPS_LOG_DIRECTORY") or "/var/log/nvidia-mps")


def connect(path: Path, timeout: float = 5.0) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        s.connect(f"/proc/self/fd/{fd}/{path.name}")
    except OSError:
        s.close()
        raise
    finally:
        os.close(fd)
    return s


def bind(path: Path) -> socket.socket:
    try:
        path.unlink()
    except FileNotFoundError:
        pass
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        s.bind(f"/proc/self/fd/{fd}/{path.name}")
    finally:
        os.close(fd)
    s.listen(64)
    return s


def ask(path: Path, line: str, timeout: float = 5.0) -> str:
    s = connect(path, timeout)
    try:
        s.sendall(line.encode() + b"\n")
        s.shutdown(socket.SHUT_WR)
        data = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
        return data.decode()
    finally:
        s.close()


def write_json(path: Path, obj) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj))
    os.rename(tmp, path)


def read_json(path: Path, default=None):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return default


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False
