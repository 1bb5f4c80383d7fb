"""Content-addressed chunks: the data of images, one copy of each, shared by the images
of a store.

A chunk is a file named by the BLAKE3-256 of its content (``<dir>/ab/cdef...``), written
aside, fsynced and renamed into place, never changed afterwards: two writers of the same
chunk write the same bytes, and whatever name is there is complete.  A chunk of a
process's host memory is stored compressed (zstd, ``<name>.zst``) when that saves a
tenth or more: what replicas do not share of it is pointers and the driver's saved state,
which compress, while GPU memory (weights) is kept as it is, for the restore's speed.  Every
read checks the content against the name (a corrupt chunk is an error naming it, and
nothing is built from it).  Two tiers:

    cold  the chunk directory on disk (the store's ``.chunks/``, or an image's own
          ``chunks/`` for an image outside a store); every chunk is there
    hot   copies of some chunks in memory (tmpfs, ``gpuos images warm``), read first

Chunks that no image references are deleted by ``gc`` only, under an exclusive lock;
checkpoints (from the first chunk written until the image is published), restores and
verifies hold the lock shared, so a chunk is never deleted under them.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable, Iterator

from ..errors import Busy, GpuosError, ImageCorrupt
from ..locks import flock_within
from ..manifest import Chunk

LOCK_NAME = "lock"
TMP_DIR = "tmp"
ZST = ".zst"        # a chunk stored compressed
ZST_LEVEL = 3
ZST_WORTH = 0.9     # kept compressed only below this share of its size
HASH_THREADS = 1  # BLAKE3's own threads per chunk: chunks are hashed in parallel already


def digest(data: memoryview | bytes) -> str:
    """A chunk's name: the BLAKE3-256 of its content, hex (lets go of the GIL)."""
    import blake3  # here: what only reads manifests (the VM tests' guest) does without it

    return blake3.blake3(data, max_threads=HASH_THREADS).hexdigest()


def hot_dir_for(cold: Path, hot_base: Path) -> Path:
    """The hot tier of a chunk directory: a directory of its own under hot_base."""
    return hot_base / ("hot-" + hashlib.sha256(os.fsencode(cold.resolve())).hexdigest()[:16])


class ChunkStore:
    def __init__(self, root: Path, hot_base: Path | None = None):
        self.root = Path(root)
        self.hot = hot_dir_for(self.root, hot_base) if hot_base else None

    def path(self, cid: str) -> Path:
        return self.root / cid[:2] / cid[2:]

    def hot_path(self, cid: str) -> Path | None:
        return self.hot / cid[:2] / cid[2:] if self.hot else None

    # -- locking ----------------------------------------------------------
    def _lock_fd(self) -> int:
        self.root.mkdir(parents=True, exist_ok=True)
        return os.open(self.root / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)

    @contextmanager
    def shared(self) -> Iterator[None]:
        """Held by whoever writes or reads chunks: gc waits for it."""
        fd = self._lock_fd()
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            yield
        finally:
            os.close(fd)

    @contextmanager
    def exclusive(self, wait: float = 0.0) -> Iterator[None]:
        """Held by gc: no checkpoint, restore or verify of this store runs meanwhile.
        Busy after `wait` seconds."""
        fd = self._lock_fd()
        try:
            if not flock_within(fd, wait, 0.05):
                raise Busy(f"the chunk store {self.root} is in use by a checkpoint, "
                           "restore or verify; try again when it ends")
            yield
        finally:
            os.close(fd)

    # -- writing ----------------------------------------------------------
    def put(self, cid: str, data: memoryview | bytes, compress: bool = False) -> bool:
        """Store a chunk (its name already computed) unless it is there: whether it was
        written.  compress: as zstd if that saves a tenth.  Written aside, fsynced,
        renamed: a name is always a whole chunk.  The directory is made durable by
        sync_dirs."""
        final = self.path(cid)
        if final.exists() or final.with_name(final.name + ZST).exists():
            return False
        if compress:
            import zstandard  # here: what only reads raw chunks does without it

            packed = zstandard.ZstdCompressor(level=ZST_LEVEL).compress(data)
            if len(packed) < len(data) * ZST_WORTH:
                data, final = packed, final.with_name(final.name + ZST)
        tmpdir = self.root / TMP_DIR
        tmpdir.mkdir(parents=True, exist_ok=True)
        final.parent.mkdir(exist_ok=True)
        tmp = tmpdir / f"{cid}.{os.getpid()}.{id(data):x}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o444)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, final)
        return True

    def sync_dirs(self, cids: Iterable[str]) -> None:
        """fsync the directories that new chunks were renamed into, then the store's."""
        for sub in sorted({c[:2] for c in cids}):
            _fsync(self.root / sub)
        _fsync(self.root)

    # -- reading ----------------------------------------------------------
    def read_into(self, chunk: Chunk, buf: memoryview, verify: bool = True, where: str = "") -> None:
        """The chunk's content into buf (len(buf) == chunk.size), from the hot tier if it
        has it; checked against its name unless verify is False.  ImageCorrupt if it is
        missing, short or changed (`where` says what the image wanted it for)."""
        what = f"chunk {chunk.id}" + (f" ({where})" if where else "")
        hot = self.hot_path(chunk.id)
        path = hot if hot is not None and hot.exists() else self.stored(chunk.id)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC) if path else -1
        except FileNotFoundError:
            fd = -1
        if fd < 0:
            raise ImageCorrupt(f"{what} is missing from {self.root}")
        packed = path.name.endswith(ZST)
        try:
            if packed:
                _unpack_into(fd, buf, what)
            else:
                got = 0
                while got < chunk.size:
                    n = os.preadv(fd, [buf[got:]], got)
                    if n == 0:
                        raise ImageCorrupt(f"{what} is short: {got} bytes, the image says {chunk.size}")
                    got += n
                if os.pread(fd, 1, chunk.size):
                    raise ImageCorrupt(f"{what} is longer than the {chunk.size} bytes the image says")
        finally:
            os.close(fd)
        if verify and digest(buf) != chunk.id:
            raise ImageCorrupt(f"{what} is corrupt: its content does not match its name")

    # -- tiers --------------------------------------------------------------
    def warm(self, chunks: Iterable[Chunk]) -> int:
        """Copy chunks into the hot tier (those it lacks); bytes copied."""
        if self.hot is None:
            raise GpuosError("no hot tier configured ($GPUOS_HOT)")
        copied = 0
        for c in {c.id: c for c in chunks}.values():
            dst = self.hot_path(c.id)
            if dst.exists():
                continue
            dst.parent.mkdir(parents=True, exist_ok=True)
            buf = memoryview(bytearray(c.size))
            self.read_into(c, buf, where="warming")
            tmp = dst.with_name(dst.name + f".tmp{os.getpid()}")
            with open(tmp, "wb") as f:
                f.write(buf)
            os.rename(tmp, dst)
            copied += c.size
        return copied

    def prefetch(self, chunks: Iterable[Chunk]) -> None:
        """Start reading chunks into the page cache (POSIX_FADV_WILLNEED: the kernel reads
        ahead while the caller does something else); those in the hot tier need nothing."""
        for c in chunks:
            hp = self.hot_path(c.id)
            if hp is not None and hp.exists():
                continue
            fd = self._open_stored(c.id)
            if fd < 0:
                continue  # the read says so
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
            finally:
                os.close(fd)

    def cool(self, chunks: Iterable[Chunk]) -> int:
        """Drop chunks from the hot tier and from the page cache; bytes dropped from the
        hot tier."""
        dropped = 0
        for c in {c.id: c for c in chunks}.values():
            hp = self.hot_path(c.id)
            if hp is not None:
                try:
                    hp.unlink()
                    dropped += c.size
                except FileNotFoundError:
                    pass
            fd = self._open_stored(c.id)
            if fd < 0:
                continue
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        return dropped

    def stored(self, cid: str) -> Path | None:
        """The cold tier's file of a chunk: raw, or compressed (ZST); None if neither."""
        for path in (self.path(cid), self.path(cid).with_name(cid[2:] + ZST)):
            if path.exists():
                return path
        return None

    def read(self, chunk: Chunk) -> bytes:
        """A chunk's content, checked."""
        buf = bytearray(chunk.size)
        self.read_into(chunk, memoryview(buf))
        return bytes(buf)

    def _open_stored(self, cid: str) -> int:
        """stored(cid), open; -1 if there is none."""
        path = self.stored(cid)
        try:
            return os.open(path, os.O_RDONLY | os.O_CLOEXEC) if path else -1
        except FileNotFoundError:
            return -1

    # -- the whole store ------------------------------------------------------
    def present(self) -> dict[str, int]:
        """Every chunk in the cold tier: name -> bytes it takes on disk."""
        found: dict[str, int] = {}
        if not self.root.is_dir():
            return found
        for sub in self.root.iterdir():
            if len(sub.name) != 2 or not sub.is_dir():
                continue
            for f in sub.iterdir():
                found[sub.name + f.name.removesuffix(ZST)] = f.stat().st_size
        return found

    def hot_bytes(self) -> int:
        if self.hot is None or not self.hot.is_dir():
            return 0
        return sum(f.stat().st_size for f in self.hot.glob("??/*"))

    def collect(self, keep: set[str]) -> tuple[int, int]:
        """Delete every chunk not in `keep`, in both tiers, and leftovers of writers that
        died (call under exclusive()): (chunks, bytes) deleted from the cold tier."""
        count = freed = 0
        for cid, size in self.present().items():
            if cid not in keep:
                self.path(cid).unlink(missing_ok=True)
                self.path(cid).with_name(cid[2:] + ZST).unlink(missing_ok=True)
                count, freed = count + 1, freed + size
        if self.hot is not None and self.hot.is_dir():
            for f in self.hot.glob("??/*"):
                if f.parent.name + f.name not in keep:
                    f.unlink(missing_ok=True)
        shutil.rmtree(self.root / TMP_DIR, ignore_errors=True)
        return count, freed


def _unpack_into(fd: int, buf: memoryview, what: str) -> None:
    """A compressed chunk's content into buf, exactly its size."""
    import zstandard

    packed = b"".join(iter(lambda: os.read(fd, 1 << 20), b""))
    try:  # straight into buf: no buffer of its own to fault in and copy from
        with zstandard.ZstdDecompressor().stream_reader(packed) as reader:
            got = 0
            while got < len(buf) and (n := reader.readinto(buf[got:])):
                got += n
            longer = got == len(buf) and reader.read(1)
    except zstandard.ZstdError as exc:
        raise ImageCorrupt(f"{what} is corrupt: it does not decompress ({exc})") from None
    if got < len(buf):  # a frame cut short reads as fewer bytes, not as an error
        raise ImageCorrupt(f"{what} is corrupt: it does not decompress to the {len(buf)} bytes the image "
                           f"says (only {got})")
    if longer:
        raise ImageCorrupt(f"{what} is longer than the {len(buf)} bytes the image says")


def _fsync(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as exc:
        if exc.errno == errno.ENOENT:
            return
        raise
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
