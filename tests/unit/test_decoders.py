"""Chunks decoded by worker processes (store/decoders.py): the same content and the same
checks as the chunk store's own read, slots given back, the caller told to decode itself
where the workers cannot, and nothing left running."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import Future

import pytest

from gpuos.errors import GpuosError, ImageCorrupt
from gpuos.manifest import Chunk
from gpuos.store.chunks import ChunkStore, digest
from gpuos.store.decoders import SLOT, Decoders


@pytest.fixture
def chunks(tmp_path):
    cs = ChunkStore(tmp_path / "chunks")
    out = []
    for i in range(12):  # compressible ones are stored as zstd, random ones raw
        data = (b"weights %d " % i) * 30000 if i % 2 else os.urandom(200_000 + i)
        cid = digest(data)
        cs.put(cid, data, compress=True)
        out.append((Chunk(cid, len(data)), data))
    return cs, out


@pytest.fixture
def pool(chunks):
    d = Decoders(chunks[0].root, None, workers=2, slots_per_worker=2)
    assert d.up.wait(30)
    yield d
    d.close()
    assert all(p.poll() is not None for p in d.procs)


def test_chunks_come_back_whole_and_slots_are_given_back(chunks, pool):
    cs, items = chunks
    assert any(cs.stored(c.id).name.endswith(".zst") for c, _ in items)
    got = 0
    for c, data in items:
        fut = pool.submit(c, True, "test")
        assert fut is not None
        slot, view = fut.result(timeout=30)
        assert bytes(view) == data
        del view
        pool.release(slot)
        got += 1
    assert got == len(items) and sorted(pool.free) == list(range(pool.slots))


def test_corrupt_and_missing_chunks_say_what_the_chunk_store_says(chunks, pool, tmp_path):
    cs, items = chunks
    c, data = items[0]
    path = cs.stored(c.id)
    path.chmod(0o644)
    path.write_bytes(b"x" * len(data))
    with pytest.raises(ImageCorrupt) as in_process:
        cs.read_into(c, memoryview(bytearray(c.size)), True, "pages-1.img at byte 0")
    with pytest.raises(ImageCorrupt) as decoded:
        pool.submit(c, True, "pages-1.img at byte 0").result(timeout=30)
    assert decoded.value.message == in_process.value.message and "is corrupt" in decoded.value.message
    missing = Chunk("ab" * 32, 4096)
    with pytest.raises(ImageCorrupt, match="is missing"):
        pool.submit(missing, True, "x").result(timeout=30)
    # unchecked, the corrupt content comes through: verify is the caller's choice
    slot, view = pool.submit(c, False, "x").result(timeout=30)
    assert bytes(view) == b"x" * len(data)
    del view
    pool.release(slot)
    assert sorted(pool.free) == list(range(pool.slots))  # failures give their slots back too


def test_the_caller_decodes_what_the_workers_cannot(chunks, pool):
    cs, items = chunks
    assert pool.submit(Chunk("cd" * 32, SLOT + 1), True, "x") is None  # larger than a slot
    held = [pool.submit(c, True, "x") for c, _ in items[:pool.slots]]
    assert all(f is not None for f in held)
    assert pool.submit(items[-1][0], True, "x") is None  # every slot taken
    for f in held:
        slot, view = f.result(timeout=30)
        del view
        pool.release(slot)


def test_workers_gone_fail_what_was_asked_and_no_more_is_asked(chunks, pool):
    cs, items = chunks
    for p in pool.procs:
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
    fut = pool.submit(items[0][0], True, "x")
    if fut is not None:  # asked before the pool saw them go
        with pytest.raises(GpuosError):
            fut.result(timeout=30)
    pool.reader.join(timeout=30)
    assert pool.submit(items[0][0], True, "x") is None


def test_workers_that_never_come_up_keep_nobody_waiting(chunks, monkeypatch):
    """Workers that cannot start (here: a Python that exits at once) end the pool's wait
    for them at once, and every chunk is left to the caller."""
    cs, items = chunks
    monkeypatch.setattr("sys.executable", "/bin/false")
    d = Decoders(cs.root, None, workers=2)
    try:
        assert d.up.wait(10) and d.closed
        assert not any(d.ready) and d.submit(items[0][0], True, "x") is None
    finally:
        d.close()


def test_a_worker_that_dies_on_a_chunk_fails_it_and_the_others_go_on(chunks, pool):
    """A worker killed while it reads (here: a chunk that is a FIFO nobody writes) fails
    what it was asked within a second, and the pool goes on with the other worker."""
    cs, items = chunks
    stuck = Chunk("ef" * 32, 4096)
    fifo = cs.path(stuck.id)
    fifo.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(fifo)
    fut = pool.submit(stuck, True, "x")
    assert fut is not None
    w = pool.waiting[next(s for s, (f, _) in pool.waiting.items() if f is fut)][1]
    time.sleep(0.5)
    assert not fut.done()  # blocked in the FIFO's open
    os.kill(pool.procs[w].pid, signal.SIGKILL)
    with pytest.raises(GpuosError, match="died"):
        fut.result(timeout=10)
    for c, data in items[:3]:  # the survivor does the rest
        slot, view = pool.submit(c, True, "x").result(timeout=30)
        assert bytes(view) == data
        del view
        pool.release(slot)
    assert sorted(pool.free) == list(range(pool.slots))


def test_a_chunk_failed_twice_gives_its_slot_back_once(chunks, pool):
    """A request whose worker was found dead, and whose write then fails too, frees its
    slot once: a slot in the free list twice would be handed to two chunks at once."""
    cs, items = chunks
    fut = pool.submit(items[0][0], True, "x")
    slot, view = fut.result(timeout=30)
    del view
    pool.release(slot)
    with pool.lock:  # a request in flight, as submit leaves it
        slot = pool.free.pop()
        pending: Future = Future()
        pool.waiting[slot] = (pending, 0)
        pool.load[0] += 1
    pool._fail(slot, "a chunk decoder is gone")
    pool._fail(slot, "a chunk decoder is gone")
    assert pool.free.count(slot) == 1 and sorted(pool.free) == list(range(pool.slots))
    with pytest.raises(GpuosError):
        pending.result(timeout=1)
