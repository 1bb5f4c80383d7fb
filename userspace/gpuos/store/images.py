"""The image store: images on disk, written aside and published atomically.

An image is a directory ``<name>/`` holding ``manifest.json``; its files' contents are
chunks (chunks.py) in the store's ``.chunks/`` (an image outside a store: its own
``chunks/``).  It is built in a hidden sibling staging directory ``.<name>.staging-<op>``:
CRIU and gpuos write the files there, ingest (content.py) stores their chunks, the
manifest is written, the files are deleted, and the directory is published with one
rename (``renameat2(RENAME_EXCHANGE)`` when an image of that name exists, so a reader
sees either the old image or the new one, never neither).  The old image, swapped into
the staging path, is deleted afterwards; chunks no image uses any more go at the next
``gc``.  A crash leaves at most a staging directory behind, which recovery finishes or
deletes.  Images of formats 1-4 hold whole files and are read, verified and deleted as
they are.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import os
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from ..errors import GpuosError, ImageCorrupt, ImageNotFound
from ..manifest import MANIFEST_NAME, FileEntry, Manifest
from ..observe import Progress
from .chunks import ChunkStore
from .content import ImageContent

SHARED_CHUNKS = ".chunks"  # a store's chunk directory, beside its images
OWN_CHUNKS = "chunks"      # an image's own, inside it (an image outside a store)

NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,127}")
STAGING_MARK = ".staging-"
CHUNK = 8 << 20
PIECE = 64 << 20  # files are hashed in pieces of this size, in parallel (FileEntry.pieces)


_AT_FDCWD = -100
_RENAME_NOREPLACE = 1
_RENAME_EXCHANGE = 2


def _renameat2(old: Path, new: Path, flags: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.renameat2(_AT_FDCWD, os.fsencode(old), _AT_FDCWD, os.fsencode(new), flags) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"renameat2({old}, {new}): {os.strerror(err)}")


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if path.is_dir() else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _hash_file(path: Path, progress: Progress | None) -> str:
    """The whole content's sha256, serially (files of images before format 4)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
            if progress:
                progress(len(chunk))
    return digest.hexdigest()


def _piece_digest(path: Path, index: int, progress: Progress | None, size: int) -> str:
    """sha256 of one PIECE of the file's first `size` bytes (hashlib lets go of the GIL:
    pieces hash in parallel)."""
    digest = hashlib.sha256()
    fd = os.open(path, os.O_RDONLY)
    try:
        off, end = index * PIECE, min((index + 1) * PIECE, size)
        while off < end and (data := os.pread(fd, min(CHUNK, end - off), off)):
            digest.update(data)
            off += len(data)
            if progress:
                progress(len(data))
    finally:
        os.close(fd)
    return digest.hexdigest()


def hash_files(paths: list[Path], progress: Progress | None = None, workers: int | None = None,
               sizes: list[int] | None = None) -> list[tuple[str, list[str]]]:
    """(sha256, pieces) of each file as FileEntry has them (of its first sizes[i] bytes if
    given), every piece of every file hashed in parallel."""
    sizes = sizes or [p.stat().st_size for p in paths]
    counts = [max(1, -(-n // PIECE)) for n in sizes]
    tasks = [(p, k, n) for p, c, n in zip(paths, counts, sizes) for k in range(c)]
    with ThreadPoolExecutor(max_workers=workers or min(32, os.cpu_count() or 4)) as pool:
        digests = iter(list(pool.map(lambda t: _piece_digest(t[0], t[1], progress, t[2]), tasks)))
    return [combine_pieces([next(digests) for _ in range(n)]) for n in counts]


def combine_pieces(pieces: list[str]) -> tuple[str, list[str]]:
    """(sha256, pieces) of a file from its pieces' digests, as FileEntry has them: one piece
    is the file's digest, more are hashed together."""
    if len(pieces) == 1:
        return pieces[0], []
    return hashlib.sha256(b"".join(bytes.fromhex(d) for d in pieces)).hexdigest(), pieces


def _walk_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and not p.is_symlink())


@dataclass
class ImageEntry:
    """One entry of ``images list``: a manifest, or why it could not be read."""

    name: str
    path: Path
    manifest: Manifest | None
    problem: str | None


@dataclass
class ImageUsage:
    """What an image takes in its store: `own` bytes (chunks no other image uses, freed
    when it goes), `shared` bytes (chunks other images use too), or for images of formats
    1-4 and images with their own chunks, everything own."""

    name: str
    size: int    # the content's bytes, as restored
    own: int
    shared: int


@dataclass
class GcResult:
    chunks: int   # chunks deleted
    bytes: int    # their bytes
    kept: int     # chunks kept
    kept_bytes: int


class ImageStore:
    def __init__(self, root: Path, hot_base: Path | None = None):
        self.root = Path(root)
        self.hot_base = hot_base  # where hot tiers live (tmpfs), None: no hot tier

    # -- naming -----------------------------------------------------------
    def resolve(self, ref: str) -> Path:
        """An image reference is a name in the store, or a path (has a '/')."""
        if "/" in ref or ref in (".", ".."):
            return Path(ref).absolute()
        if not NAME_RE.fullmatch(ref):
            raise GpuosError(
                f"bad image name {ref!r}: use letters, digits and ._+- (128 at most), "
                "or a path with a '/'")
        return self.root / ref

    @staticmethod
    def staging_for(final: Path, op_id: str) -> Path:
        return final.parent / f".{final.name}{STAGING_MARK}{op_id}"

    def in_store(self, image: Path) -> bool:
        return image.parent.absolute() == self.root.absolute()

    def chunk_dir_for(self, final: Path) -> str:
        """Where a new image at `final` keeps its chunks, relative to it: the store's shared
        chunk directory, or (outside the store) its own."""
        return f"../{SHARED_CHUNKS}" if self.in_store(final) else OWN_CHUNKS

    def chunks(self) -> ChunkStore:
        """The store's shared chunks."""
        return ChunkStore(self.root / SHARED_CHUNKS, self.hot_base)

    def chunks_of(self, image: Path, manifest: Manifest) -> ChunkStore:
        return ChunkStore(image / manifest.chunk_dir, self.hot_base)

    def content(self, image: Path, manifest: Manifest, verify: bool = True) -> ImageContent:
        return ImageContent(image, manifest, self.hot_base, verify)

    # -- reading ----------------------------------------------------------
    @staticmethod
    def load(image: Path) -> Manifest:
        if not image.is_dir():
            raise ImageNotFound(f"no image at {image}")
        mpath = image / MANIFEST_NAME
        if not mpath.is_file():
            raise ImageCorrupt(f"{image}: incomplete image (no {MANIFEST_NAME})")
        return Manifest.from_json(mpath.read_text(), where=str(mpath))

    def verify(self, image: Path, manifest: Manifest, progress: Progress | None = None) -> None:
        """Raise ImageCorrupt naming every missing, changed or extra file or chunk."""
        if manifest.chunked:
            content = self.content(image, manifest)
            with content.chunks.shared():
                problems = content.check_all(progress)
            if problems:
                more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
                raise ImageCorrupt(f"{image}: {problems[0]}{more}")
            return
        problems: list[str] = []
        present = {p.relative_to(image).as_posix() for p in _walk_files(image)}
        present.discard(MANIFEST_NAME)
        expected = {f.path: f for f in manifest.files}
        for rel in sorted(present - expected.keys()):
            problems.append(f"unexpected file {rel}")
        to_hash: list[FileEntry] = []
        for rel, entry in sorted(expected.items()):
            if rel not in present:
                problems.append(f"missing {rel}")
            elif (image / rel).stat().st_size != entry.size:
                problems.append(f"{rel}: size {(image / rel).stat().st_size}, expected {entry.size}")
            else:
                to_hash.append(entry)
        # Entries with pieces, and files of one piece, in parallel pieces; a large file of
        # an image before format 4 has only its whole sha256.
        whole = [e for e in to_hash if not e.pieces and e.size > PIECE]
        pieced = [e for e in to_hash if e not in whole]
        sums = hash_files([image / e.path for e in pieced], progress)
        for e, (sha, pieces) in zip(pieced, sums):
            if sha != e.sha256:
                bad = [k for k, (a, b) in enumerate(zip(pieces, e.pieces)) if a != b]
                problems.append(f"{e.path}: checksum mismatch"
                                + (f" (bytes {bad[0] * PIECE}-{(bad[0] + 1) * PIECE - 1})" if bad else ""))
        with ThreadPoolExecutor(max_workers=4) as pool:
            wsums = list(pool.map(lambda e: _hash_file(image / e.path, progress), whole))
        problems += [f"{e.path}: checksum mismatch" for e, s in zip(whole, wsums) if s != e.sha256]
        if problems:
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            raise ImageCorrupt(f"{image}: {problems[0]}{more}")

    def entries(self) -> Iterator[ImageEntry]:
        if not self.root.is_dir():
            return
        for path in sorted(self.root.iterdir()):
            if path.name.startswith(".") or not path.is_dir():
                continue
            try:
                yield ImageEntry(path.name, path, self.load(path), None)
            except GpuosError as exc:
                yield ImageEntry(path.name, path, None, exc.message)

    def usage(self, entries: list[ImageEntry]) -> dict[str, ImageUsage]:
        """Own and shared bytes of each readable image (by name) among `entries`, which
        should be the whole store: a chunk is shared when two of them use it."""
        users: dict[str, int] = {}
        for e in entries:
            if e.manifest and e.manifest.chunked and self.in_store(e.path):
                for cid in e.manifest.chunk_set():
                    users[cid] = users.get(cid, 0) + 1
        out = {}
        for e in entries:
            if e.manifest is None:
                continue
            m = e.manifest
            if not (m.chunked and self.in_store(e.path)):
                own = sum(m.chunk_set().values()) if m.chunked else m.total_size
                out[e.name] = ImageUsage(e.name, m.total_size, own, 0)
                continue
            own = shared = 0
            for cid, size in m.chunk_set().items():
                if users[cid] > 1:
                    shared += size
                else:
                    own += size
            out[e.name] = ImageUsage(e.name, m.total_size, own, shared)
        return out

    def referenced(self) -> set[str]:
        """Every chunk of the store's chunk directory that an image uses, or that a staged
        image with its manifest written (recovery publishes it) uses.  ImageCorrupt if an
        image's manifest cannot be read: what it uses is then unknown."""
        keep: set[str] = set()
        for path in [p for p in self.root.iterdir() if p.is_dir() and p.name != SHARED_CHUNKS]:
            staged = STAGING_MARK in path.name
            if path.name.startswith(".") and not staged:
                continue
            if staged and not (path / MANIFEST_NAME).is_file():
                continue  # its files are still there: recovery ingests them again
            try:
                m = self.load(path)
            except GpuosError as exc:
                raise ImageCorrupt(f"cannot tell which chunks {path} uses ({exc.message}): "
                                   "delete it (gpuos images rm) or mend it first") from None
            if m.chunked and m.chunk_dir == f"../{SHARED_CHUNKS}":
                keep |= m.chunk_set().keys()
        return keep

    def gc(self, wait: float = 0.0) -> GcResult:
        """Delete the store's chunks that no image uses (both tiers).  Busy if a checkpoint,
        restore or verify holds the store after `wait` seconds."""
        chunks = self.chunks()
        if not self.root.is_dir():
            return GcResult(0, 0, 0, 0)
        with chunks.exclusive(wait):
            keep = self.referenced()
            count, freed = chunks.collect(keep)
            present = chunks.present()
        return GcResult(count, freed, len(present), sum(present.values()))

    # -- writing ----------------------------------------------------------
    @staticmethod
    def write_manifest(staging: Path, manifest: Manifest) -> None:
        tmp = staging / (MANIFEST_NAME + ".tmp")
        with open(tmp, "w") as f:
            f.write(manifest.to_json())
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, staging / MANIFEST_NAME)
        fsync_path(staging)

    @staticmethod
    def drop_files(staging: Path) -> None:
        """A staged chunked image whose manifest is written: its files go (their content is
        in the chunks), leaving the manifest (and its own chunks)."""
        for p in staging.iterdir():
            if p.name in (MANIFEST_NAME, OWN_CHUNKS):
                continue
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            else:
                p.unlink()

    @staticmethod
    def publish(staging: Path, final: Path) -> None:
        """Make the staged image visible at ``final`` in one step."""
        final.parent.mkdir(parents=True, exist_ok=True)
        try:
            _renameat2(staging, final, _RENAME_NOREPLACE)
        except OSError as exc:
            if exc.errno != errno.EEXIST:
                raise
            _renameat2(staging, final, _RENAME_EXCHANGE)
            fsync_path(final.parent)
            shutil.rmtree(staging)  # the previous image now lives here
        fsync_path(final.parent)

    def remove(self, image: Path) -> None:
        """Delete an image: first hidden by a rename, so no half-deleted image is visible.
        Its chunks in the store stay until gc."""
        if not image.is_dir():
            raise ImageNotFound(f"no image at {image}")
        trash = self.staging_for(image, f"rm-{os.getpid()}")
        os.rename(image, trash)
        fsync_path(image.parent)
        shutil.rmtree(trash)

    @staticmethod
    def staging_dirs(parent: Path) -> list[Path]:
        if not parent.is_dir():
            return []
        return sorted(p for p in parent.iterdir() if p.name.startswith(".") and STAGING_MARK in p.name)
