"""One restore's host memory on demand.

Before CRIU restores: every pagemap of the read-out image is rewritten so that what the
driver reads back into the GPU at its restore (``ProcessInfo.driver_saved``: the memory the
driver's checkpoint added to the process, found at the checkpoint) is not lazy, the pages
images are read out only where CRIU will read them (the pages that are not lazy), and two
helpers start, each in a session of its own: gpuos's page server (server.py), which reads
the lazy pages from the chunks, and ``criu lazy-pages``, which takes the restored
processes' userfaultfds and fills each page when it is first touched, the rest in the
background. CRIU's restore runs with --lazy-pages. After the processes go on, ``finish``
waits until the daemon has put every page in.

A corrupt chunk is never a zero page: the server stops answering, the process waits at
that page, and ``finish`` raises (the caller kills the processes). The helpers do not
depend on gpuos: if it dies after the restore, they finish the job.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from ..criu import Criu
from ..errors import GpuosError, ImageCorrupt
from ..manifest import CRIU_DIR
from . import pagemap as pm

SOCKET = "lazy-pages.socket"  # CRIU's, in the restore's work directory
LOG = "lazy-pages.log"
READY_TIMEOUT = 30.0


def unsupported(criu: Criu) -> str | None:
    """Why CRIU cannot restore lazily here (no userfaultfd with the events it needs), or None."""
    try:
        res = subprocess.run(criu.command(["check", "--feature", "uffd-noncoop"]), capture_output=True,
                             text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"criu check failed: {exc}"
    if res.returncode == 0:
        return None
    said = (res.stdout + res.stderr).strip().splitlines()
    return f"the kernel refuses userfaultfd to CRIU ({said[-1] if said else f'exit {res.returncode}'})"


def plan(criu_dir: Path, eager: dict[int, list[tuple[int, int]] | None]) -> dict[str, list[tuple[int, int]]]:
    """Rewrite the pagemaps in criu_dir: pages of a pid in ``eager`` within its ranges (all
    of them for None) are not lazy. Per pages image (its path in the image), the (offset,
    length) ranges CRIU's restore reads itself."""
    parts: dict[str, list[tuple[int, int]]] = {}
    for f in sorted(criu_dir.glob("pagemap-*.img")):
        name = f.stem.removeprefix("pagemap-")
        m = pm.parse(f.read_bytes(), str(f))
        rel = f"{CRIU_DIR}/{m.pages_file}"
        if not name.isdigit():  # shared memory: restored eagerly
            parts.setdefault(rel, []).extend(m.eager_except(lazy_ok=False))
            continue
        pid = int(name)
        if pid in eager:
            ranges = eager[pid]
            m = pm.make_eager(m, ranges if ranges is not None else [(0, 1 << 64)])
            tmp = f.with_suffix(".tmp")
            tmp.write_bytes(pm.encode(m))
            os.replace(tmp, f)
        parts.setdefault(rel, []).extend(m.eager_except())
    return parts


SO_SNDBUFFORCE, SO_RCVBUFFORCE = 32, 33
BUFFER = 8 << 20


def _big_buffers(sk: socket.socket) -> None:
    for force, plain in ((SO_SNDBUFFORCE, socket.SO_SNDBUF), (SO_RCVBUFFORCE, socket.SO_RCVBUF)):
        try:
            sk.setsockopt(socket.SOL_SOCKET, force, BUFFER)  # past net.core.*mem_max: root
        except OSError:
            sk.setsockopt(socket.SOL_SOCKET, plain, BUFFER)


class LazyHost:
    """The page server and the lazy-pages daemon of one restore."""

    def __init__(self, criu: Criu, image: Path, criu_dir: Path, workdir: Path, hot: Path | None,
                 verify: bool):
        workdir.mkdir(parents=True, exist_ok=True)
        (workdir / SOCKET).unlink(missing_ok=True)
        self.workdir = workdir
        self.lines: list[str] = []
        self.changed = threading.Condition()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        for sk in (ours, theirs):  # a whole 4 MiB answer in flight (the daemon's largest request)
            _big_buffers(sk)
        r, w = os.pipe()
        self.server = self.daemon = None
        try:
            cmd = [sys.executable, "-m", "gpuos.hostmem.server", str(image), str(criu_dir),
                   "--socket", str(ours.fileno()), "--report", str(w)]
            cmd += ["--hot", str(hot)] if hot else []
            cmd += [] if verify else ["--no-verify"]
            self.server = subprocess.Popen(cmd, pass_fds=(ours.fileno(), w), stdin=subprocess.DEVNULL,
                                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                           start_new_session=True)
            os.close(w)
            w = -1
            threading.Thread(target=self._read_report, args=(r,), daemon=True).start()
            r = -1
            self._wait_line(("ready", "error"), READY_TIMEOUT, "gpuos's page server to start")
            args = ["lazy-pages", "-D", str(criu_dir), "-W", str(workdir), "-o", LOG,
                    "--page-server", "--ps-socket", str(theirs.fileno())]
            self.daemon = subprocess.Popen(criu.command(args, verbosity=2), pass_fds=(theirs.fileno(),),
                                           stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                           stderr=subprocess.DEVNULL, start_new_session=True)
            deadline = time.monotonic() + READY_TIMEOUT
            while not (workdir / SOCKET).exists():  # restore connects to it
                if self.daemon.poll() is not None or time.monotonic() > deadline:
                    raise GpuosError(f"criu lazy-pages did not start (log: {workdir / LOG})")
                time.sleep(0.002)
        except BaseException:
            self.abort()
            raise
        finally:
            ours.close()
            theirs.close()
            for fd in (r, w):
                if fd >= 0:
                    os.close(fd)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in (self.server, self.daemon) if p is not None]

    def _read_report(self, fd: int) -> None:
        with os.fdopen(fd) as f:
            for line in f:
                with self.changed:
                    self.lines.append(line.strip())
                    self.changed.notify_all()
        with self.changed:
            self.lines.append("eof")
            self.changed.notify_all()

    def _wait_line(self, words: tuple[str, ...], timeout: float | None, what: str) -> str:
        with self.changed:
            ok = self.changed.wait_for(lambda: any(ln.split(" ", 1)[0] in (*words, "eof") for ln in self.lines),
                                       timeout)
            if not ok:
                raise GpuosError(f"timed out waiting for {what}")
            line = next(ln for ln in self.lines if ln.split(" ", 1)[0] in (*words, "eof"))
        word, _, rest = line.partition(" ")
        if word == "error":
            raise ImageCorrupt(f"host memory: {rest}")
        if word == "eof":
            raise GpuosError(f"gpuos's page server ended while waiting for {what}")
        return rest

    def finish(self) -> dict:
        """Wait until every page is in (the daemon ends); the server's counts. Raises if a
        chunk was bad or the daemon failed: the processes may be waiting on a page that
        will never come, or (daemon failed) have memory that cannot be trusted."""
        while self.daemon.poll() is None:
            with self.changed:
                if any(ln.startswith("error") for ln in self.lines):
                    break
                self.changed.wait(0.05)
        if self.daemon.poll() is None or self.daemon.returncode != 0:
            bad = next((ln for ln in self.lines if ln.startswith("error")), None)
            self.abort()
            if bad:
                raise ImageCorrupt(f"host memory: {bad.partition(' ')[2]}")
            raise GpuosError(f"criu lazy-pages failed (exit {self.daemon.returncode}; log {self.workdir / LOG})")
        stats = json.loads(self._wait_line(("done",), 60, "gpuos's page server to end"))
        self.server.wait()
        return stats

    def abort(self) -> None:
        for p in (self.daemon, self.server):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
