"""Chunks read, decompressed and checked by worker processes, into memory the caller maps.

Why processes: in one Python process, reading chunks (a file read, zstd, BLAKE3, each
letting go of the GIL) stops scaling at about four threads and then slows down: measured
on an H100 host (16 cores), GPT-2-large's 745 MB of CRIU files decoded at 0.54 GB/s on one
thread, 1.29 GB/s on four and 0.78 GB/s on sixteen, with nothing allocated per chunk
(tools/probes/criu_pages_probe.py), while sixteen processes decompressed sixteen times
what one did. A streamed restore's CRIU waited on that decoding.

Each worker (``python -m gpuos.store.decoders ROOT HOT``) opens the chunk store itself
and maps one shared memfd of slots. A request on its stdin (fixed-size record: slot, size,
verify, chunk id, what it is for) gets the chunk's content into that slot through
ChunkStore.read_into, the same checks as in-process, and a fixed-size answer (slot,
status, message) on the pipe all workers share (each answer one atomic write). A worker
says it is ready with an answer for slot -1; until then, and whenever no slot is free or
a chunk is larger than a slot, the caller reads in its own threads instead (``submit``
returns None). Workers end when their stdin closes: with the pool, or with a killed gpuos.
A worker that dies fails what it was asked (found within REAP_EVERY of silence) and is
asked no more; nothing waits on an answer that cannot come.
"""

from __future__ import annotations

import mmap
import os
import select
import struct
import subprocess
import sys
import threading
from concurrent.futures import Future
from pathlib import Path

from ..errors import GpuosError, ImageCorrupt
from ..manifest import Chunk

SLOT = 8 << 20  # the largest chunk (chunker.COARSE: 2048 pages)
REQUEST = struct.Struct("=iqi64s")  # slot, size, verify, chunk id; then WHERE bytes of what for
WHERE = 448
ANSWER = struct.Struct("=ii")  # slot (-1: ready), status (0 ok, 1 corrupt, 2 other error); then MESSAGE
MESSAGE = 500
STATUS_OK, STATUS_CORRUPT, STATUS_ERROR = 0, 1, 2
REAP_EVERY = 0.25  # seconds without answers after which dead workers are looked for


def default_workers() -> int:
    return max(1, min(8, os.cpu_count() or 1))


class Decoders:
    """A pool of decoder processes over one chunk store; slots of SLOT bytes each."""

    def __init__(self, root: Path, hot_base: Path | None, workers: int | None = None, slots_per_worker: int = 4):
        n = workers or default_workers()
        self.slots = n * slots_per_worker
        self.memfd = os.memfd_create("gpuos-decoders", os.MFD_CLOEXEC)
        os.ftruncate(self.memfd, self.slots * SLOT)  # pages come as they are written
        self.map = mmap.mmap(self.memfd, self.slots * SLOT, mmap.MAP_SHARED)
        self.view = memoryview(self.map)
        self.free = list(range(self.slots))
        self.lock = threading.Lock()
        self.waiting: dict[int, tuple[Future, int]] = {}  # slot -> (future, worker)
        self.load = [0] * n
        self.ready = [False] * n
        self.up = threading.Event()  # set once a worker is ready, or all are gone
        self.answered = 0  # chunks the workers answered for
        self.closed = False
        answers_r, answers_w = os.pipe2(os.O_CLOEXEC)
        self.procs: list[subprocess.Popen] = []
        # the workers import the gpuos this is, wherever it was found
        here = str(Path(__file__).resolve().parents[2])
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p))
        try:
            for i in range(n):
                self.procs.append(subprocess.Popen(
                    [sys.executable, "-m", "gpuos.store.decoders", str(root), str(hot_base or ""),
                     str(self.memfd), str(self.slots * SLOT), str(answers_w), str(i)],
                    stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, pass_fds=(self.memfd, answers_w),
                    close_fds=True, env=env))
        except OSError as exc:
            os.close(answers_r)
            os.close(answers_w)
            self.close()
            raise GpuosError(f"cannot start the chunk decoders: {exc.strerror or exc}") from None
        os.close(answers_w)  # the workers hold it: EOF once all are gone
        self.answers = answers_r
        self.reader = threading.Thread(target=self._answers, name="gpuos-decoders", daemon=True)
        self.reader.start()

    def submit(self, chunk: Chunk, verify: bool, where: str) -> Future | None:
        """A future of (slot, a view of the slot's chunk.size bytes) holding the chunk,
        checked unless verify is False; ImageCorrupt as the chunk store raises it. None:
        decode it yourself (no worker ready, no slot free, or the chunk larger than a
        slot). The slot is the caller's until release(slot)."""
        if chunk.size > SLOT:
            return None
        with self.lock:
            ready = [i for i, r in enumerate(self.ready) if r]
            if self.closed or not ready or not self.free:
                return None
            w = min(ready, key=lambda i: self.load[i])
            slot = self.free.pop()
            fut: Future = Future()
            self.waiting[slot] = (fut, w)
            self.load[w] += 1
        record = REQUEST.pack(slot, chunk.size, int(verify), chunk.id.encode()) + \
            where.encode()[:WHERE].ljust(WHERE, b"\0")
        try:
            self.procs[w].stdin.write(record)
            self.procs[w].stdin.flush()
        except (OSError, ValueError):
            self._fail(slot, "a chunk decoder is gone")
        return fut

    def release(self, slot: int) -> None:
        with self.lock:
            self.free.append(slot)

    def _fail(self, slot: int, message: str) -> None:
        with self.lock:
            fut, w = self.waiting.pop(slot, (None, 0))
            if fut is None:
                return  # failed already (_reap, or all workers gone), its slot given back there
            self.load[w] -= 1
            self.free.append(slot)
        if not fut.done():
            fut.set_exception(GpuosError(message))

    def _reap(self) -> None:
        """A worker that died (killed, out of memory) fails what it was asked and is asked
        no more: its answers would never come."""
        for i, p in enumerate(self.procs):
            if p.poll() is None:
                continue
            with self.lock:
                self.ready[i] = False
                lost = [(slot, fut) for slot, (fut, w) in self.waiting.items() if w == i]
                for slot, _ in lost:
                    del self.waiting[slot]
                    self.free.append(slot)
                self.load[i] = 0
            for _, fut in lost:
                fut.set_exception(GpuosError(f"chunk decoder {p.pid} died (exit {p.returncode})"))

    def _answers(self) -> None:
        size = ANSWER.size + MESSAGE
        while True:
            try:
                if not select.select([self.answers], [], [], REAP_EVERY)[0]:
                    self._reap()
                    continue
                data = _read_exact(self.answers, size)
            except OSError:
                data = b""
            if not data:
                break
            slot, status = ANSWER.unpack_from(data)
            message = data[ANSWER.size:].rstrip(b"\0").decode(errors="replace")
            if slot < 0:  # a worker is up: its index in the message
                with self.lock:
                    self.ready[int(message)] = True
                self.up.set()
                continue
            with self.lock:
                fut, w = self.waiting.pop(slot, (None, 0))
                if fut is not None:
                    self.load[w] -= 1
            if fut is None:
                continue
            self.answered += 1
            if status == STATUS_OK:
                fut.set_result((slot, self.view[slot * SLOT:slot * SLOT + int(message)]))
            else:
                with self.lock:
                    self.free.append(slot)
                fut.set_exception((ImageCorrupt if status == STATUS_CORRUPT else GpuosError)(message))
        with self.lock:  # every worker gone: what was asked of them fails
            self.closed = True
            left = list(self.waiting.items())
            self.waiting.clear()
        self.up.set()  # nobody waits for workers that will never be up
        for slot, (fut, _) in left:
            fut.set_exception(GpuosError("the chunk decoders ended"))

    def close(self) -> None:
        with self.lock:
            self.closed = True
        for p in self.procs:
            try:
                p.stdin.close()
            except OSError:
                pass
        for p in self.procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if hasattr(self, "reader"):
            self.reader.join(timeout=5)
            os.close(self.answers)
        try:
            self.view.release()
            self.map.close()
        except BufferError:
            pass  # a view still out: the mapping goes with the process
        os.close(self.memfd)


def _read_exact(fd: int, n: int) -> bytes:
    data = b""
    while len(data) < n:
        more = os.read(fd, n - len(data))
        if not more:
            return b""
        data += more
    return data


def _answer(fd: int, slot: int, status: int, message: str) -> None:
    os.write(fd, ANSWER.pack(slot, status) + message.encode()[:MESSAGE].ljust(MESSAGE, b"\0"))


def _worker(root: str, hot: str, memfd: int, length: int, answers: int, index: int) -> None:
    from .chunks import ChunkStore

    store = ChunkStore(Path(root), Path(hot) if hot else None)
    whole = memoryview(mmap.mmap(memfd, length, mmap.MAP_SHARED))
    _answer(answers, -1, STATUS_OK, str(index))
    size = REQUEST.size + WHERE
    stdin = sys.stdin.buffer.raw
    while True:
        data = _read_exact(stdin.fileno(), size)
        if not data:
            return
        slot, n, verify, cid = REQUEST.unpack_from(data)
        where = data[REQUEST.size:].rstrip(b"\0").decode(errors="replace")
        try:
            store.read_into(Chunk(cid.decode(), n), whole[slot * SLOT:slot * SLOT + n], bool(verify), where)
            _answer(answers, slot, STATUS_OK, str(n))
        except ImageCorrupt as exc:
            _answer(answers, slot, STATUS_CORRUPT, exc.message)
        except Exception as exc:  # noqa: BLE001 - said to the caller, which fails the restore
            _answer(answers, slot, STATUS_ERROR, f"decoding chunk {cid.decode()}: {exc}")


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]))
