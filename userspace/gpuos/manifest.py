"""The image manifest: what an image holds and where it came from.

Format documented in docs/image-format.md.  ``FORMAT_VERSION`` changes
whenever a reader of the previous version could misread a new image.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from .errors import ImageCorrupt, ImageFormatUnsupported

FORMAT = "gpuos-image"
FORMAT_VERSION = 5
# 1 had no `terminals`, 2 no `session_outside`, 3 no `movable`, 4 whole files (no chunks)
READABLE_VERSIONS = (1, 2, 3, 4, 5)
MANIFEST_NAME = "manifest.json"
CRIU_DIR = "criu"


@dataclass
class GpuInfo:
    """A GPU the checkpointed processes were using."""

    uuid: str
    name: str
    memory_total: int  # bytes
    memory_used_by_image: int  # bytes the image's processes held on it


@dataclass
class ProcessInfo:
    pid: int
    ppid: int
    tids: list[int]
    comm: str
    cmdline: list[str]
    uses_gpu: bool
    gpu_memory: int = 0  # bytes, as NVML reported before the checkpoint
    gpu_uuids: list[str] = field(default_factory=list)
    # A GPU process: the [start, end) address ranges the driver's checkpoint added to or
    # changed in its memory map (the GPU state it saved there, which its restore reads
    # back: restored before the process runs, never lazily). None: not recorded.
    driver_saved: list[list[int]] | None = None


@dataclass
class TerminalInfo:
    """A terminal a process of the image had open: CRIU saves it as external (--shell-job)
    and the restore must hand one in (criu --inherit-fd)."""

    path: str  # e.g. /dev/pts/3, as it was at the dump
    rdev: int  # the device number: CRIU's key, tty[rdev:dev]
    dev: int  # the device number of the file system holding the node (devpts)
    # The root's controlling terminal, whose session leader (a shell) is not in the image:
    # the processes were a job of that shell, and come back as a job of the shell that
    # runs `gpuos restore` on a terminal.
    session_outside: bool = False

    @property
    def criu_key(self) -> str:
        return f"tty[{self.rdev:x}:{self.dev:x}]"


@dataclass
class MovableRange:
    """One movable allocation (libgpuos/src/memory.c) of a process under `gpuos run`."""

    base: int      # its device address, the same after a restore
    size: int      # as the application asked
    reserved: int  # its address range and physical memory: size rounded up
    device: int
    # The seq of the last operation libgpuos recorded touching it before the checkpoint
    # (0: none): a restore streams allocations back in this order, the order the next
    # iteration needs them
    last_use: int = 0

    def same_place(self, other: "MovableRange") -> bool:
        return (self.base, self.size, self.reserved, self.device) == \
            (other.base, other.size, other.reserved, other.device)


@dataclass
class MovableMemory:
    """A process's movable device memory, saved by gpuos (not by the driver): the ranges'
    contents back to back, `reserved` bytes each, in `file`."""

    pid: int
    file: str  # relative to the image directory
    bytes: int
    ranges: list[MovableRange]

    def offsets(self) -> list[int]:
        """Where each range starts in the file, and (last) where the file ends."""
        out = [0]
        for r in self.ranges:
            out.append(out[-1] + r.reserved)
        return out

    @classmethod
    def from_dict(cls, d: dict) -> "MovableMemory":
        """From its JSON form (a manifest's or a journal's)."""
        return cls(**{**d, "ranges": [MovableRange(**r) for r in d["ranges"]]})


@dataclass(frozen=True)
class Chunk:
    """A piece of a file's content in the chunk store (store/chunks.py)."""

    id: str    # BLAKE3-256 of the content, hex: its name in the store
    size: int  # bytes


@dataclass
class FileEntry:
    path: str  # relative to the image directory, '/'-separated
    size: int
    # Format 5: the content is these chunks, in order (store/chunker.py cuts them); the
    # file itself is not in the image.
    chunks: list[Chunk] = field(default_factory=list)
    # Formats 1-4, whose files are in the image directory: files of up to one piece
    # (64 MiB) have the content's sha256; larger ones (format 4) the sha256 of their
    # pieces' digests concatenated, with those digests in `pieces`, hashed in parallel
    # (formats 1-3: the whole content's sha256, `pieces` empty).
    sha256: str = ""
    pieces: list[str] = field(default_factory=list)
    # Format 5: the file's permission bits and owner, given back when it is read out (a
    # link CRIU made, links.py, must come back as it was); -1: not recorded
    mode: int = -1
    uid: int = -1
    gid: int = -1

    @classmethod
    def from_dict(cls, d: dict) -> "FileEntry":
        return cls(**{**d, "chunks": [Chunk(**c) for c in d.get("chunks", [])]})


@dataclass
class DriverInfo:
    version: str  # e.g. "580.159.04"
    cuda_api: int  # cuDriverGetVersion, e.g. 13000


@dataclass
class Manifest:
    name: str
    created: str  # ISO 8601, UTC
    gpuos_version: str
    hostname: str
    kernel: str
    root_pid: int
    leave_running: bool
    processes: list[ProcessInfo]
    gpus: list[GpuInfo]
    driver: DriverInfo | None
    criu_version: str
    criu_options: list[str]  # given to criu dump, and again to criu restore
    files: list[FileEntry]
    timings: dict[str, float]  # phase -> seconds
    terminals: list[TerminalInfo] = field(default_factory=list)
    movable: list[MovableMemory] = field(default_factory=list)
    # Format 5: where the chunks are, relative to the image directory ("../.chunks" for an
    # image in a store, "chunks" for one outside: its own)
    chunk_dir: str = ""
    # Where the process held files that were deleted (links.py: a failed restore removes
    # the ghost files its CRIU left there); empty in images taken before this was recorded
    deleted_dirs: list[str] = field(default_factory=list)
    format: str = FORMAT
    format_version: int = FORMAT_VERSION

    @property
    def total_size(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def chunked(self) -> bool:
        """Format 5: the files' contents are chunks in chunk_dir, not files in the image."""
        return self.format_version >= 5

    def chunk_set(self) -> dict[str, int]:
        """Every chunk the image references, once: name -> bytes."""
        return {c.id: c.size for f in self.files for c in f.chunks}

    @property
    def gpu_pids(self) -> list[int]:
        return [p.pid for p in self.processes if p.uses_gpu]

    def all_ids(self) -> list[int]:
        """Every pid and tid CRIU will need free at restore."""
        ids: set[int] = set()
        for proc in self.processes:
            ids.add(proc.pid)
            ids.update(proc.tids)
        return sorted(ids)

    def to_json(self) -> str:
        data = asdict(self)
        data["total_size"] = self.total_size
        return json.dumps(data, indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str, where: str = "manifest") -> "Manifest":
        try:
            data: dict[str, Any] = json.loads(text)
        except ValueError as exc:
            raise ImageCorrupt(f"{where}: not valid JSON ({exc})") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ImageCorrupt(f"{where}: not a gpuos image manifest")
        version = data.get("format_version")
        if version not in READABLE_VERSIONS:
            raise ImageFormatUnsupported(
                f"{where}: image format version {version!r}; this gpuos reads versions "
                f"{', '.join(map(str, READABLE_VERSIONS))}")
        data.pop("total_size", None)
        try:
            driver = data.pop("driver")
            return cls(
                processes=[ProcessInfo(**p) for p in data.pop("processes")],
                gpus=[GpuInfo(**g) for g in data.pop("gpus")],
                files=[FileEntry.from_dict(f) for f in data.pop("files")],
                terminals=[TerminalInfo(**t) for t in data.pop("terminals", [])],
                movable=[MovableMemory.from_dict(m) for m in data.pop("movable", [])],
                driver=DriverInfo(**driver) if driver is not None else None,
                **data,
            )
        except (KeyError, TypeError) as exc:
            raise ImageCorrupt(f"{where}: malformed manifest ({exc})") from None
