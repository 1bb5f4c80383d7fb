"""A restore's prefill (gpuos.movable.prefill) around a fake copier: what it asks the GPU
for, in which order it fills, how it stops, and what it says when it cannot serve.  The
fill that takes its memory runs against libgpuos and the fake driver in
test_movable_agent.py; the copier itself only runs on a GPU."""

from __future__ import annotations

import os
import threading
import time

import pytest

from gpuos.errors import ImageCorrupt
from gpuos.manifest import FileEntry, MovableMemory, MovableRange
from gpuos.movable.copier import CopierError
from gpuos.movable.filler import parts
from gpuos.movable.prefill import CONTEXT_ROOM, Prefill, room_beside
from gpuos.store.content import Piece

MIB = 1 << 20


class Content:
    def __init__(self, size: int, bad_at: int | None = None):
        self.file = FileEntry(path="gpu-memory.bin", size=size)
        self.bad_at = bad_at

    def entry(self, rel):
        return self.file

    def pieces(self, entry):
        return [Piece(off, MIB, None) for off in range(0, self.file.size, MIB)]

    def read_piece(self, entry, piece, buf):
        if piece.offset == self.bad_at:
            raise ImageCorrupt(f"chunk at byte {piece.offset} is corrupt")
        buf[:] = bytes([piece.offset // MIB % 256]) * piece.size


class Copier:
    """The copier's face: free memory, allocate, load (buffers of 4 MiB here), export."""

    def __init__(self, free: int, gate: threading.Event | None = None, fail: str | None = None):
        self.free, self.gate, self.fail = free, gate, fail
        self.sizes: list[int] = []
        self.loaded: list[tuple[int, int, bytes]] = []
        self.closed = False
        self.exported: list[int] = []

    def free_bytes(self) -> int:
        return self.free

    def allocate(self, sizes):
        if self.fail == "allocate":
            raise CopierError("CUDA error CUDA_ERROR_OUT_OF_MEMORY")
        self.sizes = list(sizes)

    def load(self, todo, read, pool, stop):
        k = 0
        while k < len(todo) and not stop():
            batch = list(range(k, min(k + 4, len(todo))))
            for j in batch:
                view = memoryview(bytearray(todo[j][2]))
                read(j, view)
                self.loaded.append((todo[j][0], todo[j][1], bytes(view[:1])))
            k = batch[-1] + 1
            if self.gate is not None:
                self.gate.wait()  # hold it here until the test lets it on
        return k

    def export(self):
        self.exported = [os.memfd_create("x") for _ in self.sizes]
        return list(self.exported)

    def close(self):
        self.closed = True


def memory(sizes_mib: list[int], last_use: list[int]) -> MovableMemory:
    ranges, base = [], 1 << 40
    for n, u in zip(sizes_mib, last_use):
        ranges.append(MovableRange(base, n * MIB, n * MIB, 0, u))
        base += n * MIB
    return MovableMemory(1, "gpu-memory.bin", sum(sizes_mib) * MIB, ranges)


def test_it_fills_in_the_fillers_order_and_all_of_it_is_taken():
    mem = memory([4, 8, 2], [5, 0, 3])
    content = Content(mem.bytes)
    cp = Copier(free=64 << 30)
    pf = Prefill(mem, content, "GPU-x", open_copier=lambda uuid: cp)
    pf._thread.join()
    taken = pf.take()
    assert cp.sizes == [4 * MIB, 8 * MIB, 2 * MIB]
    assert [(i, off) for i, off, _ in cp.loaded] == [(p.index, p.offset) for p in parts(content, mem)]
    assert [i for i, _, _ in cp.loaded][:2] == [2, 2]  # last used first of the used: allocation 2
    assert taken.done == parts(content, mem) and taken.fds == cp.exported
    assert pf.take() is taken  # every replica's filler gets the same
    pf.close()
    assert cp.closed and taken.fds and pf.take().fds == []


def test_take_stops_it_at_a_buffers_end_and_only_that_is_done():
    mem = memory([16, 16], [1, 2])
    gate = threading.Event()
    cp = Copier(free=64 << 30, gate=gate)
    pf = Prefill(mem, Content(mem.bytes), None, open_copier=lambda uuid: cp)
    deadline = time.monotonic() + 10
    while len(cp.loaded) < 4 and time.monotonic() < deadline:  # the first buffer is in flight
        time.sleep(0.01)
    threading.Timer(0.2, gate.set).start()  # take() waits for the buffer in flight
    taken = pf.take()
    assert len(taken.done) == 4 and len(cp.loaded) == 4  # one buffer of four parts
    pf.close()


@pytest.mark.parametrize("copies", [1, 3])
def test_it_starts_only_with_room_for_what_the_restore_makes_beside_it(copies):
    """Room for its own memory, each restored copy's memory and context, and the image's
    other prefill (two processes with movable memory)."""
    mem, other = memory([64], [1]), memory([16], [1])
    beside = room_beside([mem, other], mem, copies)
    assert beside == copies * (mem.bytes + other.bytes + 2 * CONTEXT_ROOM) + other.bytes
    need = mem.bytes + beside
    cp = Copier(free=need - 1)
    pf = Prefill(mem, Content(mem.bytes), None, beside, open_copier=lambda uuid: cp)
    assert pf.take() is None and "no room on the GPU" in pf.why_not and cp.closed and not cp.sizes
    cp = Copier(free=need)
    pf = Prefill(mem, Content(mem.bytes), None, beside, open_copier=lambda uuid: cp)
    assert pf.take() is not None
    pf.close()


def test_no_context_or_no_memory_is_a_reason_not_an_error():
    mem = memory([4], [1])

    def none(uuid):
        raise CopierError("no CUDA context for gpuos (ImportError: no cuda-python)")

    pf = Prefill(mem, Content(mem.bytes), None, open_copier=none)
    assert pf.take() is None and "cuda-python" in pf.why_not
    cp = Copier(free=64 << 30, fail="allocate")
    pf = Prefill(mem, Content(mem.bytes), None, open_copier=lambda uuid: cp)
    assert pf.take() is None and "OUT_OF_MEMORY" in pf.why_not and cp.closed
    pf.close()


def test_a_bad_chunk_is_raised_to_every_taker():
    mem = memory([8], [1])
    cp = Copier(free=64 << 30)
    pf = Prefill(mem, Content(mem.bytes, bad_at=5 * MIB), None, open_copier=lambda uuid: cp)
    for _ in range(2):
        with pytest.raises(ImageCorrupt, match="byte 5242880"):
            pf.take()
    assert cp.closed and pf.why_not is None
    pf.close()


def test_it_reads_only_once_told_to_go_and_stops_unstarted():
    """Context and memory at once, reading from `go` on (CRIU has its pages); a take
    before that stops it with nothing done: the filler streams all of it."""
    mem = memory([8], [1])
    go = threading.Event()
    cp = Copier(free=64 << 30)
    pf = Prefill(mem, Content(mem.bytes), None, go=go, open_copier=lambda uuid: cp)
    time.sleep(0.2)
    assert cp.sizes == [8 * MIB] and cp.loaded == []
    go.set()
    pf._thread.join()
    assert len(pf.take().done) == 8
    pf.close()
    cp = Copier(free=64 << 30)
    pf = Prefill(mem, Content(mem.bytes), None, go=threading.Event(), open_copier=lambda uuid: cp)
    time.sleep(0.1)
    assert pf.take() is None and pf.why_not is None and cp.loaded == []
    assert cp.closed  # at once: its memory is the restored processes' room
    pf.close()
