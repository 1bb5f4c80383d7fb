"""An image's file contents: cut into chunks at a checkpoint, put back together at a
restore.

ingest() reads each file of a staged image once, in windows, cuts it (chunker.py),
hashes the chunks in parallel and stores those the store lacks; the manifest then lists
each file as its chunks.  ImageContent writes a file's content into any descriptor (a
tmpfs file CRIU reads, the staging memfd of a process's GPU memory), every chunk read in
parallel and checked against its name as it is read, so a restore needs no separate
verify pass and never uses a byte from a corrupt chunk.  Images of formats 1-4 (whole
files in the image directory) are read the same way, without the per-chunk check
(restore verifies them first, as before).
"""

from __future__ import annotations

import os
import stat
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from ..errors import GpuosError, ImageCorrupt
from ..manifest import CRIU_DIR, MANIFEST_NAME, Chunk, FileEntry, Manifest
from ..observe import Progress
from .chunks import ChunkStore, digest

WINDOW = 64 << 20         # bytes read at a time
IN_FLIGHT = 1 << 30       # bytes read but not yet stored, at most (about)
COPY_PIECE = 16 << 20     # formats 1-4: bytes copied per task


def workers() -> int:
    return min(16, (os.cpu_count() or 2) * 2)


@dataclass
class IngestStats:
    bytes: int = 0       # content read
    chunks: int = 0      # chunk references made
    new_bytes: int = 0   # bytes of chunks the store did not have
    new_chunks: int = 0


def _pread_full(fd: int, n: int, off: int) -> bytes:
    data = os.pread(fd, n, off)
    while len(data) < n:
        more = os.pread(fd, n - len(data), off + len(data))
        if not more:
            raise OSError(f"file shrank while it was read (at byte {off + len(data)})")
        data += more
    return data


class _Ingest:
    """One staged image into a chunk store."""

    def __init__(self, store: ChunkStore, pool: ThreadPoolExecutor, progress: Progress | None):
        self.store, self.pool, self.progress = store, pool, progress
        self.stats = IngestStats()
        self.new: list[str] = []
        self.pending: deque[tuple[Future, int]] = deque()  # (future, bytes) not yet stored
        self.pending_bytes = 0
        self.seen: set[str] = set()
        self.lock = threading.Lock()

    def _store(self, data: memoryview | bytes, compress: bool) -> tuple[Chunk, bool]:
        cid = digest(data)
        with self.lock:  # the same chunk twice in one image (zeros): written once
            first = cid not in self.seen
            self.seen.add(cid)
        fresh = first and self.store.put(cid, data, compress)
        if self.progress:
            self.progress(len(data))
        return Chunk(cid, len(data)), fresh

    def _submit(self, data: memoryview | bytes, compress: bool) -> Future:
        while self.pending and self.pending_bytes > IN_FLIGHT:
            fut, n = self.pending.popleft()
            fut.result()
            self.pending_bytes -= n
        fut = self.pool.submit(self._store, data, compress)
        self.pending.append((fut, len(data)))
        self.pending_bytes += len(data)
        return fut

    def file(self, path: Path, size: int, forced: list[int], fine: bool) -> list[Future]:
        """Submit the chunks of the file's first `size` bytes; their futures, in order.
        `forced`: offsets where a chunk must end; fine: the FINE profile."""
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            if os.fstat(fd).st_size < size:
                raise OSError(f"{path} has {os.fstat(fd).st_size} bytes, not {size}")
            cut = _Cut(self, size, forced, fine)
            for off in range(0, size, WINDOW):
                cut.feed(_pread_full(fd, min(WINDOW, size - off), off))
            return cut.finish()
        finally:
            os.close(fd)

    def chunks(self, futures: list[Future]) -> list[Chunk]:
        out = []
        for fut in futures:
            chunk, fresh = fut.result()
            out.append(chunk)
            self.stats.chunks += 1
            if fresh:
                self.stats.new_bytes += chunk.size
                self.stats.new_chunks += 1
                self.new.append(chunk.id)
        return out


class _Cut:
    """One file's content, fed in order (pieces of whole pages, but the last), cut into
    chunks submitted to the ingest: the same cuts however it is split into pieces."""

    def __init__(self, job: _Ingest, size: int, forced: list[int], fine: bool):
        from .chunker import COARSE, FINE, PAGE, Cutter  # numpy: a checkpoint needs it, a restore not

        self.job, self.size, self.page, self.fine = job, size, PAGE, fine
        self.whole = size // PAGE * PAGE
        self.bounds = sorted({f for f in forced if 0 < f < self.whole and f % PAGE == 0} | {self.whole})
        self.cutter = Cutter(FINE if fine else COARSE)
        self.bufs: list[tuple[int, bytes]] = []  # pieces fed, from where `done` is
        self.futures: list[Future] = []
        self.done = 0  # where the last chunk ended
        self.pos = 0   # bytes fed

    def _emit(self, end: int) -> None:
        parts = [memoryview(b)[max(self.done, o) - o:min(end, o + len(b)) - o]
                 for o, b in self.bufs if o < end and o + len(b) > self.done]
        self.futures.append(self.job._submit(parts[0] if len(parts) == 1 else b"".join(parts), self.fine))
        self.done = end
        self.bufs = [(o, b) for o, b in self.bufs if o + len(b) > self.done]

    def feed(self, data: bytes) -> None:
        start, end = self.pos, self.pos + len(data)
        if end > self.size or (start % self.page and start < self.whole):
            raise ValueError(f"bytes {start}-{end} do not follow whole pages within {self.size}")
        self.bufs.append((start, data))
        view, off = memoryview(data), start
        for bound in self.bounds:
            if bound <= off:
                continue
            stop = min(bound, end)
            if stop > off:
                for cut in self.cutter.feed(view[off - start:stop - start]):
                    self._emit(cut)
                off = stop
            if stop == bound and (cut := self.cutter.force()) is not None:
                self._emit(cut)
            if stop == end:
                break
        self.pos = end

    def finish(self) -> list[Future]:
        """The futures of every chunk, in order, once all `size` bytes were fed."""
        if self.pos != self.size:
            raise ValueError(f"{self.pos} bytes fed of {self.size}")
        if self.size > self.whole:
            self._emit(self.size)
        self.job.stats.bytes += self.size
        return self.futures


@dataclass
class Source:
    """A file of the image: its path in the image, and where its content is now."""

    path: str       # relative to the image directory, '/'-separated
    source: Path    # the file holding the content (in the staging directory, or elsewhere)
    size: int       # its first `size` bytes are the content
    cuts: tuple[int, ...] = ()  # offsets where a chunk must end (a movable allocation's start)
    fine: bool = False  # a process's host memory: cut into smaller chunks (chunker.FINE), compressed


def staged_files(root: Path, skip: tuple[str, ...] = ()) -> list[Source]:
    """The files under a staging directory, but the manifest and `skip` dirs; CRIU's page
    images (host memory) cut fine."""
    return [Source(p.relative_to(root).as_posix(), p, p.stat().st_size,
                   fine=p.relative_to(root).as_posix().startswith(f"{CRIU_DIR}/pages-"))
            for p in sorted(root.rglob("*")) if p.is_file() and not p.is_symlink()
            and p.relative_to(root).as_posix() != MANIFEST_NAME
            and p.relative_to(root).parts[0] not in skip]


def ingest(files: list[Source], store: ChunkStore, progress: Progress | None = None
           ) -> tuple[list[FileEntry], IngestStats]:
    """Each file's content into the store: one FileEntry each, listing its chunks.  Every
    new chunk is durable when this returns.  Call under store.shared()."""
    with ThreadPoolExecutor(max_workers=workers()) as pool:
        job = _Ingest(store, pool, progress)
        submitted = [(f, job.file(f.source, f.size, list(f.cuts), f.fine)) for f in files]
        entries = []
        for f, futs in submitted:
            st = f.source.stat()
            entries.append(FileEntry(path=f.path, size=f.size, chunks=job.chunks(futs),
                                     mode=stat.S_IMODE(st.st_mode), uid=st.st_uid, gid=st.st_gid))
    store.sync_dirs(job.new)
    return sorted(entries, key=lambda e: e.path), job.stats


@dataclass(frozen=True)
class Piece:
    """A part of a file's content that is read as one: a chunk, or a range of an old file."""

    offset: int  # in the file
    size: int
    chunk: Chunk | None


class StreamIn:
    """A file's content pushed into the store in order as it is produced (the copier's
    pieces of GPU memory), never written as a file: feed() each piece, then close() for its
    FileEntry, every new chunk durable.  Call under store.shared()."""

    def __init__(self, store: ChunkStore, src: Source):
        self.src = src
        self.pool = ThreadPoolExecutor(max_workers=workers())
        self.job = _Ingest(store, self.pool, None)
        self.cut = _Cut(self.job, src.size, list(src.cuts), src.fine)

    def feed(self, data: bytes) -> None:
        self.cut.feed(data)

    def close(self) -> FileEntry:
        try:
            chunks = self.job.chunks(self.cut.finish())
        finally:
            self.pool.shutdown(wait=True, cancel_futures=True)
        self.job.store.sync_dirs(self.job.new)
        return FileEntry(path=self.src.path, size=self.src.size, chunks=chunks)

    def abort(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


class ImageContent:
    """Reads an image's files, whatever its format."""

    def __init__(self, image: Path, manifest: Manifest, hot_base: Path | None = None,
                 verify: bool = True):
        self.image, self.manifest, self.verify = image, manifest, verify
        self.chunks = (ChunkStore(image / manifest.chunk_dir, hot_base)
                       if manifest.chunked else None)

    def entry(self, rel: str) -> FileEntry:
        for f in self.manifest.files:
            if f.path == rel:
                return f
        raise ImageCorrupt(f"{self.image}: the manifest lists no file {rel}")

    def prefetch(self, paths: list[str], stop: threading.Event) -> None:
        """Ask the kernel to start reading these files' chunks from disk now, in this order
        (readahead in the background), so that a restore's later reads find them in memory;
        until `stop` is set (the restore has read them itself)."""
        if self.chunks is None:
            return
        by_path = {f.path: f for f in self.manifest.files}
        for p in paths:
            for c in by_path[p].chunks:
                if stop.is_set():
                    return
                self.chunks.prefetch([c])

    def pieces(self, entry: FileEntry) -> list[Piece]:
        """The file's content as pieces to read one by one (read_piece): its chunks, or
        (formats 1-4) pieces of COPY_PIECE bytes of the file."""
        if self.chunks is not None:
            out, off = [], 0
            for c in entry.chunks:
                out.append(Piece(off, c.size, c))
                off += c.size
            return out
        return [Piece(off, min(COPY_PIECE, entry.size - off), None) for off in range(0, entry.size, COPY_PIECE)]

    def read_piece(self, entry: FileEntry, piece: Piece, buf: memoryview) -> None:
        """A piece into buf (len(buf) == piece.size): a chunk checked against its name."""
        if piece.chunk is not None:
            self.chunks.read_into(piece.chunk, buf, self.verify, f"{entry.path} at byte {piece.offset}")
            return
        fd = os.open(self.image / entry.path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            got = 0
            while got < piece.size:
                n = os.preadv(fd, [buf[got:]], piece.offset + got)
                if n == 0:
                    raise ImageCorrupt(f"{self.image / entry.path} is shorter than its {entry.size} bytes")
                got += n
        finally:
            os.close(fd)

    def write_files(self, targets: list[tuple[FileEntry, int]], pool: ThreadPoolExecutor,
                    progress: Progress | None = None,
                    parts: dict[str, list[tuple[int, int]]] | None = None) -> None:
        """Each entry's content into its descriptor (from offset 0), every piece (chunk)
        a task of the pool; of a file in ``parts``, only the pieces that overlap its
        (offset, length) ranges."""
        tasks = []
        for entry, fd in targets:
            pieces = self.pieces(entry)
            if sum(p.size for p in pieces) != entry.size:
                raise ImageCorrupt(f"{self.image}: {entry.path}'s chunks add up to "
                                   f"{sum(p.size for p in pieces)} bytes, the manifest says {entry.size}")
            if parts is not None and entry.path in parts:
                wanted = parts[entry.path]
                pieces = [p for p in pieces if any(o < p.offset + p.size and p.offset < o + n for o, n in wanted)]
            tasks += [pool.submit(self._piece_to, entry, p, fd, progress) for p in pieces]
        for t in tasks:
            t.result()

    def _piece_to(self, entry: FileEntry, piece: Piece, fd: int, progress: Progress | None) -> None:
        buf = _scratch(piece.size)
        self.read_piece(entry, piece, buf)
        _pwrite_all(fd, buf, piece.offset)
        if progress:
            progress(piece.size)

    def materialize(self, prefixes: tuple[str, ...], dest: Path, progress: Progress | None = None,
                    parts: dict[str, list[tuple[int, int]]] | None = None) -> Path:
        """The image's files under the top directories `prefixes` (e.g. "criu") as files
        under dest (a chunked image), with their modes and owners; or (formats 1-4) the
        image's own directory, read in place.  The directory that holds them.  A file in
        ``parts`` gets only the chunks overlapping its (offset, length) ranges, at its full
        size (the rest a hole: e.g. pages CRIU restores lazily, or later with fill())."""
        if self.chunks is None:
            return self.image
        entries = [f for f in self.manifest.files if f.path.split("/", 1)[0] in prefixes]
        fds = []
        try:
            dest.mkdir(parents=True, exist_ok=True)
            for e in entries:
                path = dest / e.path
                path.parent.mkdir(parents=True, exist_ok=True)
                # not fallocated: on tmpfs that halves the rate (1 GiB: 0.31 s written as it
                # comes, 0.67 s allocated first); no room shows as ENOSPC on a write
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
                fds.append(fd)
                if e.uid >= 0 and os.geteuid() == 0:
                    os.fchown(fd, e.uid, e.gid)
                if e.mode >= 0:
                    os.fchmod(fd, e.mode)
                if parts is not None and e.path in parts:
                    os.ftruncate(fd, e.size)
            with ThreadPoolExecutor(max_workers=workers()) as pool:
                self.write_files(list(zip(entries, fds)), pool, progress, parts)
        except OSError as exc:
            raise GpuosError(f"reading {self.image}'s files out into {dest}: {exc.strerror or exc}") from None
        finally:
            for fd in fds:
                os.close(fd)
        return dest

    def fill(self, dest: Path, parts: dict[str, list[tuple[int, int]]], progress: Progress | None = None) -> None:
        """Into files materialize() left partly holes: the chunks overlapping these ranges."""
        fds = []
        try:
            targets = []
            for rel in parts:
                fds.append(os.open(dest / rel, os.O_WRONLY | os.O_CLOEXEC))
                targets.append((self.entry(rel), fds[-1]))
            with ThreadPoolExecutor(max_workers=workers()) as pool:
                self.write_files(targets, pool, progress, parts)
        except OSError as exc:
            raise GpuosError(f"reading {self.image}'s files out into {dest}: {exc.strerror or exc}") from None
        finally:
            for fd in fds:
                os.close(fd)

    def check_all(self, progress: Progress | None = None) -> list[str]:
        """Chunked image: every chunk read and checked; the problems (empty: all good)."""
        problems: list[str] = []
        seen: dict[str, str] = {}
        for f in self.manifest.files:
            off = 0
            for c in f.chunks:
                seen.setdefault(c.id, f"{f.path} at byte {off}")
                off += c.size
            if off != f.size:
                problems.append(f"{f.path}: its chunks add up to {off} bytes, the manifest says {f.size}")
        sizes = self.manifest.chunk_set()

        def one(cid: str) -> str | None:
            buf = memoryview(bytearray(sizes[cid]))
            try:
                self.chunks.read_into(Chunk(cid, sizes[cid]), buf, True, seen[cid])
            except ImageCorrupt as exc:
                return exc.message
            finally:
                if progress:
                    progress(sizes[cid])
            return None

        with ThreadPoolExecutor(max_workers=workers()) as pool:
            problems += [p for p in pool.map(one, sorted(sizes)) if p]
        return problems


_SCRATCH = threading.local()


def _scratch(size: int) -> memoryview:
    """A buffer of this thread's, reused: a fresh one per chunk costs its pages' faults and
    zeroing every time (malloc maps buffers this big anew)."""
    buf = getattr(_SCRATCH, "buf", None)
    if buf is None or len(buf) < size:
        buf = _SCRATCH.buf = bytearray(max(size, 4 << 20))
    return memoryview(buf)[:size]


def _pwrite_all(fd: int, buf: memoryview, off: int) -> None:
    while buf:
        n = os.pwrite(fd, buf, off)
        buf, off = buf[n:], off + n
