"""The image store: images on disk, written aside and published atomically.

An image is a directory ``<name>/`` holding ``manifest.json`` and CRIU's
files under ``criu/``.  It is built in a hidden sibling staging directory
``.<name>.staging-<op>``; every file is fsynced and checksummed, the manifest
written last, and the directory is then published with one rename
(``renameat2(RENAME_EXCHANGE)`` when an image of that name exists, so a
reader sees either the old image or the new one, never neither).  The old
image, swapped into the staging path, is deleted afterwards.  A crash leaves at
most a staging directory behind, which recovery finishes or deletes.
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

from .errors import GpuosError, ImageCorrupt, ImageNotFound
from .manifest import MANIFEST_NAME, FileEntry, Manifest
from .observe import Progress

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


def checksum_tree(root: Path, progress: Progress | None = None,
                  known: dict[str, FileEntry] | None = None) -> list[FileEntry]:
    """Checksum (in parallel pieces) and fsync every regular file under root (the manifest
    excluded); `known` files (by relative path: hashed as they were written) are not read again."""
    known = known or {}
    files = [p for p in _walk_files(root) if p.relative_to(root).as_posix() != MANIFEST_NAME]
    todo = [p for p in files if p.relative_to(root).as_posix() not in known]
    hashed = dict(zip(todo, hash_files(todo, progress)))
    sums = [hashed[p] if p in hashed else (known[p.relative_to(root).as_posix()].sha256,
                                           known[p.relative_to(root).as_posix()].pieces) for p in files]
    with ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(fsync_path, files))
    for d in sorted({p.parent for p in files} | {root}, key=lambda p: -len(p.parts)):
        fsync_path(d)
    return [FileEntry(path=p.relative_to(root).as_posix(), size=p.stat().st_size, sha256=s, pieces=pc)
            for p, (s, pc) in zip(files, sums)]


def tree_size(root: Path) -> int:
    return sum(p.stat().st_size for p in _walk_files(root))


@dataclass
class ImageEntry:
    """One entry of ``images list``: a manifest, or why it could not be read."""

    name: str
    path: Path
    manifest: Manifest | None
    problem: str | None


class ImageStore:
    def __init__(self, root: Path):
        self.root = Path(root)

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

    # -- reading ----------------------------------------------------------
    @staticmethod
    def load(image: Path) -> Manifest:
        if not image.is_dir():
            raise ImageNotFound(f"no image at {image}")
        mpath = image / MANIFEST_NAME
        if not mpath.is_file():
            raise ImageCorrupt(f"{image}: incomplete image (no {MANIFEST_NAME})")
        return Manifest.from_json(mpath.read_text(), where=str(mpath))

    @staticmethod
    def verify(image: Path, manifest: Manifest, progress: Progress | None = None) -> None:
        """Raise ImageCorrupt naming every missing, resized, changed or extra file."""
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
        """Delete an image: first hidden by a rename, so no half-deleted image is visible."""
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
