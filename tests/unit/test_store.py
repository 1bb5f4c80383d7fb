"""The image store: names, ingest into chunks, atomic publishing, verification, removal;
images of format 4 (whole files) still verify.  The chunk store itself: test_chunks.py."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from gpuos.errors import GpuosError, ImageCorrupt, ImageFormatUnsupported, ImageNotFound
from gpuos.manifest import CRIU_DIR, FORMAT_VERSION, MANIFEST_NAME
from gpuos.store import ImageStore
from gpuos.store.content import ingest, staged_files

from helpers import (build_image, build_v4_image, hidden_entries, legacy_entries, make_manifest,
                     tree_digest, write_criu_files)


# -- resolve ---------------------------------------------------------------------

@pytest.mark.parametrize("name", ["job", "job-1234", "a", "A.b_c+d-1", "x" * 128, "0abc"])
def test_resolve_name_is_in_store(store: ImageStore, name: str):
    assert store.resolve(name) == store.root / name


@pytest.mark.parametrize("ref", ["/abs/dir/img", "rel/img", "./img", "."])
def test_resolve_path_is_taken_as_path(store: ImageStore, ref: str, tmp_path: Path,
                                       monkeypatch: pytest.MonkeyPatch):
    monkeypatch.chdir(tmp_path)
    got = store.resolve(ref)
    assert got.is_absolute()
    assert got == Path(ref).absolute()
    assert store.root not in got.parents


@pytest.mark.parametrize("name", ["", ".hidden", "-dash", "_x", "has space", "semi;colon", "x" * 129,
                                  "tab\tname", "star*", "new\nline", "ünï", "trailing\n"])
def test_resolve_rejects_bad_names(store: ImageStore, name: str):
    with pytest.raises(GpuosError) as exc:
        store.resolve(name)
    assert type(exc.value) is GpuosError
    assert exc.value.exit_code == 1
    assert "bad image name" in exc.value.message


def test_staging_is_hidden_sibling(store: ImageStore):
    final = store.root / "job"
    staging = store.staging_for(final, "abc123")
    assert staging.parent == final.parent
    assert staging.name.startswith(".") and staging.name.endswith("abc123")
    assert ImageStore.staging_dirs(store.root) == []  # naming only; nothing created


# -- ingest ------------------------------------------------------------------------

def test_ingest_lists_every_file_but_the_manifest_as_chunks(store: ImageStore, tmp_path: Path):
    root = tmp_path / "img"
    write_criu_files(root / CRIU_DIR)
    (root / "criu" / "sub").mkdir()
    (root / "criu" / "sub" / "deep.img").write_bytes(b"deep")
    (root / "criu" / "empty.img").write_bytes(b"")
    (root / MANIFEST_NAME).write_text("{}")
    seen: list[int] = []
    with store.chunks().shared():
        entries, stats = ingest(staged_files(root), store.chunks(), progress=seen.append)
    by_path = {e.path: e for e in entries}
    assert set(by_path) == {"criu/pages-1.img", "criu/core-4242.img", "criu/dump.log",
                            "criu/sub/deep.img", "criu/empty.img"}
    for rel, e in by_path.items():
        data = (root / rel).read_bytes()
        assert e.size == len(data)
        assert b"".join(store.chunks().read(c) for c in e.chunks) == data
        assert e.mode == (root / rel).stat().st_mode & 0o7777
    assert by_path["criu/empty.img"].chunks == []
    assert sum(seen) == stats.bytes == sum(e.size for e in entries)
    assert stats.new_bytes == stats.bytes  # an empty store: everything is new


# -- publish -------------------------------------------------------------------------

def _staged(store: ImageStore, name: str, seed: bytes, op: str = "op1") -> Path:
    """A staged image as checkpoint() leaves it just before publishing."""
    final = store.root / name
    staging = store.staging_for(final, op)
    write_criu_files(staging / CRIU_DIR, seed)
    m = make_manifest(name, chunk_dir=store.chunk_dir_for(final))
    with store.chunks().shared():
        m.files, _ = ingest(staged_files(staging), store.chunks())
    ImageStore.write_manifest(staging, m)
    ImageStore.drop_files(staging)
    return staging


def test_publish_onto_nothing(store: ImageStore):
    staging = _staged(store, "job", b"new")
    before = tree_digest(staging)
    final = store.root / "job"
    ImageStore.publish(staging, final)
    assert not staging.exists()
    assert tree_digest(final) == before
    assert sorted(os.listdir(store.root)) == [".chunks", "job"]
    store.verify(final, ImageStore.load(final))


def test_publish_creates_the_store(tmp_path: Path):
    store = ImageStore(tmp_path / "not" / "yet")
    staging = tmp_path / ".x.staging-1"
    write_criu_files(staging / CRIU_DIR)
    ImageStore.publish(staging, store.root / "x")
    assert (store.root / "x" / CRIU_DIR / "dump.log").is_file()


def test_publish_replaces_existing_image_and_leaves_nothing_behind(store: ImageStore):
    old = build_image(store, "job", seed=b"old")
    old_digest = tree_digest(old)
    staging = _staged(store, "job", b"new", op="op2")
    new_digest = tree_digest(staging)
    assert new_digest != old_digest
    ImageStore.publish(staging, old)
    assert tree_digest(store.root / "job") == new_digest
    assert not staging.exists()
    assert sorted(os.listdir(store.root)) == [".chunks", "job"]
    assert hidden_entries(store.root) == []


def test_a_published_image_holds_only_its_manifest(store: ImageStore):
    staging = _staged(store, "job", b"x")
    assert sorted(p.name for p in staging.iterdir()) == [MANIFEST_NAME]


def test_an_image_outside_the_store_has_its_own_chunks(store: ImageStore, tmp_path: Path):
    from helpers import store_staged
    final = tmp_path / "elsewhere" / "img"
    staging = store.staging_for(final, "op")
    write_criu_files(staging / CRIU_DIR)
    store_staged(store, staging, final, make_manifest("img"))
    m = ImageStore.load(final)
    assert m.chunk_dir == "chunks" and (final / "chunks").is_dir()
    assert not (store.root / ".chunks").exists()
    store.verify(final, m)


# -- load / verify -------------------------------------------------------------------

def test_load_missing_image(store: ImageStore):
    with pytest.raises(ImageNotFound):
        ImageStore.load(store.root / "nope")


def test_load_without_manifest_is_incomplete(store: ImageStore):
    d = store.root / "half"
    write_criu_files(d / CRIU_DIR)
    with pytest.raises(ImageCorrupt, match="incomplete"):
        ImageStore.load(d)


def test_load_reports_format_version(store: ImageStore):
    img = build_image(store, "job")
    text = (img / MANIFEST_NAME).read_text().replace(f'"format_version": {FORMAT_VERSION}', '"format_version": 7')
    (img / MANIFEST_NAME).write_text(text)
    with pytest.raises(ImageFormatUnsupported):
        ImageStore.load(img)


def test_verify_accepts_intact_image(store: ImageStore):
    img = build_image(store, "job")
    store.verify(img, ImageStore.load(img))


def _verify_problem(store: ImageStore, img: Path) -> str:
    with pytest.raises(ImageCorrupt) as exc:
        store.verify(img, ImageStore.load(img))
    assert exc.value.exit_code == 10
    return exc.value.message


def _chunk_of(store: ImageStore, img: Path, rel: str) -> Path:
    entry = next(f for f in ImageStore.load(img).files if f.path == rel)
    return store.chunks().stored(entry.chunks[0].id)


def test_verify_names_a_missing_chunk(store: ImageStore):
    img = build_image(store, "job")
    chunk = _chunk_of(store, img, "criu/core-4242.img")
    chunk.unlink()
    msg = _verify_problem(store, img)
    assert f"chunk {chunk.parent.name}{chunk.name} (criu/core-4242.img at byte 0) is missing" in msg


def test_verify_names_a_corrupt_chunk(store: ImageStore):
    img = build_image(store, "job")
    chunk = _chunk_of(store, img, "criu/pages-1.img")
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0x01
    chunk.chmod(0o644)
    chunk.write_bytes(bytes(data))
    assert "(criu/pages-1.img at byte 0) is corrupt" in _verify_problem(store, img)


def test_verify_names_a_short_chunk(store: ImageStore):
    img = build_image(store, "job")
    chunk = _chunk_of(store, img, "criu/core-4242.img")  # stored raw
    chunk.chmod(0o644)
    chunk.write_bytes(chunk.read_bytes()[:-1])
    assert "is short" in _verify_problem(store, img)


def test_host_memory_is_stored_compressed_when_that_pays(store: ImageStore):
    """CRIU's page images (host memory) are compressed (zstd) when that saves a tenth;
    a damaged compressed chunk is refused like any other."""
    img = build_image(store, "job")  # write_criu_files: pages-1.img repeats one digest: compresses
    pages = _chunk_of(store, img, "criu/pages-1.img")
    core = _chunk_of(store, img, "criu/core-4242.img")
    assert pages.name.endswith(".zst") and not core.name.endswith(".zst")
    entry = next(f for f in ImageStore.load(img).files if f.path == "criu/pages-1.img")
    assert pages.stat().st_size < 0.5 * entry.size
    assert store.chunks().present()[entry.chunks[0].id] == pages.stat().st_size  # what it takes on disk
    store.verify(img, ImageStore.load(img))
    pages.chmod(0o644)
    pages.write_bytes(pages.read_bytes()[:-3])
    assert "is corrupt: it does not decompress" in _verify_problem(store, img)


def test_verify_counts_every_problem(store: ImageStore):
    img = build_image(store, "job")
    for rel in ("criu/core-4242.img", "criu/dump.log", "criu/pages-1.img"):
        _chunk_of(store, img, rel).unlink()
    assert "(and 2 more)" in _verify_problem(store, img)


# -- format 4 (whole files in the image) -------------------------------------------------

def test_v4_verify_accepts_intact_image(store: ImageStore):
    img = build_v4_image(store, "job")
    m = ImageStore.load(img)
    assert m.format_version == 4 and not m.chunked
    store.verify(img, m)


def test_v4_verify_detects_missing_file(store: ImageStore):
    img = build_v4_image(store, "job")
    (img / "criu" / "core-4242.img").unlink()
    assert "missing criu/core-4242.img" in _verify_problem(store, img)


def test_v4_verify_detects_extra_file(store: ImageStore):
    img = build_v4_image(store, "job")
    (img / "criu" / "stats-restore").write_bytes(b"x")
    assert "unexpected file criu/stats-restore" in _verify_problem(store, img)


def test_v4_verify_detects_size_change(store: ImageStore):
    img = build_v4_image(store, "job")
    with open(img / "criu" / "pages-1.img", "ab") as f:
        f.write(b"\0")
    assert "criu/pages-1.img: size" in _verify_problem(store, img)


def test_v4_verify_detects_same_size_content_change(store: ImageStore):
    img = build_v4_image(store, "job")
    pages = img / "criu" / "pages-1.img"
    data = bytearray(pages.read_bytes())
    data[len(data) // 2] ^= 0x01
    pages.write_bytes(bytes(data))
    assert "criu/pages-1.img: checksum mismatch" in _verify_problem(store, img)


def test_v4_verify_counts_every_problem(store: ImageStore):
    img = build_v4_image(store, "job")
    (img / "criu" / "core-4242.img").unlink()
    (img / "criu" / "extra").write_bytes(b"x")
    (img / "criu" / "dump.log").write_text("changed")
    assert "(and 2 more)" in _verify_problem(store, img)


# -- entries / remove ----------------------------------------------------------------

def test_entries_lists_images_and_broken_ones_but_not_staging(store: ImageStore):
    build_image(store, "good")
    write_criu_files(store.root / "broken" / CRIU_DIR)
    write_criu_files(store.staging_for(store.root / "good", "zz") / CRIU_DIR)
    (store.root / "stray-file").write_text("x")
    got = {e.name: e for e in store.entries()}
    assert sorted(got) == ["broken", "good"]
    assert got["good"].manifest is not None and got["good"].problem is None
    assert got["broken"].manifest is None and "incomplete" in got["broken"].problem


def test_entries_of_missing_store_is_empty(tmp_path: Path):
    assert list(ImageStore(tmp_path / "none").entries()) == []


def test_remove(store: ImageStore):
    build_image(store, "a", seed=b"a")
    b = build_image(store, "b", seed=b"b")
    b_digest = tree_digest(b)
    store.remove(store.root / "a")
    assert sorted(os.listdir(store.root)) == [".chunks", "b"]
    assert tree_digest(b) == b_digest


def test_remove_missing(store: ImageStore):
    with pytest.raises(ImageNotFound):
        store.remove(store.root / "nope")


def test_staging_dirs(store: ImageStore):
    build_image(store, "a")
    s1 = store.staging_for(store.root / "a", "op1")
    s1.mkdir()
    (store.root / ".other-hidden").mkdir()
    assert ImageStore.staging_dirs(store.root) == [s1]
    assert ImageStore.staging_dirs(store.root / "missing") == []


def test_large_files_are_hashed_in_pieces_and_a_bad_piece_is_named(tmp_path: Path, monkeypatch):
    """A file larger than a piece gets a digest per piece (hashed in parallel) and a root
    digest over them; verify names the piece that changed."""
    import gpuos.store.images as S

    monkeypatch.setattr(S, "PIECE", 4096)
    monkeypatch.setattr(S, "CHUNK", 1000)  # reads smaller than a piece, not dividing it
    root = tmp_path / "img"
    root.mkdir()
    data = os.urandom(3 * 4096 + 17)
    (root / "big.bin").write_bytes(data)
    (root / "small.bin").write_bytes(b"x" * 100)
    entries = {e.path: e for e in legacy_entries(root)}
    big, small = entries["big.bin"], entries["small.bin"]
    pieces = [hashlib.sha256(data[k:k + 4096]).hexdigest() for k in range(0, len(data), 4096)]
    assert big.pieces == pieces and len(pieces) == 4
    assert big.sha256 == hashlib.sha256(b"".join(bytes.fromhex(p) for p in pieces)).hexdigest()
    assert small.pieces == [] and small.sha256 == hashlib.sha256(b"x" * 100).hexdigest()
    m = make_manifest(format_version=4)
    m.files = list(entries.values())
    ImageStore(tmp_path).verify(root, m)
    with open(root / "big.bin", "r+b") as f:
        f.seek(2 * 4096 + 5)
        f.write(bytes([data[2 * 4096 + 5] ^ 1]))
    with pytest.raises(ImageCorrupt, match=r"big.bin: checksum mismatch \(bytes 8192-12287\)"):
        ImageStore(tmp_path).verify(root, m)


def test_a_large_file_of_an_older_image_verifies_by_its_whole_sha256(tmp_path: Path, monkeypatch):
    import gpuos.store.images as S
    from gpuos.manifest import FileEntry

    monkeypatch.setattr(S, "PIECE", 4096)
    root = tmp_path / "img"
    root.mkdir()
    data = os.urandom(5 * 4096)
    (root / "pages.img").write_bytes(data)
    m = make_manifest(format_version=3)
    m.files = [FileEntry("pages.img", len(data), sha256=hashlib.sha256(data).hexdigest())]
    ImageStore(tmp_path).verify(root, m)
    (root / "pages.img").write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    with pytest.raises(ImageCorrupt, match="pages.img: checksum mismatch"):
        ImageStore(tmp_path).verify(root, m)
