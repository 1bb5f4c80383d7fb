"""Restore an image: checks first, then criu restore, then the GPU state.

Phases: checks (GPU model and memory, driver version, pids free, terminals), read (what
CRIU cannot stream: files known by another name; for replicas and lazy host memory, the
image's CRIU files out of the chunk store into a tmpfs directory, every chunk checked as
it is read; an image of format 1-4 is verified whole first instead, and read in place),
criu-restore (CRIU's files streamed to it from the chunks, store/streamer.py, each chunk
checked; every task left stopped), gpu-restore (restore and unlock each CUDA process with
only the driver's restore thread running, hold.py), movable-fill (a process under `gpuos
run` gets its movable memory back from the image, movable/filler.py: on demand, it goes
on at once and each launch waits only for what it touches; eager, it goes on once all is
in), then every process continues; host-fill (lazy host memory: until every page is in).
The store is locked shared throughout (no gc).  A failure after criu restored the tree
kills what was restored: the host is left as before and the image is untouched.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from . import links, procs
from .criu import RESTORE_LOG, Criu, restore_gaps, restore_marks, stamped_lines
from .cudadrv import GpuDevice, GpuDriver
from .errors import (GpuMismatch, GpuosError, ImageCorrupt, InsufficientGpuMemory, NoSuchProcess, PidTaken,
                     RestoreFailed)
from .hold import resume_gpu
from .journal import Operation
from .manifest import CRIU_DIR, GpuInfo, Manifest, MovableMemory
from .movable import filler
from .movable.prefill import Prefill, room_beside
from .observe import Observer, Silent
from .replicas import Placement, restore_one
from .hostmem import lazy
from .store import ImageStore
from .store.streamer import ImageStreamer
from .store.decoders import Decoders
from .store.content import ImageContent, workers


MAX_REPLICAS = 256
PAGES_IMAGE = re.compile(rf"{CRIU_DIR}/pages-\d+\.img")


@dataclass
class RestoreResult:
    pid: int  # our pid of the restored root (the first replica's)
    manifest: Manifest
    timings: dict[str, float]
    gpu_map: dict[str, str]  # image GPU UUID -> GPU restored onto
    fills: dict[int, filler.FillStats]  # per process with movable memory, by our pid
    placements: list[Placement]  # one per copy: where the image's pids landed
    host_memory: dict  # {"on_demand": bool, "why_not": reason it was not, "served": page server's counts}
    criu_marks: dict[str, float] = field(default_factory=dict)  # criu.restore_marks (one restore, not replicas)
    criu_gaps: list[dict] = field(default_factory=list)  # criu.restore_gaps (one restore, not replicas)
    decoders: dict | None = None  # {workers, chunks}: CRIU's files' chunks decoded by store/decoders.py


def _device(spec: str, devices: list[GpuDevice]) -> GpuDevice:
    for d in devices:
        if spec == d.uuid or (spec.isdigit() and int(spec) == d.index):
            return d
    have = ", ".join(f"{d.index} ({d.uuid})" for d in devices) or "none"
    raise GpuMismatch(f"no GPU {spec} here; GPUs: {have}")


def resolve_onto(specs: list[str], wanted: list[GpuInfo], devices: list[GpuDevice]
                 ) -> dict[str, str]:
    """``--gpu`` choices to {image GPU uuid: GPU uuid here}. A spec is ``N|UUID`` (the
    image's only GPU goes there) or ``OLD=N|UUID`` (OLD: the image's GPU uuid)."""
    onto: dict[str, str] = {}
    for spec in specs:
        old, sep, new = spec.rpartition("=")
        if not sep:
            if len(wanted) != 1:
                raise GpuMismatch(f"the image used {len(wanted)} GPUs: say which goes where "
                                  "(--gpu OLD_UUID=N, once per GPU)")
            old = wanted[0].uuid
        if old not in {g.uuid for g in wanted}:
            raise GpuMismatch(f"the image used no GPU {old}; it used "
                              f"{', '.join(g.uuid for g in wanted) or 'none'}")
        if old in onto:
            raise GpuMismatch(f"--gpu names the image's GPU {old} twice")
        onto[old] = _device(new, devices).uuid
    if len(set(onto.values())) != len(onto):
        raise GpuMismatch("--gpu puts two of the image's GPUs on one GPU")
    return onto


def plan_gpus(wanted: list[GpuInfo], devices: list[GpuDevice],
              onto: dict[str, str] | None = None, copies: int = 1) -> dict[str, str]:
    """Map each of the image's GPUs to one here: the one ``onto`` names, else the same UUID
    if present, else a free GPU of the same model with room for what the image held
    (``copies`` times: replicas share their GPUs)."""
    mapping: dict[str, str] = {}
    by_uuid = {d.uuid: d for d in devices}
    onto = onto or {}
    taken: set[str] = set(onto.values())
    for g in wanted:
        here = by_uuid.get(onto.get(g.uuid, g.uuid))
        if here is None or (g.uuid not in onto and here.uuid in taken):
            same = [d for d in devices if d.name == g.name and d.uuid not in taken
                    and d.uuid not in {w.uuid for w in wanted}]
            here = next((d for d in same if d.memory_free >= g.memory_used_by_image * copies),
                        same[0] if same else None)
        if here is None:
            have = ", ".join(sorted({d.name for d in devices})) or "none"
            raise GpuMismatch(f"the image needs a {g.name} (was {g.uuid}); GPUs here: {have}")
        if here.name != g.name:
            raise GpuMismatch(f"GPU {g.uuid} is now a {here.name}, the image was made on a {g.name}")
        if here.memory_free < g.memory_used_by_image * copies:
            raise InsufficientGpuMemory(
                f"{here.name} {here.uuid} has {here.memory_free >> 20} MiB free; "
                f"the image needs {g.memory_used_by_image >> 20} MiB"
                + (f", {copies} replicas {g.memory_used_by_image * copies >> 20} MiB" if copies > 1 else ""))
        taken.add(here.uuid)
        mapping[g.uuid] = here.uuid
    return mapping


def restore_pairs(gpu_map: dict[str, str], devices: list[GpuDevice]) -> dict[str, str]:
    """The driver's gpuPairs for ``gpu_map``: none when nothing moves. The driver wants a
    pair for every GPU it checkpointed (INVALID_VALUE otherwise, measured on 2 H100s: a
    process using GPU 0 of two had both checkpointed), so on the host where the image was
    made the move is completed into a permutation of the GPUs of each model here."""
    if all(o == n for o, n in gpu_map.items()):
        return {}
    here = {d.uuid: d for d in devices}
    if not all(o in here for o in gpu_map):
        return dict(gpu_map)  # another host: its GPUs are the image's only
    pairs = dict(gpu_map)
    for d in devices:
        if d.uuid not in pairs:
            spare = next((e.uuid for e in devices if e.name == d.name
                          and e.uuid not in pairs.values()), None)
            if spare:
                pairs[d.uuid] = spare
    return pairs


def check_pids_free(manifest: Manifest) -> None:
    for pid in manifest.all_ids():
        try:
            st = procs.stat(pid)
        except NoSuchProcess:
            continue
        what = f"a zombie not yet reaped by pid {st.ppid}" if st.state == "Z" else f"{st.comm!r}"
        raise PidTaken(f"pid {pid}, which the image's processes need, is taken by {what}")


def job_terminal(manifest: Manifest, tty: str | None) -> int | None:
    """For an image of a shell's job on a terminal: our controlling terminal, open, which
    criu restores the job onto (criu's shell-job restore: the job joins the terminal's
    session, so it must be run inside it); None for any other image."""
    job = next((t for t in manifest.terminals if t.session_outside), None)
    if job is None:
        return None
    where = (f"the image is a job of a shell on {job.path}: run `gpuos restore` from a terminal, "
             "where it comes back as a job of that terminal's shell")
    ours = procs.stat(os.getpid()).tty_nr  # our controlling terminal's device number
    if not ours:
        raise RestoreFailed(f"{where}; this gpuos has no terminal; nothing was restored")
    path = tty or job.path
    try:
        same = os.stat(path).st_rdev == ours
    except OSError:
        same = False
    if not same:
        raise RestoreFailed(
            f"{where}; this is another terminal than {path} (--tty $(tty) restores it on this "
            "one); nothing was restored")
    return os.open(path, os.O_RDWR | os.O_NOCTTY)


def open_terminals(manifest: Manifest, tty: str | None) -> dict[str, int]:
    """An open fd for each terminal the image's processes had (but a job's terminal, see
    job_terminal): the same terminal if it is still there, else ``tty`` (any terminal the
    user names). CRIU's key -> fd."""
    fds: dict[str, int] = {}
    try:
        for t in manifest.terminals:
            if t.session_outside:
                continue
            path = tty or t.path
            try:
                st = os.stat(path)
            except OSError:
                st = None
            if tty is None and (st is None or st.st_rdev != t.rdev):
                raise RestoreFailed(
                    f"the image's processes had terminal {t.path} open, which is gone or is now "
                    "another terminal; name one for them with --tty PATH (e.g. --tty $(tty)); "
                    "nothing was restored")
            if st is None or os.major(st.st_rdev) not in procs.TTY_MAJORS:
                raise RestoreFailed(f"--tty {path}: not a terminal; nothing was restored")
            fds[t.criu_key] = os.open(path, os.O_RDWR | os.O_NOCTTY)
    except BaseException:
        for fd in fds.values():
            os.close(fd)
        raise
    return fds


def read_dir(store: ImageStore, run_dir: Path, op_id: str, size: int) -> Path:
    """Where the image's CRIU files go for CRIU to read: gpuos's memory directory (tmpfs,
    $GPUOS_HOT) if it has room for them and a quarter more, else the run directory."""
    if store.hot_base is not None:
        try:
            store.hot_base.mkdir(parents=True, exist_ok=True)
            st = os.statvfs(store.hot_base)
            if st.f_bavail * st.f_frsize > size * 5 // 4:
                return store.hot_base / f"restore-{op_id}"
        except OSError:
            pass
    return run_dir / f"restore-{op_id}" / "images"


def restore(image_ref: str, run_dir: Path, store: ImageStore,
            driver_factory: Callable[[], GpuDriver], criu: Criu, verify: bool = True,
            observer: Observer = Silent(), tty: str | None = None,
            gpus: list[str] | None = None, on_demand: bool = True,
            replicas: int | None = None, lazy_host: bool = False, prefill: bool = True) -> RestoreResult:
    """on_demand: a process under `gpuos run` goes on as soon as its context is back, its
    movable memory streamed in behind it; else (eager) once all of it is back.  replicas:
    that many copies, each in namespaces of its own (replicas.py), all or none; None: one
    copy in ours, with the image's own pids.  lazy_host: host memory on demand too (CRIU's
    lazy pages, hostmem/), where it can be; else (or where not) restored before it runs.
    prefill: movable memory filled on the GPU by gpuos while CRIU restores, where there is
    room (movable/prefill.py); else all of it streamed through the process's agent."""
    if replicas is not None and not 1 <= replicas <= MAX_REPLICAS:
        raise RestoreFailed(f"--replicas {replicas}: between 1 and {MAX_REPLICAS}")
    t_open = time.monotonic()
    image = store.resolve(image_ref)
    manifest = store.load(image)
    with ExitStack() as held:
        content = store.content(image, manifest, verify)
        if content.chunks is not None:
            held.enter_context(content.chunks.shared())  # no gc while its chunks are read
            # From a cold store: the disk reads the whole image while the checks run, CRIU
            # restores and the driver restores (a cold restore waited on the disk twice).
            order = sorted((f.path for f in manifest.files), key=lambda p: p.split("/", 1)[0] != CRIU_DIR)
            done = threading.Event()
            ahead = threading.Thread(target=content.prefetch, args=(order, done), daemon=True)
            ahead.start()
            held.callback(ahead.join)  # a readahead of what the restore has read already stops
            held.callback(done.set)
        decoders = None
        if content.chunks is not None and replicas is None and not lazy_host:  # CRIU's files will stream:
            try:  # decoded in processes, started now (0.1 s) to be up when CRIU asks
                decoders = Decoders(content.chunks.root, store.hot_base)
                held.callback(decoders.close)
            except GpuosError:
                pass  # in our own threads, slower
        res = _restore(image, manifest, content, run_dir, store, driver_factory, criu, verify,
                       observer, tty, gpus, on_demand, replicas, lazy_host, prefill, held,
                       time.monotonic() - t_open, decoders)
        if decoders is not None:
            res.decoders = {"workers": len(decoders.procs), "chunks": decoders.answered}
        return res


def _restore(image, manifest, content, run_dir, store, driver_factory, criu, verify, observer,
             tty, gpus, on_demand, replicas, lazy_host, prefill, held, open_s,
             decoders: Decoders | None) -> RestoreResult:
    timings: dict[str, float] = {"open": open_s}  # the manifest read, the store locked
    t0 = time.monotonic()
    if verify and not manifest.chunked:  # older formats: the whole image first
        observer.phase("verify")
        store.verify(image, manifest, observer.bytes_progress("verify", manifest.total_size))
        timings["verify"] = time.monotonic() - t0

    t0 = time.monotonic()
    gpu_pids = manifest.gpu_pids
    driver = driver_factory() if gpu_pids else None
    gpu_map: dict[str, str] = {}
    devices: list[GpuDevice] = []
    if driver:
        here = driver.driver_info()
        if manifest.driver and here.version != manifest.driver.version:
            raise GpuMismatch(f"the image was made with driver {manifest.driver.version}; "
                              f"this host runs {here.version}")
        devices = driver.devices()
        gpu_map = plan_gpus(manifest.gpus, devices, resolve_onto(gpus or [], manifest.gpus, devices),
                            copies=replicas or 1)
    if replicas is None:
        check_pids_free(manifest)
    elif manifest.terminals:
        raise RestoreFailed(f"the image's processes had terminal {manifest.terminals[0].path}; replicas "
                            "run detached, in namespaces of their own: restore it without --replicas")
    criu.check_version()
    host = {"on_demand": False, "why_not": None}
    if lazy_host:
        host["why_not"] = ("replicas get their host memory before they run" if replicas is not None
                           else "an image of format 4 or older" if not manifest.chunked
                           else lazy.unsupported(criu))
        host["on_demand"] = host["why_not"] is None
    timings["checks"] = time.monotonic() - t0

    criu_has_pages = threading.Event()  # the prefills read once CRIU no longer does
    prefills = {mem.pid: _prefill(mem, manifest, content, gpu_map, replicas or 1, criu_has_pages, held)
                for mem in manifest.movable} if prefill else {}
    op = Operation(run_dir, "restore")
    op.record.gpu_pids = gpu_pids
    pairs = restore_pairs(gpu_map, devices)
    op.record.gpu_pairs = pairs
    op.timings.update(timings)
    workdir = run_dir / f"restore-{op.op_id}"
    read_out = (CRIU_DIR, links.LINKS_DIR)
    criu_bytes = sum(f.size for f in manifest.files if f.path.split("/", 1)[0] in read_out)
    out = read_dir(store, run_dir, op.op_id, criu_bytes) if manifest.chunked else None
    op.record.staging = str(out) if out else None
    # One restore: CRIU's files stream to it from the chunks, checked as they go (on the H200:
    # GPT-2-large's read-out and restore 1.7 -> 1.1 s). Replicas share one read-out instead
    # (four CRIUs streaming at once took 3.4 s); lazy host memory needs the pagemaps out.
    stream = manifest.chunked and replicas is None and not host["on_demand"]

    def phase(name: str):
        observer.phase(name)
        return op.phase(name)

    def cleanup() -> None:
        if out is not None:
            shutil.rmtree(out, ignore_errors=True)

    try:
        with phase("read"):
            if host["on_demand"]:  # CRIU's pages images: only where CRIU reads them itself
                holes = {f.path: [] for f in manifest.files if PAGES_IMAGE.fullmatch(f.path)}
                base = content.materialize(read_out, out, observer.bytes_progress("read", criu_bytes), holes)
                eager = {p.pid: [tuple(r) for r in p.driver_saved] if p.driver_saved is not None else None
                         for p in manifest.processes if p.uses_gpu}
                content.fill(base, lazy.plan(base / CRIU_DIR, eager))
            elif stream:  # but for the files known by another name (links.py)
                base = content.materialize((links.LINKS_DIR,), out)
            else:
                base = content.materialize(read_out, out, observer.bytes_progress("read", criu_bytes))
    except BaseException as exc:
        cleanup()
        op.finish()
        if isinstance(exc, ImageCorrupt):  # a chunk: still exit 10, as for a bad file
            raise ImageCorrupt(f"{exc.message}; nothing was restored") from None
        if isinstance(exc, GpuosError):
            raise RestoreFailed(f"{exc.message}; nothing was restored") from None
        raise
    try:
        terminal_fds = open_terminals(manifest, tty)
        try:
            job_tty = job_terminal(manifest, tty)
        except BaseException:
            for fd in terminal_fds.values():
                os.close(fd)
            raise
    except BaseException:
        cleanup()
        op.finish()
        raise
    relinked = links.put_back(base)
    ghost_ids = links.ghost_ids([f.path for f in manifest.files])
    ghosts_before = links.ghosts_in(manifest.deleted_dirs, ghost_ids)
    placements: list[Placement] = []
    helpers: lazy.LazyHost | None = None
    streamer: ImageStreamer | None = None
    try:
        with phase("criu-restore"):
            if replicas is None:
                options = list(manifest.criu_options)
                images = base / CRIU_DIR
                if stream:
                    if decoders is not None:  # up 0.1 s after the restore began: normally already
                        decoders.up.wait(1.0)
                    streamer = ImageStreamer(content, CRIU_DIR, observer.bytes_progress("criu-restore", criu_bytes),
                                             pages_sent=criu_has_pages, decoders=decoders)
                    images = streamer.directory
                    options.append("--stream")
                else:
                    criu_has_pages.set()  # read out already
                if host["on_demand"]:
                    helpers = lazy.LazyHost(criu, image, base / CRIU_DIR, workdir, store.hot_base, verify)
                    op.record.lazy_helpers = [[pid, procs.stat(pid).starttime] for pid in helpers.pids]
                    op.save()
                    options.append("--lazy-pages")
                root, _ = criu.restore(images, workdir, options, terminal_fds, job_tty)
                placements.append(Placement(root=root, pids={p.pid: p.pid for p in manifest.processes}))
            else:
                criu_has_pages.set()  # read out already
                placements.extend(_restore_replicas(replicas, criu, base / CRIU_DIR, workdir, manifest, op))
    except GpuosError as exc:
        for pl in placements:
            pl.kill()
        if replicas is None:  # what a failed CRIU began, it kills: gone before we say so
            _wait_gone([p.pid for p in manifest.processes])
        if helpers:
            helpers.abort()
        links.remove(relinked)
        links.remove(sorted(links.ghosts_in(manifest.deleted_dirs, ghost_ids) - ghosts_before))
        cleanup()
        op.finish()
        if streamer and streamer.errors:  # a chunk CRIU wanted was bad: exit 10 (CRIU's log says no more)
            shutil.rmtree(workdir, ignore_errors=True)
            raise ImageCorrupt(f"{streamer.errors[0]}; nothing was restored") from None
        raise RestoreFailed(f"{exc.message}; nothing was restored (log: {workdir})") from None
    finally:
        criu_has_pages.set()
        if streamer:
            streamer.close()
        for fd in [*terminal_fds.values(), *([job_tty] if job_tty is not None else [])]:
            os.close(fd)
    cleanup()  # CRIU has read it all
    op.record.restored = [s for pl in placements for s in pl.starts()]
    op.record.gpu_pids = [pl.pids[gp] for pl in placements for gp in gpu_pids]
    op.save()
    fills: dict[int, filler.FillStats] = {}
    try:
        with ThreadPoolExecutor(max_workers=len(placements) * max(1, len(manifest.movable))) as each:
            if gpu_pids:
                with phase("gpu-restore"):
                    _all(each, [(resume_gpu, driver, pl.pids[gp], pairs) for pl in placements for gp in gpu_pids])
            if manifest.movable:  # they wait at their CUDA calls for their movable memory
                with phase("movable-fill"), ThreadPoolExecutor(max_workers=workers()) as pool:
                    jobs = [(pl.pids[mem.pid], mem) for pl in placements for mem in manifest.movable]
                    done = _all(each, [(filler.fill, pid, mem, content, pool, on_demand, prefills.get(mem.pid))
                                       for pid, mem in jobs])
                    fills = {pid: f for (pid, _), f in zip(jobs, done)}
        for pl in placements:  # criu left every task stopped; the CUDA ones run already
            for p in manifest.processes:
                if p.pid not in gpu_pids:
                    try:
                        os.kill(pl.pids[p.pid], signal.SIGCONT)
                    except ProcessLookupError:
                        pass
        if helpers:  # they run; each page of host memory comes in when first touched, or behind
            with phase("host-fill"):
                host["served"] = helpers.finish()
    except GpuosError as exc:
        for pl in placements:
            pl.kill()
        _wait_gone([pid for pl in placements for pid in pl.pids.values()])
        if helpers:
            helpers.abort()
        op.finish()
        failed = ImageCorrupt if isinstance(exc, ImageCorrupt) else RestoreFailed  # a chunk: exit 10
        raise failed(f"{exc.message}; the restored processes were killed, the image is intact "
                     f"(log: {workdir})") from None
    log = stamped_lines(workdir / RESTORE_LOG) if replicas is None else []
    marks, gaps = restore_marks(log), restore_gaps(log)
    shutil.rmtree(workdir, ignore_errors=True)
    op.finish()
    return RestoreResult(pid=placements[0].root, manifest=manifest, timings=dict(op.timings),
                         gpu_map=gpu_map, fills=fills, placements=placements, host_memory=host,
                         criu_marks=marks, criu_gaps=gaps)


def _prefill(mem: MovableMemory, manifest: Manifest, content: ImageContent, gpu_map: dict[str, str],
             copies: int, go: threading.Event, held: ExitStack) -> Prefill:
    """The prefill of one image process's movable memory, started now on the GPU it is
    restored onto (reading from `go` on), let go when the restore ends."""
    uuids = next((p.gpu_uuids for p in manifest.processes if p.pid == mem.pid), [])
    gpu = gpu_map.get(uuids[0], uuids[0]) if len(uuids) == 1 else None
    pf = Prefill(mem, content, gpu, room_beside(manifest.movable, mem, copies), go)
    held.callback(pf.close)
    return pf


def _wait_gone(pids: list[int], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(procs.alive(p) for p in pids):
        time.sleep(0.01)


def _all(pool: ThreadPoolExecutor, calls: list[tuple]) -> list:
    """Run every call on the pool; their results in order, or the first error once all ended
    (none is left running behind a failure)."""
    futures = [pool.submit(fn, *args) for fn, *args in calls]
    wait(futures)
    for f in futures:
        if f.exception() is not None:
            raise f.exception()
    return [f.result() for f in futures]


def _restore_replicas(n: int, criu: Criu, images: Path, workdir: Path, manifest: Manifest,
                      op: Operation) -> list[Placement]:
    """N replicas restored by CRIU at once, all or none. Each replica's pid 1 goes into the
    journal as soon as it exists: a gpuos that dies now leaves none behind (`gpuos recover`)."""
    lock = threading.Lock()

    def noted(pid: int) -> None:
        with lock:
            op.record.replica_inits.append([pid, procs.stat(pid).starttime])
            op.save()

    image_pids = [p.pid for p in manifest.processes]
    # A file open but deleted at the checkpoint is recreated by CRIU under a fixed name
    # next to where it was, linked, opened and removed again: two restores at once collide
    # there (measured: "Can't link ...ghost"). Such images restore their replicas in turn.
    at_once = 1 if links.ghost_ids([f.path for f in manifest.files]) else n
    with ThreadPoolExecutor(max_workers=at_once) as pool:
        futures = [pool.submit(restore_one, criu, images, workdir / f"replica-{k}",
                               manifest.criu_options, image_pids, noted) for k in range(n)]
        wait(futures)
    placed = [f.result() for f in futures if f.exception() is None]
    failed = [f.exception() for f in futures if f.exception() is not None]
    if failed:
        for pl in placed:
            pl.kill()
        err = failed[0]
        raise err if isinstance(err, GpuosError) else GpuosError(str(err))
    return placed
