"""CRIU's image streamer, played by gpuos: a restore's CRIU files go from the chunks
straight into CRIU (``criu restore --stream``), never written out as files.

CRIU connects to ``<images dir>/streamer-serve.sock`` (criu/img-streamer.c) and, for each
image it opens, sends a request (u32 length, protobuf {1: file name}); the streamer
answers (u32 length, protobuf {1: exists}); for a file that exists CRIU then passes the
write end of a pipe (one byte and SCM_RIGHTS), and the streamer writes the file's content
into it and closes it. CRIU reads each image it opens from start to end, so the chunks are
read (a few ahead, in parallel), checked against their names and written while CRIU
restores.

A corrupt or missing chunk must never look like a shorter image (CRIU reads entries to the
end of a file: a pagemap cut at an entry's end would restore fewer pages). So the pipe is
not closed: the CRIU that asked, and every task it has made, is killed first (its pid from
the socket's credentials), then the pipe closed; ``errors`` says which chunk, and the
restore reports the image as corrupt (exit 10).
"""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
import socket
import struct
import tempfile
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from .. import procs
from ..errors import GpuosError, ImageCorrupt
from ..manifest import FileEntry
from ..observe import Progress
from .content import ImageContent, workers
from .decoders import Decoders

SOCKET = "streamer-serve.sock"
F_SETPIPE_SZ = 1031
PIPE_SIZE = 4 << 20
AHEAD = 8  # chunks of one file read ahead of the pipe


def _request(sock: socket.socket) -> str | None:
    """The next file name CRIU asks for; None when it hung up."""
    head = sock.recv(4, socket.MSG_WAITALL)
    if len(head) < 4:
        return None
    (n,) = struct.unpack("<I", head)
    msg = sock.recv(n, socket.MSG_WAITALL)
    # {1: string}: tag 0x0a, a varint length (names are short: one or two bytes), the name
    if len(msg) < 2 or msg[0] != 0x0A:
        raise GpuosError(f"criu sent the image streamer a request it cannot read: {msg[:40]!r}")
    length, i = msg[1] & 0x7F, 2
    if msg[1] & 0x80:
        length, i = length | (msg[2] << 7), 3
    return msg[i:i + length].decode()


def _kill_tree(pid: int) -> None:
    """SIGKILL pid and all its descendants: stopped first, until no new one appears (a
    stopped process forks no more), then killed."""
    seen: set[int] = set()
    while True:
        found = set(procs.tree(pid)) - seen
        if not found:
            break
        for p in found:
            try:
                os.kill(p, signal.SIGSTOP)
            except ProcessLookupError:
                pass
        seen |= found
    for p in seen:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


class ImageStreamer:
    """Serves the files under ``prefix`` of an image to every CRIU that connects to
    ``directory``/streamer-serve.sock, until closed. ``directory`` (CRIU's -D) is a new one
    of its own, with a short name: a socket's path has at most 107 bytes."""

    def __init__(self, content: ImageContent, prefix: str, progress: Progress | None = None,
                 pages_sent: threading.Event | None = None, decoders: Decoders | None = None):
        self.content, self.prefix, self.progress = content, prefix, progress
        self.decoders = decoders  # chunks decoded by these processes where they can (decoders.py)
        self.files: dict[str, FileEntry] = {f.path.split("/", 1)[1]: f for f in content.manifest.files
                                            if f.path.startswith(prefix + "/")}
        # set once every pages image (most of what CRIU reads) has gone into its pipe whole
        self.pages_sent = pages_sent or threading.Event()
        self._pages_left = {n for n in self.files if n.startswith("pages-")}
        self._pages_lock = threading.Lock()
        if not self._pages_left:
            self.pages_sent.set()
        self.errors: list[str] = []
        try:
            self.directory = Path(tempfile.mkdtemp(prefix="gpuos-criu-", dir="/tmp"))
            self.path = self.directory / SOCKET
            self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.listener.bind(str(self.path))
            self.listener.listen(64)
        except OSError as exc:
            raise GpuosError(f"cannot open CRIU's image streamer socket in /tmp: {exc.strerror or exc}") from None
        self.pool = ThreadPoolExecutor(max_workers=workers())
        self.threads: list[threading.Thread] = []
        self.closed = False
        t = threading.Thread(target=self._accept, name="gpuos-streamer", daemon=True)
        t.start()
        self.threads.append(t)

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return  # closed
            t = threading.Thread(target=self._serve, args=(conn,), name="gpuos-streamer-conn", daemon=True)
            t.start()
            self.threads.append(t)

    def _serve(self, conn: socket.socket) -> None:
        pid, _, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
        with conn:
            while True:
                try:
                    name = _request(conn)
                except (OSError, GpuosError) as exc:
                    self.errors.append(str(exc))
                    return
                if name is None:
                    return
                entry = self.files.get(name)
                try:
                    conn.sendall(struct.pack("<I", 2) + bytes([0x08, 1 if entry else 0]))
                    if entry is None:
                        continue
                    _, fds, _, _ = socket.recv_fds(conn, 1, 1)
                except OSError as exc:
                    self.errors.append(f"talking to criu: {exc}")
                    return
                if len(fds) != 1:
                    self.errors.append(f"criu sent no pipe for {name}")
                    return
                t = threading.Thread(target=self._write, args=(entry, fds[0], pid), name="gpuos-streamer-file",
                                     daemon=True)
                t.start()
                self.threads.append(t)

    def _write(self, entry: FileEntry, fd: int, criu_pid: int) -> None:
        try:
            try:
                fcntl.fcntl(fd, F_SETPIPE_SZ, PIPE_SIZE)
            except OSError:
                pass  # the system's limit: a smaller pipe, more writes
            pieces = self.content.pieces(entry)
            ahead: list[tuple[Future, bool]] = []  # (future, whether a decoder's)
            k = 0
            for piece in pieces:
                while k < len(pieces) and len(ahead) < AHEAD:
                    ahead.append(self._submit(entry, pieces[k]))
                    k += 1
                fut, decoded = ahead.pop(0)
                try:
                    slot, view = fut.result()
                except ImageCorrupt:
                    raise
                except GpuosError:  # a decoder died under it: the chunk is read here instead
                    if not decoded:
                        raise
                    slot, view = self._read(entry, piece)
                sent = len(view)
                try:
                    while view:
                        view = view[os.write(fd, view):]
                finally:
                    del view
                    if slot is not None:
                        self.decoders.release(slot)
                if self.progress:
                    self.progress(sent)
            with self._pages_lock:
                self._pages_left.discard(entry.path.split("/", 1)[1])
                if not self._pages_left:
                    self.pages_sent.set()
        except GpuosError as exc:
            self.errors.append(exc.message)
            _kill_tree(criu_pid)  # before the pipe closes: nothing reads it short
        except OSError as exc:
            if not self.closed:
                self.errors.append(f"streaming {entry.path} to criu: {exc.strerror or exc}")
        finally:
            os.close(fd)

    def _submit(self, entry: FileEntry, piece) -> tuple[Future, bool]:
        """A future of (decoder slot or None, the piece's content), and whether a decoder's."""
        if self.decoders is not None and piece.chunk is not None:
            fut = self.decoders.submit(piece.chunk, self.content.verify, f"{entry.path} at byte {piece.offset}")
            if fut is not None:
                return fut, True
        return self.pool.submit(self._read, entry, piece), False

    def _read(self, entry: FileEntry, piece) -> tuple[None, memoryview]:
        buf = bytearray(piece.size)
        self.content.read_piece(entry, piece, memoryview(buf))
        return None, memoryview(buf)

    def close(self) -> None:
        self.closed = True
        self.listener.close()
        self.pool.shutdown(wait=False, cancel_futures=True)
        shutil.rmtree(self.directory, ignore_errors=True)  # the socket, CRIU's stats
