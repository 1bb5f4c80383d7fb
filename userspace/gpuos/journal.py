"""Journals of operations in flight, so that a killed gpuos loses nothing.

Every checkpoint and restore writes ``run/op-<id>.json`` before it touches a
process and rewrites it at each phase.  While it runs it holds an exclusive
``flock`` on ``run/op-<id>.lock``; a journal whose lock can be taken belongs to
a gpuos that died.  ``recover()`` (run by every gpuos command that changes
anything, and by ``gpuos recover``) finishes or undoes such an operation:

* a process left locked or checkpointed on the GPU is restored and unlocked;
* a checkpoint whose CRIU dump completed is checksummed and published (the
  dumped process is gone, so the image is all that is left of it);
* any other staging directory is deleted; the previous image is untouched.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import time
import uuid
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from . import procs
from .movable import handout
from .criu import dump_completed
from .cudadrv import GpuDriver
from .errors import Busy, GpuosError, NoSuchProcess
from .hold import resume_gpu
from .manifest import CRIU_DIR, FORMAT_VERSION, MANIFEST_NAME, FileEntry, Manifest, MovableMemory
from .store import STAGING_MARK, ChunkStore, ImageStore
from .store.content import ingest, staged_files
from .store.images import OWN_CHUNKS

# Tests set this to a phase name: gpuos then writes GPUOS_TEST_HOLD_FILE and
# waits there, so a test can SIGKILL it at a known point of an operation.
HOLD_ENV, HOLD_FILE_ENV = "GPUOS_TEST_HOLD_AT", "GPUOS_TEST_HOLD_FILE"


@dataclass
class JournalRecord:
    op_id: str
    kind: str  # "checkpoint" | "restore"
    owner_pid: int
    started: float
    phase: str = "prepare"
    gpu_pids: list[int] = field(default_factory=list)
    staging: str | None = None  # checkpoint: the image being built; restore: its files read out
    final: str | None = None  # checkpoint: where it will be published
    draft: dict | None = None  # checkpoint: the manifest, less files and timings
    gpu_pairs: dict = field(default_factory=dict)  # restore: image GPU -> GPU here
    # checkpoint: movable memory handed out (movable/handout.py): per process its staging
    # file and, once captured, the manifest entry (MovableMemory as a dict)
    movable: list[dict] = field(default_factory=list)
    # restore: the processes CRIU brought back, [pid, starttime] (a restore that dies before
    # they are whole leaves them waiting for memory only it had: recovery ends them)
    restored: list[list[int]] = field(default_factory=list)
    replica_inits: list[list[int]] = field(default_factory=list)  # [pid 1 of each replica, start time]
    lazy_helpers: list[list[int]] = field(default_factory=list)  # [page server / criu lazy-pages, start time]


class Operation:
    """One checkpoint or restore: its journal, its lock, and its phase timings."""

    def __init__(self, run_dir: Path, kind: str):
        run_dir.mkdir(parents=True, exist_ok=True)
        self.run_dir = run_dir
        self.record = JournalRecord(op_id=uuid.uuid4().hex[:12], kind=kind,
                                    owner_pid=os.getpid(), started=time.time())
        self.timings: dict[str, float] = {}
        self._lock_fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
        self.save()

    @property
    def op_id(self) -> str:
        return self.record.op_id

    @property
    def journal_path(self) -> Path:
        return self.run_dir / f"op-{self.op_id}.json"

    @property
    def lock_path(self) -> Path:
        return self.run_dir / f"op-{self.op_id}.lock"

    def save(self) -> None:
        """Replace the journal whole (written beside, renamed over it): a gpuos killed at
        any point leaves the old record or the new one.  Not fsynced: what it describes
        (processes, their locks and stops) does not outlive the machine, and an fsync waits
        behind the disk's queue; a cold restore's readahead made each one take seconds."""
        tmp = self.journal_path.with_suffix(".tmp")
        with open(tmp, "w") as f:
            json.dump(asdict(self.record), f)
        os.rename(tmp, self.journal_path)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t0 = time.monotonic()
        self.record.phase = name
        self.save()
        if os.environ.get(HOLD_ENV) == name:
            Path(os.environ[HOLD_FILE_ENV]).write_text(f"{os.getpid()} {name}\n")
            while True:
                time.sleep(3600)
        try:
            yield
        finally:
            self.timings[name] = self.timings.get(name, 0.0) + time.monotonic() - t0

    def finish(self) -> None:
        self.journal_path.unlink(missing_ok=True)
        self.lock_path.unlink(missing_ok=True)
        os.close(self._lock_fd)


@contextmanager
def pid_lock(run_dir: Path, pid: int) -> Iterator[None]:
    """Only one gpuos operation at a time on a process."""
    run_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(run_dir / f"pid-{pid}.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise Busy(f"another gpuos operation is working on pid {pid}") from None
        yield
    finally:
        os.close(fd)


@dataclass
class RecoveryAction:
    op_id: str
    action: str  # human-readable, one line
    ok: bool


def _orphaned(run_dir: Path) -> Iterator[tuple[Path, int]]:
    """Journals whose owner died, each with its lock held by us."""
    for jpath in sorted(run_dir.glob("op-*.json")):
        fd = os.open(jpath.with_suffix(".lock"), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        yield jpath, fd


def put_back(driver: GpuDriver, pid: int, pairs: dict[str, str] | None = None) -> str:
    """Restore and unlock a process left stopped on the GPU; say what was done."""
    if not procs.alive(pid):
        return f"pid {pid} is gone"
    return resume_gpu(driver, pid, pairs or {})


_NOT_IN_DRAFT = dict(files=[], timings={}, movable=[], chunk_dir="", format_version=0)


def _finish_image(rec: JournalRecord, store: ImageStore) -> str:
    staging = Path(rec.staging) if rec.staging else None
    if staging is None or not staging.is_dir():
        return "no staged image"
    final = Path(rec.final)
    if rec.draft is None:
        shutil.rmtree(staging)
        return f"deleted incomplete image {staging}"
    draft = dict(rec.draft, **_NOT_IN_DRAFT)
    try:
        published = asdict(ImageStore.load(final))
        if dict(published, **_NOT_IN_DRAFT) == draft:
            shutil.rmtree(staging)  # killed after the exchange: staging holds the old image
            return f"finished publishing {final}"
    except GpuosError:
        pass
    if (staging / MANIFEST_NAME).is_file():  # chunks stored, manifest written: the rename is left
        ImageStore.drop_files(staging)
        ImageStore.publish(staging, final)
        return f"published image {final}: its chunks and manifest were written, the rename was left"
    if not dump_completed(staging / CRIU_DIR):
        shutil.rmtree(staging)
        return f"deleted incomplete image {staging}"
    if any("memory" not in m for m in rec.movable):  # a snapshot was never captured
        shutil.rmtree(staging)
        return f"deleted image {staging}: the GPU memory of a process was not captured"
    manifest = Manifest.from_json(json.dumps(dict(draft, format_version=FORMAT_VERSION)))
    manifest.chunk_dir = store.chunk_dir_for(final)
    sources = {f.path: f for f in staged_files(staging, skip=(OWN_CHUNKS,))}
    stored: list[FileEntry] = []  # what the copier had put into the chunk store
    for m in rec.movable:  # the dump completed: the captured GPU memory belongs in the image
        mem = MovableMemory.from_dict(m["memory"])
        if m.get("stored"):
            stored.append(FileEntry.from_dict(m["stored"]))
        elif Path(m["staging"]).exists():
            sources[mem.file] = handout.staged_source(Path(m["staging"]), mem)
        else:
            shutil.rmtree(staging)
            return f"deleted image {staging}: the GPU memory of pid {mem.pid} was not kept"
        manifest.movable.append(mem)
    chunks = ChunkStore(staging / manifest.chunk_dir)
    with chunks.shared():
        missing = [c.id for f in stored for c in f.chunks if not chunks.path(c.id).exists()]
        if missing:  # collected since (a gc that ran before this recovery)
            shutil.rmtree(staging)
            return f"deleted image {staging}: {len(missing)} chunks of its GPU memory are gone"
        ingested, _ = ingest(list(sources.values()), chunks)
        manifest.files = sorted(ingested + stored, key=lambda f: f.path)
        manifest.timings = {"recovered": 1.0}
        ImageStore.write_manifest(staging, manifest)
        ImageStore.drop_files(staging)
        ImageStore.publish(staging, final)
    return f"published image {rec.final} from a dump that had completed"


def _end_restored(restored: list[list[int]]) -> str:
    """A restore killed while it filled its processes' movable memory: what was not in yet
    existed only in that gpuos, so they would wait for ever; they are killed (the image
    is intact: restore it again)."""
    killed = [str(pid) for pid, start in restored if _kill_if_same(pid, start)]
    return (f"killed pids {', '.join(killed) or '(none left)'}, restored by a gpuos that died "
            "before their GPU memory was back; the image is intact")


def _end_lazy_helpers(helpers: list[list[int]]) -> str:
    ended = [str(pid) for pid, start in helpers if _kill_if_same(pid, start)]
    return f"ended the lazy-pages helpers {', '.join(ended) or '(none left)'} of a restore that never ran"


def _end_replicas(inits: list[list[int]]) -> str:
    """A restore of replicas whose gpuos died: every replica it had started ends (killing a
    replica's pid 1 ends everything in its namespace)."""
    killed = [str(pid) for pid, start in inits if _kill_if_same(pid, start)]
    return (f"ended the replicas of pid 1 {', '.join(killed) or '(none left)'}, restored by a gpuos "
            "that died before all were back; the image is intact")


def _kill_if_same(pid: int, start: int) -> bool:
    """SIGKILL pid if it is still the process that started at `start` (never another
    process that got the pid since); whether it was."""
    try:
        if procs.stat(pid).starttime == start:
            os.kill(pid, signal.SIGKILL)
            return True
    except (NoSuchProcess, ProcessLookupError):
        pass
    return False


def recover(run_dir: Path, store: ImageStore,
            driver_factory: Callable[[], GpuDriver]) -> list[RecoveryAction]:
    """Finish or undo every operation whose gpuos died; see the module comment."""
    actions: list[RecoveryAction] = []
    driver: GpuDriver | None = None
    for jpath, fd in _orphaned(run_dir):
        try:
            if not jpath.exists():  # finished while we waited for its lock
                jpath.with_suffix(".lock").unlink(missing_ok=True)
                continue
            try:
                rec = JournalRecord(**json.loads(jpath.read_text()))
            except (OSError, ValueError, TypeError) as exc:
                actions.append(RecoveryAction(jpath.stem, f"unreadable journal {jpath}: {exc}", False))
                continue
            ok = True
            if rec.kind == "restore" and rec.lazy_helpers and rec.phase in ("read", "criu-restore"):
                # nothing runs on them yet (a later phase: they finish the restored processes' memory)
                actions.append(RecoveryAction(rec.op_id, _end_lazy_helpers(rec.lazy_helpers), True))
            if rec.kind == "restore" and rec.replica_inits:  # replicas: all or none
                actions.append(RecoveryAction(rec.op_id, _end_replicas(rec.replica_inits), True))
            for pid in rec.gpu_pids if not rec.replica_inits else []:
                try:
                    if driver is None:
                        driver = driver_factory()
                    msg = put_back(driver, pid, rec.gpu_pairs)
                except GpuosError as exc:
                    msg, ok = f"pid {pid}: {exc.message}", False
                actions.append(RecoveryAction(rec.op_id, msg, ok))
            if rec.kind == "restore" and rec.phase == "movable-fill" and not rec.replica_inits:
                actions.append(RecoveryAction(rec.op_id, _end_restored(rec.restored), True))
            if rec.kind == "restore":
                shutil.rmtree(run_dir / f"restore-{rec.op_id}", ignore_errors=True)
                if rec.staging:  # the image's files read out for CRIU
                    shutil.rmtree(rec.staging, ignore_errors=True)
            for m in rec.movable:  # before the image: the process may still need the staging file
                try:
                    msg = handout.recover(m["pid"], Path(m["staging"]), m.get("memory"), m.get("keeper", ""))
                except GpuosError as exc:
                    msg, ok = f"pid {m['pid']}: {exc.message}", False
                actions.append(RecoveryAction(rec.op_id, msg, ok))
            if rec.kind == "checkpoint":
                try:
                    actions.append(RecoveryAction(rec.op_id, _finish_image(rec, store), True))
                except (OSError, GpuosError) as exc:
                    ok = False
                    actions.append(RecoveryAction(rec.op_id, f"finishing {rec.staging}: {exc}", False))
            if ok:  # else keep the journal so a later run retries
                for m in rec.movable:
                    Path(m["staging"]).unlink(missing_ok=True)
                jpath.unlink(missing_ok=True)
                jpath.with_suffix(".lock").unlink(missing_ok=True)
        finally:
            os.close(fd)
    # Staging directories no journal speaks for (a crashed `images rm`, say).
    for staging in ImageStore.staging_dirs(store.root):
        op_id = staging.name.rsplit(STAGING_MARK, 1)[1]
        if not (run_dir / f"op-{op_id}.json").exists():  # checked now, not before the orphans
            shutil.rmtree(staging, ignore_errors=True)
            actions.append(RecoveryAction("-", f"deleted stale {staging}", True))
    return actions
