"""Stop-the-world checkpoint of a process tree: driver checkpoint API + CRIU.

Phases (each timed, each recorded in the operation's journal first):

    prepare         find the tree, its CUDA processes, their GPUs
    lock            cuCheckpointProcessLock on every CUDA process (with a timeout)
    gpu-checkpoint  cuCheckpointProcessCheckpoint: GPU memory moves into the process,
                    whose own threads are held still (hold.py) and then stopped
    criu-dump       criu dump of the whole tree into the staging directory
    gpu-restore     (--leave-running) cuCheckpointProcessRestore and Unlock, threads held
    store           every file cut into chunks, the new ones stored (store/content.py)
    publish         manifest written, the files dropped, staging renamed into place

Any failure before the dump completed puts every CUDA process back on its GPU
and leaves it running; the previous image of that name is never touched. With
--leave-running, a process that cannot be resumed on its GPU (after retries) is
left stopped and its image published: the image is then the way to continue it.
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import socket
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

from . import __version__, forked, links, procs
from .criu import DUMP_LOG, Criu
from .cudadrv import RUNNING, UNINITIALIZED, GpuDriver
from .errors import (CheckpointFailed, DriverUnsupported, GpuosError, NoSuchProcess, NotPermitted,
                     ProcessLeftStopped)
from .hold import checkpoint_gpu, resume_gpu
from .hostmem import trim
from .journal import Operation, put_back, pid_lock
from .movable import handout
from .manifest import CRIU_DIR, MANIFEST_NAME, GpuInfo, Manifest, ProcessInfo, TerminalInfo
from .observe import Observer, Silent
from .store import ImageStore
from .store.images import OWN_CHUNKS
from .store.content import ingest, staged_files


@dataclass
class CheckpointRequest:
    pid: int
    image: str | None = None  # name in the store, or a path; default "<comm>-<pid>"
    leave_running: bool = False
    lock_timeout_ms: int = 10_000
    resume_tries: int = 3  # --leave-running: attempts to resume a process on its GPU


@dataclass
class CheckpointResult:
    path: Path
    manifest: Manifest
    timings: dict[str, float]  # includes "publish", which the manifest cannot
    stall: float | None  # seconds the app could not use the GPU (leave-running only)


def default_name(comm: str, pid: int) -> str:
    return f"{re.sub(r'[^A-Za-z0-9._+-]', '_', comm) or 'proc'}-{pid}"


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _describe(pids: list[int], gpu_pids: list[int], driver: GpuDriver | None
              ) -> tuple[list[ProcessInfo], list[GpuInfo]]:
    usage: dict[int, list[tuple[str, int]]] = {}
    devices = driver.devices() if driver else []
    if driver:
        for gp in driver.processes():
            usage.setdefault(gp.pid, []).append((gp.uuid, gp.used_memory))
    infos = []
    for pid in pids:
        st = procs.stat(pid)
        used = usage.get(pid, [])
        infos.append(ProcessInfo(
            pid=pid, ppid=st.ppid, tids=procs.tids(pid), comm=st.comm, cmdline=procs.cmdline(pid),
            uses_gpu=pid in gpu_pids, gpu_memory=sum(m for _, m in used),
            gpu_uuids=sorted({u for u, _ in used})))
    per_gpu: dict[str, int] = {}
    for pid in gpu_pids:
        for uuid, mem in usage.get(pid, []):
            per_gpu[uuid] = per_gpu.get(uuid, 0) + mem
    if gpu_pids and not per_gpu:  # NVML saw none of them (no context yet): any GPU may do
        per_gpu = {d.uuid: 0 for d in devices}
    gpus = [GpuInfo(uuid=d.uuid, name=d.name, memory_total=d.memory_total,
                    memory_used_by_image=per_gpu[d.uuid]) for d in devices if d.uuid in per_gpu]
    return infos, gpus


def checkpoint(req: CheckpointRequest, run_dir: Path, store: ImageStore,
               driver_factory: Callable[[], GpuDriver], criu: Criu,
               observer: Observer = Silent()) -> CheckpointResult:
    t_prepare = time.monotonic()
    st = procs.check_target(req.pid)
    tree = procs.tree(req.pid)
    if os.getpid() in tree:
        raise NotPermitted(f"pid {req.pid}'s process tree contains gpuos itself")
    if len(procs.ns_pids(req.pid)) > 1:  # CRIU dumps a pid namespace only whole, with its init
        raise CheckpointFailed(
            f"pid {req.pid} runs in a pid namespace of its own (a replica of `gpuos restore --replicas`, "
            "or a container): gpuos checkpoints processes of its own pid namespace only; nothing was changed")
    driver, gpu_pids = _gpu_processes(tree, driver_factory)
    inherited = _inherited(tree, gpu_pids)
    criu_version = criu.check_version()
    final = store.resolve(req.image or default_name(st.comm, req.pid))
    if final.exists() and not (final / MANIFEST_NAME).is_file():
        raise GpuosError(f"{final} exists and is not a gpuos image; not replacing it")
    terminals = _terminals(tree, st)
    # CRIU refuses a tree whose session or terminal is outside it unless told they are
    # external (--shell-job): anything not started as its own session leader.
    external = st.session != req.pid or bool(st.tty_nr) or bool(terminals)
    options = ["--file-locks"] + (["--shell-job"] if external else [])

    with pid_lock(run_dir, req.pid):
        processes, gpus = _describe(tree, gpu_pids, driver)
        op = Operation(run_dir, "checkpoint")
        staging = store.staging_for(final, op.op_id)
        draft = Manifest(
            name=final.name, created=_now(), gpuos_version=__version__,
            hostname=socket.gethostname(), kernel=platform.release(), root_pid=req.pid,
            leave_running=req.leave_running, processes=processes, gpus=gpus,
            driver=driver.driver_info() if driver else None, criu_version=criu_version,
            criu_options=options, files=[], timings={}, terminals=terminals,
            chunk_dir=store.chunk_dir_for(final))
        op.record.gpu_pids, op.record.staging, op.record.final = gpu_pids, str(staging), str(final)
        op.record.draft = asdict(draft)
        op.timings["prepare"] = time.monotonic() - t_prepare

        def phase(name: str):
            observer.phase(name)
            return op.phase(name)

        (staging / CRIU_DIR).mkdir(parents=True)
        handouts: list[handout.Handout] = []
        movable = handout.movable_pids(gpu_pids)
        # --leave-running snapshots on the device in the stop and copies out after it; that
        # needs free device memory as large as what it copies, else the copy happens in
        # the stop, into a staging file registered beforehand.
        snapshot = req.leave_running and _room_for_snapshots(driver, processes, movable)
        if movable:
            with phase("movable-stage"):  # the process runs on meanwhile
                try:
                    for mp in movable:
                        uuids = next((p.gpu_uuids for p in processes if p.pid == mp), [])
                        handouts.append(handout.stage(mp, op.op_id, register=not snapshot,
                                                      gpu_uuid=uuids[0] if len(uuids) == 1 else None))
                        op.record.movable.append({"pid": mp, "staging": str(handouts[-1].staging),
                                                  "keeper": handouts[-1].keeper})
                        op.save()
                except GpuosError as exc:
                    raise _undo(op, driver, [], staging, exc, tree, handouts) from None
        stall_start = time.monotonic()
        try:
            if handouts:
                with phase("movable-hold"):
                    for h in handouts:
                        handout.hand_out(h, snapshot=snapshot)
                        if not h.snapshot:
                            _journal_capture(op, h)
            if gpu_pids:
                with phase("lock"):
                    maps_before = {gp: procs.mappings(gp) for gp in gpu_pids}
                    for gp in gpu_pids:
                        driver.lock(gp, req.lock_timeout_ms)
                with phase("gpu-checkpoint"):
                    for gp in gpu_pids:
                        checkpoint_gpu(driver, gp)
                    for p in processes:
                        if p.pid in maps_before:
                            p.driver_saved = driver_saved(maps_before[p.pid], procs.mappings(p.pid))
            if inherited:
                with phase("drop-inherited"):
                    for inh in inherited:
                        _drop(inh)
            with phase("criu-dump"):
                remap_dirs = links.candidate_dirs(tree)
                draft.deleted_dirs = sorted(map(str, remap_dirs))
                before = links.remaps_in(remap_dirs)
                criu.dump(req.pid, staging / CRIU_DIR, req.leave_running, options)
                links.keep(links.remaps_in(remap_dirs) - before, staging)
        except GpuosError as exc:
            raise _undo(op, driver, gpu_pids, staging, exc, tree, handouts) from None

        stall = None
        left_stopped: list[str] = []
        if req.leave_running and gpu_pids:
            with phase("gpu-restore"):
                for gp in gpu_pids:
                    failure = _resume(driver, gp, req.resume_tries)
                    if failure:
                        left_stopped.append(f"pid {gp}: {failure}")
            if handouts and not left_stopped:
                with phase("movable-give-back"):  # the same contents, at the same addresses
                    lost = []
                    for h in handouts:
                        try:
                            handout.give_back(h)
                        except handout.SnapshotLost as exc:
                            lost.append(exc.message)
                    if lost:  # the processes run on; nothing consistent is left to save
                        raise _abandon(op, handouts, staging, final, "; ".join(lost))
        if req.leave_running and not left_stopped:
            stall = time.monotonic() - stall_start
        chunks = store.chunks_of(staging, draft)
        with chunks.shared():  # no gc from the first chunk written until the image that uses it is published
            snapshots = [h for h in handouts if h.snapshot and not h.released]
            if snapshots:
                with phase("movable-capture"):  # the processes run again meanwhile
                    try:
                        for h in snapshots:
                            handout.capture_snapshot(h, staging, chunks)
                            _journal_capture(op, h)
                    except (GpuosError, OSError) as exc:
                        # The process runs on (or ended by itself): only the image is lost.
                        why = exc.message if isinstance(exc, GpuosError) else str(exc)
                        raise _abandon(op, handouts, staging, final,
                                       f"copying pid {h.pid}'s GPU memory after it resumed failed ({why})") from None
            with phase("trim"):  # zero pages need not be saved: they come back as zero pages
                trim.drop_zero_pages(staging / CRIU_DIR)
            sources = {f.path: f for f in staged_files(staging, skip=(OWN_CHUNKS,))}
            stored = []  # what the copier put into the store already
            for h in handouts:
                draft.movable.append(handout.memory_entry(h))
                if h.stored is not None:
                    stored.append(h.stored)
                else:
                    src = handout.source(h)
                    sources[src.path] = src
            with phase("store"):
                ingested, _ = ingest(list(sources.values()), chunks, observer.bytes_progress(
                    "store", sum(f.size for f in sources.values())))
                draft.files = sorted(ingested + stored, key=lambda f: f.path)
            for h in handouts:
                if not h.released or not req.leave_running:
                    handout.discard(h)  # else the staging file is the process's memory
            draft.timings = dict(op.timings)
            with phase("publish"):
                ImageStore.write_manifest(staging, draft)
                ImageStore.drop_files(staging)
                ImageStore.publish(staging, final)
        if left_stopped:  # the journal stays: `gpuos recover` tries to resume them again
            raise ProcessLeftStopped(
                f"image {final} is published, but {'; '.join(left_stopped)}, after "
                f"{req.resume_tries} tries; it is left stopped, unchanged since the image: "
                f"`gpuos recover` tries again, or `kill -KILL {' '.join(str(p.pid) for p in processes)}; "
                f"gpuos restore {final}` continues it from the image")
        op.finish()
        return CheckpointResult(path=final, manifest=draft, timings=dict(op.timings), stall=stall)


def driver_saved(before: list[procs.Mapping], after: list[procs.Mapping]) -> list[list[int]]:
    """The mappings the driver's checkpoint added or changed: where it put the GPU state
    its restore reads back (a lazy restore must bring those pages in first)."""
    had = {(m.start, m.end, m.perms, m.path) for m in before}
    return [[m.start, m.end] for m in after if (m.start, m.end, m.perms, m.path) not in had]


def _room_for_snapshots(driver: GpuDriver | None, processes: list[ProcessInfo], movable: list[int]) -> bool:
    """Is there free memory, on every GPU the movable processes use, for a copy of all
    their movable memory there (with a tenth to spare)?"""
    if not driver or not movable:
        return False
    free = {d.uuid: d.memory_free for d in driver.devices()}
    need: dict[str, int] = {}
    for p in processes:
        if p.pid in movable:
            for uuid in p.gpu_uuids or list(free)[:1]:
                need[uuid] = need.get(uuid, 0) + handout.movable_bytes(p.pid)
    # a tenth to spare, and 1 GiB for the context gpuos copies the snapshot out from
    return all(free.get(u, 0) >= n * 11 // 10 + (1 << 30) for u, n in need.items())


def _abandon(op: Operation, handouts: list[handout.Handout], staging: Path, final: Path,
             why: str) -> CheckpointFailed:
    """After the stop, the processes running: drop their handouts and the staging image;
    the error to raise."""
    for h in handouts:
        handout.discard(h)
    shutil.rmtree(staging, ignore_errors=True)
    op.finish()
    return CheckpointFailed(f"{why}; no image was published, {final} is as it was")


def _journal_capture(op: Operation, h: handout.Handout) -> None:
    """The capture is complete: recovery may now put it into the image (the chunks the
    copier stored, `stored`, or the staging file), or into the process."""
    entry = next(m for m in op.record.movable if m["pid"] == h.pid)
    entry["memory"] = asdict(handout.memory_entry(h))
    entry["stored"] = asdict(h.stored) if h.stored is not None else None
    op.save()


def _gpu_processes(tree: list[int], driver_factory: Callable[[], GpuDriver]
                   ) -> tuple[GpuDriver | None, list[int]]:
    """The processes of the tree with CUDA state, each checked to be running on the GPU.

    A process that maps libcuda but never initialized CUDA (the driver says so) is a CPU
    process: CRIU alone saves it."""
    mapped = [p for p in tree if procs.uses_cuda(p)]
    if not mapped:
        return None, []
    driver = driver_factory()
    gpu_pids = []
    for pid in mapped:
        state = driver.state(pid)
        if state == UNINITIALIZED:
            continue
        if state != RUNNING:
            raise CheckpointFailed(f"pid {pid} is {state} on the GPU, not running; "
                                   "is another checkpoint under way? (`gpuos recover` puts it back)")
        seen = unsupported_features(pid)
        if seen:
            # Refused before anything changes. Measured on H100, r580: the driver refuses to
            # checkpoint managed memory (after the lock); it checkpoints a process that
            # imported another's memory through IPC, then cannot restore it (INVALID_VALUE).
            raise DriverUnsupported(f"pid {pid} {' and '.join(seen)}, which this driver cannot "
                                    "checkpoint and restore; nothing was changed")
        if procs.stat(pid).state == "T":
            raise CheckpointFailed(f"pid {pid} is stopped (SIGSTOP); gpuos checkpoints running GPU "
                                   f"processes: `kill -CONT {pid}` first")
        gpu_pids.append(pid)
    return driver, gpu_pids


def _inherited(tree: list[int], gpu_pids: list[int]) -> list[forked.Inherited]:
    """What the tree's CPU processes inherited from a CUDA ancestor by fork and cannot use
    (read now, while the ancestors still have it)."""
    if not gpu_pids:
        return []
    parent = {p: procs.stat(p).ppid for p in tree}
    found = []
    for pid in tree:
        if pid in gpu_pids:
            continue
        ancestor = parent[pid]
        while ancestor in parent and ancestor not in gpu_pids:
            ancestor = parent[ancestor]
        if ancestor in gpu_pids:
            inh = forked.inherited(pid, ancestor)
            if inh:
                found.append(inh)
    return found


def _drop(inh: forked.Inherited) -> None:
    try:
        forked.drop(inh)
    except NoSuchProcess:
        pass  # exited meanwhile: nothing of it to dump


def _terminals(tree: list[int], root: procs.ProcStat) -> list[TerminalInfo]:
    found: dict[int, TerminalInfo] = {}
    shell_job = root.session not in tree  # the session's leader, a shell, stays outside
    for pid in tree:
        for path, rdev, dev in procs.terminals(pid):
            found.setdefault(rdev, TerminalInfo(path=path, rdev=rdev, dev=dev,
                                                session_outside=shell_job and rdev == root.tty_nr))
    return sorted(found.values(), key=lambda t: t.rdev)


def _resume(driver: GpuDriver, pid: int, tries: int) -> str | None:
    """Resume a dumped process on its GPU, retrying; the last error, or None once it runs."""
    error = None
    for attempt in range(tries):
        try:
            resume_gpu(driver, pid, {})
            return None
        except GpuosError as exc:
            error = exc.message
            time.sleep(0.5 * (attempt + 1))
    return f"could not be resumed on the GPU ({error})"


def _undo(op: Operation, driver: GpuDriver | None, gpu_pids: list[int], staging: Path,
          cause: GpuosError, tree: list[int], handouts: list[handout.Handout] = ()) -> GpuosError:
    """Put every CUDA process back on its GPU and its movable memory back in it, drop the
    staging image; the error to raise."""
    ended = [p for p in tree if procs.ending(p)]
    if ended:  # what failed is most likely only a consequence (its agent or driver gone)
        cause = CheckpointFailed(f"pid {', '.join(map(str, ended))} ended during the checkpoint "
                                 f"({cause.message}); no image was published")
    failed = []
    with op.phase("undo"):
        for gp in gpu_pids:
            try:
                if gp not in ended:
                    put_back(driver, gp)
            except GpuosError as exc:
                failed.append(f"pid {gp}: {exc.message}")
        for h in handouts:
            try:
                if h.pid not in ended:
                    handout.give_back(h)
                handout.discard(h)
            except GpuosError as exc:
                failed.append(f"pid {h.pid}: its GPU memory: {exc.message}")
    if failed:  # keep the journal: `gpuos recover` retries
        return ProcessLeftStopped(
            f"{cause.message}; then putting the process back failed ({'; '.join(failed)}); "
            "run `gpuos recover`")
    log = staging / CRIU_DIR / DUMP_LOG
    kept = ""
    if log.is_file():  # the one thing of the failed image worth keeping
        dest = op.run_dir / f"checkpoint-{op.op_id}-{DUMP_LOG}"
        try:  # moved, not copied: a checkpoint that failed on a full disk must still undo
            shutil.move(log, dest)
            kept = f" (log: {dest})"
        except OSError as exc:
            kept = f" (CRIU's log could not be kept: {exc.strerror})"
    shutil.rmtree(staging, ignore_errors=True)
    op.finish()
    # Specific errors (lock timeout, not permitted, ...) keep their exit code.
    if ended:
        return CheckpointFailed(f"{cause.message}{kept}")
    kind = CheckpointFailed if type(cause) is GpuosError else type(cause)
    return kind(f"{cause.message}; the process was left running{kept}")


MANAGED = "uses CUDA managed memory (cudaMallocManaged)"
IPC = "shares GPU memory with other processes (CUDA IPC)"


def unsupported_features(pid: int) -> list[str]:
    """What the driver cannot checkpoint and restore that /proc shows the process using
    (the driver itself would only say NOT_SUPPORTED, or worse). Measured on H100 (r580): a CUDA process maps
    /dev/nvidia-uvm once, and once more with managed memory; a process that exported
    memory through CUDA IPC, and each that imported it, maps /dev/shm/cuda.shm.*."""
    try:
        paths = [m.path for m in procs.mappings(pid)]
    except GpuosError:
        return []  # gone or not ours to read: nothing seen
    seen = []
    if paths.count("/dev/nvidia-uvm") > 1:
        seen.append(MANAGED)
    if any(p.startswith("/dev/shm/cuda.shm.") for p in paths):
        seen.append(IPC)
    return seen
