"""The chunk store: where files are cut, chunks written once and checked on every read,
the hot tier, sharing between images, garbage collection that never deletes a chunk in
use, and restore's read-out of an image (format 5 and format 4)."""

from __future__ import annotations

import hashlib
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from gpuos.errors import Busy, ImageCorrupt
from gpuos.manifest import CRIU_DIR, Chunk
from gpuos.store import ChunkStore, ImageStore, chunker
from gpuos.store import content as content_mod
from gpuos.store.content import Source, ingest, staged_files

from helpers import build_image, build_v4_image, make_manifest, store_staged, write_criu_files

PAGE = chunker.PAGE


def _pieces(data: bytes, ends: list[int]) -> list[bytes]:
    return [data[a:b] for a, b in zip([0] + ends[:-1], ends)]


# -- cutting -----------------------------------------------------------------------------

@pytest.mark.parametrize("profile,avg", [(chunker.COARSE, 2.25 * (1 << 20)), (chunker.FINE, 320 << 10)],
                         ids=["coarse", "fine"])
def test_cuts_cover_the_file_within_the_bounds(profile, avg):
    data = os.urandom(40 << 20) + b"tail"
    ends = chunker.chunk_ends(data, profile=profile)
    assert ends[-1] == len(data) and ends == sorted(set(ends))
    sizes = [b - a for a, b in zip([0] + ends, ends)]
    assert all(s % PAGE == 0 for s in sizes[:-2])  # page-aligned, but for the partial last page
    assert all(profile.min_pages * PAGE <= s <= profile.max_pages * PAGE for s in sizes[:-2])
    assert avg / 2 < (len(data) / len(sizes)) < avg * 2


@pytest.mark.parametrize("fine", [False, True], ids=["coarse", "fine"])
def test_cuts_do_not_depend_on_how_the_file_is_read(monkeypatch, tmp_path: Path, fine: bool):
    """ingest reads in windows; the cuts must be the whole-file ones whatever the window."""
    data = os.urandom(13 << 20) + bytes(9 << 20) + os.urandom(3 * PAGE + 5)
    (tmp_path / "f").write_bytes(data)
    forced = [5 * PAGE, 7 << 20]
    want = chunker.chunk_ends(data, forced, chunker.FINE if fine else chunker.COARSE)
    for window in (PAGE, 3 * PAGE, 1 << 20, 64 << 20):
        monkeypatch.setattr(content_mod, "WINDOW", window)
        store = ChunkStore(tmp_path / f"cs-{window}")
        (entry,), _ = ingest([Source("f", tmp_path / "f", len(data), tuple(forced), fine)], store)
        got = [sum(c.size for c in entry.chunks[:i + 1]) for i in range(len(entry.chunks))]
        assert got == want, window
        assert b"".join(store.read(c) for c in entry.chunks) == data


def test_zeros_are_cut_at_the_largest_size_and_stored_once(tmp_path: Path):
    ends = chunker.chunk_ends(bytes(64 << 20))
    assert len(ends) == 64 // 8  # not a cut every min_pages
    (tmp_path / "z").write_bytes(bytes(64 << 20))
    store = ChunkStore(tmp_path / "cs")
    (entry,), stats = ingest(staged_files(tmp_path, skip=("cs",)), store)
    assert len(entry.chunks) == 8 and len({c.id for c in entry.chunks}) == 1
    assert stats.new_bytes == 8 << 20


def test_content_that_moves_keeps_its_chunks():
    """The same data behind a few inserted pages (a heap that grew) shares all but the
    chunks around the insertion: content-defined, not fixed-size."""
    data = os.urandom(32 << 20)
    moved = os.urandom(3 * PAGE) + data
    a = set(_pieces(data, chunker.chunk_ends(data)))
    b = set(_pieces(moved, chunker.chunk_ends(moved)))
    assert len(a & b) >= len(a) - 2


def test_forced_cuts_are_cuts():
    data = os.urandom(8 << 20)
    ends = chunker.chunk_ends(data, [PAGE, 3 << 20, 12345, 99 << 20])  # unaligned and outside: ignored
    assert PAGE in ends and 3 << 20 in ends and 12345 not in ends


def test_empty_and_tiny_files():
    assert chunker.chunk_ends(b"") == []
    assert chunker.chunk_ends(b"x") == [1]
    assert chunker.chunk_ends(bytes(PAGE + 1)) == [PAGE, PAGE + 1]


# -- the chunk store -----------------------------------------------------------------------

def _one(store: ChunkStore, data: bytes) -> Chunk:
    cid = content_mod.digest(data)
    store.put(cid, data)
    return Chunk(cid, len(data))


def test_put_is_idempotent_and_leaves_nothing_aside(tmp_path: Path):
    store = ChunkStore(tmp_path / "cs")
    data = os.urandom(10000)
    cid = content_mod.digest(data)
    assert store.put(cid, data) is True
    assert store.put(cid, data) is False
    assert store.path(cid).read_bytes() == data
    assert list((tmp_path / "cs" / "tmp").iterdir()) == []
    assert store.present() == {cid: 10000}


@pytest.mark.parametrize("damage", ["flip", "short", "long", "missing"])
def test_a_damaged_chunk_is_refused_by_name(tmp_path: Path, damage: str):
    store = ChunkStore(tmp_path / "cs")
    data = os.urandom(5000)
    c = _one(store, data)
    p = store.path(c.id)
    p.chmod(0o644)
    if damage == "flip":
        p.write_bytes(data[:100] + bytes([data[100] ^ 1]) + data[101:])
    elif damage == "short":
        p.write_bytes(data[:-1])
    elif damage == "long":
        p.write_bytes(data + b"x")
    else:
        p.unlink()
    buf = memoryview(bytearray(c.size))
    with pytest.raises(ImageCorrupt) as exc:
        store.read_into(c, buf, where="criu/pages-1.img at byte 0")
    msg = exc.value.message
    assert f"chunk {c.id} (criu/pages-1.img at byte 0)" in msg
    assert {"flip": "is corrupt", "short": "is short", "long": "is longer",
            "missing": "is missing"}[damage] in msg


def test_unverified_reads_skip_only_the_hash(tmp_path: Path):
    store = ChunkStore(tmp_path / "cs")
    data = os.urandom(5000)
    c = _one(store, data)
    p = store.path(c.id)
    p.chmod(0o644)
    p.write_bytes(bytes(5000))
    buf = memoryview(bytearray(c.size))
    store.read_into(c, buf, verify=False)  # --no-verify: the content is taken as it is
    p.write_bytes(bytes(4999))
    with pytest.raises(ImageCorrupt, match="is short"):
        store.read_into(c, buf, verify=False)


def test_the_hot_tier_is_read_first_and_checked_too(tmp_path: Path):
    store = ChunkStore(tmp_path / "cs", hot_base=tmp_path / "hot")
    data = os.urandom(9000)
    c = _one(store, data)
    assert store.warm([c, c]) == 9000 and store.warm([c]) == 0
    assert store.hot_path(c.id).read_bytes() == data and store.hot_bytes() == 9000
    store.path(c.id).unlink()  # the cold copy gone: read from memory
    buf = memoryview(bytearray(c.size))
    store.read_into(c, buf)
    assert bytes(buf) == data
    store.hot_path(c.id).write_bytes(bytes(9000))
    with pytest.raises(ImageCorrupt, match="is corrupt"):
        store.read_into(c, buf)
    assert store.cool([c]) == 9000 and store.hot_bytes() == 0


# -- images sharing a store ----------------------------------------------------------------

def _replica(store: ImageStore, name: str, weights: bytes, private: bytes) -> Path:
    """An image whose pages are shared weights plus a private part, like a replica of one
    model; the weights at a different offset in each (its heap differs)."""
    final = store.resolve(name)
    staging = store.staging_for(final, "b")
    write_criu_files(staging / CRIU_DIR, seed=name.encode())
    (staging / CRIU_DIR / "pages-1.img").write_bytes(private + weights)
    store_staged(store, staging, final, make_manifest(name))
    return final


def test_replicas_of_one_model_share_their_weights(store: ImageStore):
    weights = os.urandom(192 << 20)
    for k in range(4):
        _replica(store, f"r{k}", weights, os.urandom((k + 1) * PAGE))
    usage = store.usage(list(store.entries()))
    one = usage["r0"].size
    stored = sum(store.chunks().present().values())
    assert stored <= 1.2 * one  # four replicas in at most 1.2 times the space of one
    for k in range(4):  # own: at most the chunk where private data and weights meet
        assert usage[f"r{k}"].shared >= 180 << 20 and usage[f"r{k}"].own <= (8 << 20) + 5 * PAGE + 4096


def test_successive_checkpoints_share_what_did_not_change(store: ImageStore):
    weights = os.urandom(64 << 20)
    _replica(store, "step1", weights, os.urandom(PAGE))
    before = sum(store.chunks().present().values())
    _replica(store, "step2", weights[: 32 << 20] + os.urandom(PAGE) + weights[32 << 20:], os.urandom(PAGE))
    added = sum(store.chunks().present().values()) - before
    # a page inserted in the middle, another at the start: two or three chunks, not the whole
    assert added <= 3 * (8 << 20) + 4096


# -- gc ------------------------------------------------------------------------------------

def test_gc_deletes_only_what_no_image_uses(store: ImageStore):
    a = build_image(store, "a", seed=b"a")
    b = build_image(store, "b", seed=b"b")
    b_chunks = set(ImageStore.load(b).chunk_set())
    assert store.gc().chunks == 0
    store.remove(a)
    res = store.gc()
    assert res.chunks > 0 and set(store.chunks().present()) == b_chunks
    store.verify(b, ImageStore.load(b))


def test_gc_keeps_the_chunks_of_a_staged_image_whose_manifest_is_written(store: ImageStore):
    """A gpuos killed between writing the manifest and the rename: recovery publishes that
    image, so its chunks must outlive a gc meanwhile."""
    final = store.resolve("job")
    staging = store.staging_for(final, "dead")
    write_criu_files(staging / CRIU_DIR, seed=b"staged")
    m = make_manifest("job", chunk_dir="../.chunks")
    with store.chunks().shared():
        m.files, _ = ingest(staged_files(staging), store.chunks())
    ImageStore.write_manifest(staging, m)
    assert store.gc().chunks == 0
    assert set(m.chunk_set()) <= set(store.chunks().present())


def test_gc_waits_for_a_reader_and_says_busy(store: ImageStore):
    build_image(store, "a")
    with store.chunks().shared():
        with pytest.raises(Busy, match="in use"):
            store.gc()
        with pytest.raises(Busy):
            store.gc(wait=0.2)
    assert store.gc().chunks == 0


def test_gc_runs_once_the_reader_is_done(store: ImageStore):
    a = build_image(store, "a")
    store.remove(a)
    release = threading.Event()

    def reader():
        with store.chunks().shared():
            release.wait(5)

    t = threading.Thread(target=reader)
    t.start()
    try:
        threading.Timer(0.3, release.set).start()
        assert store.gc(wait=5).chunks > 0
    finally:
        t.join()


def test_gc_refuses_when_an_image_cannot_be_read(store: ImageStore):
    build_image(store, "good")
    broken = build_image(store, "broken", seed=b"x")
    (broken / "manifest.json").write_text("{not json")
    before = store.chunks().present()
    with pytest.raises(ImageCorrupt, match="cannot tell which chunks"):
        store.gc()
    assert store.chunks().present() == before


def test_gc_cleans_chunks_a_dead_writer_left_aside(store: ImageStore):
    build_image(store, "a")
    tmp = store.root / ".chunks" / "tmp"
    (tmp / "abc.123.456").write_bytes(b"half")
    store.gc()
    assert not tmp.exists()


# -- reading an image out --------------------------------------------------------------------

def _files_of(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_materialize_gives_back_every_file_with_its_mode(store: ImageStore, tmp_path: Path):
    final = store.resolve("job")
    staging = store.staging_for(final, "x")
    write_criu_files(staging / CRIU_DIR)
    (staging / CRIU_DIR / "big.img").write_bytes(os.urandom(20 << 20))
    (staging / "links" / "dev" / "shm").mkdir(parents=True)
    (staging / "links" / "dev" / "shm" / "link_remap.1").write_bytes(b"sem")
    os.chmod(staging / "links" / "dev" / "shm" / "link_remap.1", 0o640)
    want = _files_of(staging)
    store_staged(store, staging, final, make_manifest("job"))
    m = ImageStore.load(final)
    out = store.content(final, m).materialize((CRIU_DIR, "links"), tmp_path / "out")
    assert _files_of(out) == want
    assert (out / "links/dev/shm/link_remap.1").stat().st_mode & 0o777 == 0o640


def test_materialize_of_a_bad_chunk_fails_and_the_store_is_untouched(store: ImageStore, tmp_path: Path):
    img = build_image(store, "job")
    other = build_image(store, "other", seed=b"other")
    m = ImageStore.load(img)
    entry = next(f for f in m.files if f.path == "criu/pages-1.img")
    p = store.chunks().stored(entry.chunks[0].id)
    p.chmod(0o644)
    p.write_bytes(bytes(p.stat().st_size))
    before = store.chunks().present()
    with pytest.raises(ImageCorrupt, match=r"\(criu/pages-1.img at byte 0\) is corrupt"):
        store.content(img, m).materialize((CRIU_DIR,), tmp_path / "out")
    assert store.chunks().present() == before
    store.verify(other, ImageStore.load(other))


def test_a_format_4_image_is_read_in_place(store: ImageStore, tmp_path: Path):
    img = build_v4_image(store, "old")
    m = ImageStore.load(img)
    c = store.content(img, m)
    assert c.chunks is None and c.materialize((CRIU_DIR,), tmp_path / "out") == img
    fd = os.open(tmp_path / "copy", os.O_RDWR | os.O_CREAT)
    try:
        with ThreadPoolExecutor(2) as pool:
            c.write_files([(c.entry("criu/pages-1.img"), fd)], pool)
    finally:
        os.close(fd)
    assert (tmp_path / "copy").read_bytes() == (img / "criu/pages-1.img").read_bytes()


def test_usage_of_old_and_outside_images_is_all_their_own(store: ImageStore):
    build_v4_image(store, "old")
    u = store.usage(list(store.entries()))["old"]
    assert u.shared == 0 and u.own == u.size > 0


def test_the_digest_is_blake3():
    import blake3
    assert content_mod.digest(b"abc") == blake3.blake3(b"abc").hexdigest() != hashlib.sha256(b"abc").hexdigest()


def test_host_memory_is_cut_fine_and_gpu_memory_coarse(tmp_path: Path):
    root = tmp_path / "staged"
    (root / "criu").mkdir(parents=True)
    (root / "criu" / "pages-1.img").write_bytes(os.urandom(16 << 20))
    (root / "criu" / "core-1.img").write_bytes(b"x")
    (root / "gpu-memory-1.bin").write_bytes(os.urandom(16 << 20))
    by = {s.path: s for s in staged_files(root)}
    assert by["criu/pages-1.img"].fine and not by["gpu-memory-1.bin"].fine and not by["criu/core-1.img"].fine
    entries, _ = ingest(list(by.values()), ChunkStore(tmp_path / "cs"))
    n = {e.path: len(e.chunks) for e in entries}
    assert n["criu/pages-1.img"] > 3 * n["gpu-memory-1.bin"]


def test_no_room_to_read_an_image_out_is_one_clean_error(store: ImageStore, tmp_path: Path, monkeypatch):
    """The disk (or tmpfs) full while a restore reads the image out: a GpuosError saying
    where, not a traceback; the store untouched."""
    from gpuos.errors import GpuosError

    img = build_image(store, "job")
    m = ImageStore.load(img)
    real = os.pwrite

    def full(fd, data, off):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(content_mod.os, "pwrite", full)
    before = store.chunks().present()
    with pytest.raises(GpuosError, match="No space left on device") as exc:
        store.content(img, m).materialize((CRIU_DIR,), tmp_path / "out")
    assert type(exc.value) is GpuosError and str(tmp_path / "out") in exc.value.message
    monkeypatch.setattr(content_mod.os, "pwrite", real)
    assert store.chunks().present() == before


def test_a_compressed_chunk_reads_back_and_is_checked(tmp_path: Path):
    store = ChunkStore(tmp_path / "cs", hot_base=tmp_path / "hot")
    data = (os.urandom(64) + bytes(4032)) * 256  # 1 MiB of pages, mostly zeros: compresses
    cid = content_mod.digest(data)
    assert store.put(cid, data, compress=True) is True
    assert store.put(cid, data, compress=True) is False and store.put(cid, data) is False  # there already
    assert store.stored(cid).name.endswith(".zst") and not store.path(cid).exists()
    c = Chunk(cid, len(data))
    assert store.read(c) == data
    assert store.warm([c]) == len(data) and store.hot_path(cid).read_bytes() == data  # memory holds it raw
    store.cool([c])
    noise = os.urandom(1 << 20)  # does not compress: kept raw
    nid = content_mod.digest(noise)
    store.put(nid, noise, compress=True)
    assert store.stored(nid) == store.path(nid)
    other = content_mod.digest(data[::-1])
    packed = store.stored(cid).read_bytes()
    bad = store.path(other).with_name(other[2:] + ".zst")
    bad.parent.mkdir(exist_ok=True)
    bad.write_bytes(packed)  # the right frame under a wrong name
    with pytest.raises(ImageCorrupt, match="is corrupt: its content does not match"):
        store.read(Chunk(other, len(data)))
    with pytest.raises(ImageCorrupt, match="is longer"):
        store.read(Chunk(cid, len(data) - 1))
    store.collect({nid})
    assert store.stored(cid) is None and store.stored(other) is None and store.stored(nid) is not None
