"""The fault journal: a bounded on-disk history of GPU fault events (and incidents).

JSON lines in a directory ($GPUOS_HOME/faults by default: config.Paths.faults):

    faults.jsonl      the newest records
    faults.jsonl.1    older ...
    faults.jsonl.N-1  the oldest (N = `files`, default 2)

Each record is one JSON object on one line, written with a single write(2) on an
O_APPEND descriptor and fsynced before append() returns.  Before a record would
make the current file larger than `max_bytes` (default 1 MiB) the files are rotated
(each renamed one number up, the oldest dropped), so the journal never holds more
than files x max_bytes bytes.  Appends from several processes (`gpuos faults
watch`, the MPS supervisor) are serialized by an flock on faults.lock.  Reading
skips lines that are not JSON objects (a record torn by a crash); an append after a
torn line starts on a new line.

Records: {"v": 1, "type": ..., "time": seconds since the epoch, ...}.  `gpuos faults
watch` writes {"type": "fault", **FaultEvent.to_json()} and {"type": "kmsg-gap", first,
last, count}; other writers add types of their own.  "v" is the record format's version
(FORMAT_VERSION, added by append()); read() skips records of a version it does not know
and counts them in `newer`.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from datetime import datetime
from pathlib import Path
from typing import Any

FORMAT_VERSION = 1
NAME = "faults.jsonl"
LOCK = "faults.lock"


class FaultJournal:
    def __init__(self, path: str | os.PathLike, max_bytes: int = 1 << 20, files: int = 2):
        if max_bytes < 256 or files < 1:
            raise ValueError("a fault journal needs max_bytes >= 256 and files >= 1")
        self.dir = Path(path)
        self.max_bytes, self.nfiles = max_bytes, files
        self.skipped = 0  # lines read() could not parse (torn records)
        self.newer = 0    # records read() skipped for their unknown format version

    @property
    def current(self) -> Path:
        return self.dir / NAME

    def files(self) -> list[Path]:
        """The journal's files, oldest first (those that exist)."""
        paths = [self.dir / f"{NAME}.{i}" for i in range(self.nfiles - 1, 0, -1)] + [self.current]
        return [p for p in paths if p.exists()]

    # -- writing
    def append(self, record: dict[str, Any]) -> dict[str, Any]:
        """Write one record (a JSON-able dict; "time" is added if missing); return it."""
        record = dict(record)
        record.setdefault("time", time.time())
        record.setdefault("v", FORMAT_VERSION)
        line = (json.dumps(record, sort_keys=True, separators=(",", ":"), default=str)
                + "\n").encode()
        if len(line) + 1 > self.max_bytes:
            raise ValueError(f"a journal record of {len(line)} bytes does not fit in "
                             f"{self.max_bytes}-byte files")
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        lock = os.open(self.dir / LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
            fd = self._open_current()
            try:
                size = os.fstat(fd).st_size
                prefix = b"" if size == 0 or os.pread(fd, 1, size - 1) == b"\n" else b"\n"
                if size > 0 and size + len(prefix) + len(line) > self.max_bytes:
                    os.close(fd)
                    fd = -1
                    self._rotate()
                    fd = self._open_current()
                    prefix = b""
                data = prefix + line
                if os.write(fd, data) != len(data):  # a regular file writes short only when full
                    raise OSError(f"short write to {self.current} (disk full?)")
                os.fsync(fd)
            finally:
                if fd >= 0:
                    os.close(fd)
        finally:
            os.close(lock)  # releases the flock
        return record

    def _open_current(self) -> int:
        existed = self.current.exists()
        fd = os.open(self.current, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        if not existed:
            self._sync_dir()
        return fd

    def _rotate(self) -> None:
        if self.nfiles == 1:
            os.unlink(self.current)
        else:
            for i in range(self.nfiles - 1, 0, -1):
                src = self.current if i == 1 else self.dir / f"{NAME}.{i - 1}"
                if src.exists():
                    os.replace(src, self.dir / f"{NAME}.{i}")
        self._sync_dir()

    def _sync_dir(self) -> None:
        fd = os.open(self.dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    # -- reading
    def read(self, since: float | datetime | None = None,
             limit: int | None = None) -> list[dict[str, Any]]:
        """Records oldest first: those at or after `since`, the last `limit` of them."""
        if isinstance(since, datetime):
            since = since.timestamp()
        self.skipped = self.newer = 0
        out: list[dict[str, Any]] = []
        lock = self._lock_shared()
        try:
            for path in self.files():
                try:
                    data = path.read_bytes()
                except FileNotFoundError:  # rotated away meanwhile (no lock: not ours to take)
                    continue
                for raw in data.split(b"\n"):
                    if not raw.strip():
                        continue
                    try:
                        rec = json.loads(raw)
                    except ValueError:
                        self.skipped += 1
                        continue
                    if not isinstance(rec, dict):
                        self.skipped += 1
                        continue
                    if rec.get("v", FORMAT_VERSION) != FORMAT_VERSION:
                        self.newer += 1
                        continue
                    t = rec.get("time")
                    if since is not None and not (isinstance(t, (int, float)) and t >= since):
                        continue
                    out.append(rec)
        finally:
            if lock is not None:
                os.close(lock)
        if limit is not None:
            out = out[-limit:] if limit > 0 else []
        return out

    def _lock_shared(self) -> int | None:
        try:
            fd = os.open(self.dir / LOCK, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return None  # no journal yet, or not ours to lock: read without it
        fcntl.flock(fd, fcntl.LOCK_SH)
        return fd
