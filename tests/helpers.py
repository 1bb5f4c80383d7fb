"""Helpers shared by the host tests: images, processes, the gpuos command."""

from __future__ import annotations

import hashlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

from gpuos import procs
from gpuos.errors import NoSuchProcess
from gpuos.criu import DUMP_LOG, DUMP_OK
from gpuos.manifest import CRIU_DIR, DriverInfo, GpuInfo, Manifest, ProcessInfo
from gpuos.manifest import FileEntry
from gpuos.store import ImageStore, hash_files
from gpuos.store.content import ingest, staged_files

import pytest

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root")

def criu_unusable(plugins: Path = Path("/tmp/gpuos-criu-plugins")) -> str | None:
    """Why CRIU tests cannot run here (not root, no working criu), or None."""
    from gpuos.config import find_criu
    from gpuos.criu import Criu
    from gpuos.errors import CriuUnavailable

    if os.geteuid() != 0:
        return "needs root"
    try:
        Criu(find_criu(), plugins).check_version()
    except CriuUnavailable as exc:
        return f"no working criu: {exc.message}"
    return None


# -- images -------------------------------------------------------------------


def make_manifest(name: str = "img", pids: tuple[int, ...] = (4242,), gpu: bool = False,
                  gpus: list[GpuInfo] | None = None, driver: DriverInfo | None = None,
                  **overrides) -> Manifest:
    """A plausible manifest; the files and timings are filled in by build_image."""
    processes = [ProcessInfo(pid=p, ppid=1 if i == 0 else pids[0], tids=[p], comm="python3",
                             cmdline=["python3", "job.py"], uses_gpu=gpu,
                             gpu_memory=(1 << 30) if gpu else 0,
                             gpu_uuids=[g.uuid for g in gpus or []] if gpu else [])
                 for i, p in enumerate(pids)]
    fields = dict(name=name, created="2025-01-01T00:00:00+00:00", gpuos_version="0.1.0",
                  hostname="host", kernel="6.8.0", root_pid=pids[0], leave_running=False,
                  processes=processes, gpus=list(gpus or []),
                  driver=driver if driver is not None or not gpu else DriverInfo("580.65.06", 13000),
                  criu_version="4.2.1", criu_options=["--file-locks"], files=[], timings={})
    fields.update(overrides)
    return Manifest(**fields)


def write_criu_files(criu_dir: Path, seed: bytes = b"a", complete: bool = True) -> None:
    criu_dir.mkdir(parents=True, exist_ok=True)
    (criu_dir / "pages-1.img").write_bytes(hashlib.sha256(seed).digest() * 512)
    (criu_dir / "core-4242.img").write_bytes(seed * 100)
    log = "(00.001) Dumping processes\n" + (f"(00.050) {DUMP_OK}\n" if complete else "")
    (criu_dir / DUMP_LOG).write_text(log)


def store_staged(store: ImageStore, staging: Path, final: Path, m: Manifest) -> None:
    """A staged image's files into chunks, its manifest written and published, the way
    checkpoint() does it."""
    m.chunk_dir = store.chunk_dir_for(final)
    chunks = store.chunks_of(staging, m)
    with chunks.shared():
        m.files, _ = ingest(staged_files(staging, skip=("chunks",)), chunks)
        ImageStore.write_manifest(staging, m)
        ImageStore.drop_files(staging)
        ImageStore.publish(staging, final)


def build_image(store: ImageStore, name: str, seed: bytes = b"a",
                manifest: Manifest | None = None) -> Path:
    """A complete image in the store, built and published the way checkpoint() does."""
    final = store.resolve(name)
    staging = store.staging_for(final, "build")
    write_criu_files(staging / CRIU_DIR, seed)
    m = manifest or make_manifest(name)
    m.timings = {"criu-dump": 0.1}
    store_staged(store, staging, final, m)
    return final


def legacy_entries(root: Path) -> list[FileEntry]:
    """The files under root (but the manifest) as a format-4 manifest lists them."""
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.name != "manifest.json")
    return [FileEntry(path=p.relative_to(root).as_posix(), size=p.stat().st_size, sha256=sha, pieces=pc)
            for p, (sha, pc) in zip(files, hash_files(files))]


def build_v4_image(store: ImageStore, name: str, seed: bytes = b"a",
                   manifest: Manifest | None = None) -> Path:
    """An image as gpuos wrote them before the chunk store (format 4: whole files)."""
    final = store.resolve(name)
    staging = store.staging_for(final, "build")
    write_criu_files(staging / CRIU_DIR, seed)
    m = manifest or make_manifest(name)
    m.format_version = 4
    m.files = legacy_entries(staging)
    m.timings = {"criu-dump": 0.1}
    ImageStore.write_manifest(staging, m)
    ImageStore.publish(staging, final)
    return final


def draft_of(m: Manifest) -> dict:
    """The journal's draft: the manifest as checkpoint() records it before the dump."""
    d = asdict(m)
    d["files"], d["timings"] = [], {}
    return d


def tree_digest(root: Path) -> dict[str, str]:
    """Every regular file under root (manifest included) -> sha256."""
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def hidden_entries(store_root: Path) -> list[str]:
    """Leftovers in a store: hidden directories (staging) but the chunk store, and chunks
    half written."""
    if not store_root.is_dir():
        return []
    tmp = store_root / ".chunks" / "tmp"
    return sorted([p.name for p in store_root.iterdir() if p.name.startswith(".") and p.name != ".chunks"]
                  + [f".chunks/tmp/{p.name}" for p in (tmp.iterdir() if tmp.is_dir() else [])])


def journals(run_dir: Path) -> list[Path]:
    return sorted(run_dir.glob("op-*.json")) if run_dir.is_dir() else []


# -- processes ----------------------------------------------------------------

COUNTER = """\
import socket, sys, time
log, port, mb = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
ballast = bytearray(mb << 20)
for off in range(0, len(ballast), 4096):
    ballast[off] = 1  # touched: criu has to write every page
conn = socket.create_connection(("127.0.0.1", port)) if port else None
log = open(log, "a", buffering=1)
i = 0
while True:
    log.write(f"{i}\\n")
    i += 1
    time.sleep(0.01)
"""


def wait_for(cond, timeout: float = 15.0, what: str = "condition", step: float = 0.02):
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(step)


def counted(log: Path) -> list[int]:
    """The complete lines of a counter's log, as integers."""
    text = log.read_text() if log.exists() else ""
    return [int(x) for x in text[: text.rfind("\n") + 1].split()]


def assert_consecutive(numbers: list[int]) -> None:
    assert numbers == list(range(len(numbers))), \
        f"log is not 0..{len(numbers) - 1} without gap or repeat: ...{numbers[-20:]}"


class Processes:
    """Starts target processes and makes sure none outlives its test."""

    def __init__(self, workdir: Path):
        self.workdir = workdir
        self.children: list[subprocess.Popen] = []
        self.adopted: list[tuple[int, str]] = []  # (pid, marker in its cmdline)
        self._n = 0

    def start(self, argv: list[str], tag: str = "proc") -> subprocess.Popen:
        self._n += 1
        out = open(self.workdir / f"{tag}-{self._n}.out", "w")
        try:
            proc = subprocess.Popen(argv, start_new_session=True, stdin=subprocess.DEVNULL,
                                    stdout=out, stderr=subprocess.STDOUT)
        finally:
            out.close()
        self.children.append(proc)
        return proc

    def sleeper(self) -> subprocess.Popen:
        return self.start(["sleep", "1000"], "sleep")

    def tree(self) -> tuple[subprocess.Popen, int]:
        """A shell with one child; returns the shell and the child's pid."""
        proc = self.start(["sh", "-c", "sleep 1000 & wait"], "tree")
        kids = wait_for(lambda: procs.children(proc.pid), what="the shell's child")
        return proc, kids[0]

    def counter(self, log: Path, port: int = 0, mb: int = 0, min_lines: int = 5) -> subprocess.Popen:
        """A process that appends 0, 1, 2, ... to ``log``, which it keeps open (and holds
        ``mb`` MiB of touched memory, and a TCP connection to ``port`` if given)."""
        script = self.workdir / "counter.py"
        script.write_text(COUNTER)
        argv = [sys.executable, str(script), str(log), str(port), str(mb)]
        proc = self.start(argv, "counter")
        wait_for(lambda: len(counted(log)) >= min_lines or proc.poll() is not None,
                 what=f"{log} to grow")
        assert proc.poll() is None, f"counter exited early: {proc.returncode}"
        self.adopt(proc.pid, str(script))
        return proc

    def adopt(self, pid: int, marker: str) -> None:
        """Kill ``pid`` at teardown if it still runs a command containing ``marker``
        (a restored process is not our child)."""
        self.adopted.append((pid, marker))

    def cleanup(self) -> None:
        for proc in self.children:
            try:  # each is a session and group leader: take its descendants too
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=10)
            if proc.stdout:
                proc.stdout.close()
        for pid, marker in self.adopted:
            kill_if_running(pid, marker)


def kill_if_running(pid: int, marker: str, timeout: float = 10.0) -> None:
    try:
        if marker not in " ".join(procs.cmdline(pid)):
            return
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, NoSuchProcess):
        return
    # Not our child: its parent (init) reaps it; wait until /proc forgets it.
    deadline = time.monotonic() + timeout
    while procs.exists(pid) and time.monotonic() < deadline:
        time.sleep(0.02)


def zombie(procs_: Processes) -> subprocess.Popen:
    """A child that has exited and is not reaped yet (reaped at teardown)."""
    proc = procs_.start(["true"], "zombie")
    wait_for(lambda: procs.stat(proc.pid).state == "Z", what="a zombie")
    return proc


# -- the gpuos command --------------------------------------------------------

GPUOS = [sys.executable, "-c", "import sys; from gpuos.cli.main import main; sys.argv[0] = 'gpuos'; main()"]


def gpuos_env(home: Path, criu: Path | str | None = None, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("GPUOS_STORE", "GPUOS_CRIU", "GPUOS_TEST_HOLD_AT", "GPUOS_TEST_HOLD_FILE")}
    env["GPUOS_HOME"] = str(home)
    env["GPUOS_HOT"] = str(Path(home) / "hot")  # never the host's /dev/shm/gpuos
    if criu is not None:
        env["GPUOS_CRIU"] = str(criu)
    env.update(extra)
    return env


def gpuos(env: dict[str, str], *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([*GPUOS, *args], env=env, capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def gpuos_json(env: dict[str, str], *args: str) -> tuple[int, dict]:
    res = gpuos(env, *args, "--json")
    try:
        return res.returncode, json.loads(res.stdout)
    except ValueError:
        raise AssertionError(f"gpuos {' '.join(args)} --json printed no JSON "
                             f"(exit {res.returncode}): {res.stdout!r} {res.stderr!r}") from None


# -- journals of other processes ------------------------------------------------

_OPERATION = """\
import json, os, sys, time
from pathlib import Path
from gpuos.journal import Operation
op = Operation(Path(sys.argv[1]), sys.argv[2])
for key, value in json.loads(sys.argv[3]).items():
    if isinstance(value, str):
        value = value.replace("{op}", op.op_id)  # e.g. a staging dir named after the op
    setattr(op.record, key, value)
op.save()
print(op.op_id, flush=True)
if sys.argv[4] == "die":
    os._exit(0)  # the owner dies mid-operation: journal and lock file stay, the flock goes
time.sleep(1000)
"""


def dead_operation(run_dir: Path, kind: str, **record) -> str:
    """The journal of a gpuos that died during an operation; returns its op id."""
    res = subprocess.run([sys.executable, "-c", _OPERATION, str(run_dir), kind,
                          json.dumps(record), "die"], capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stderr
    return res.stdout.strip()


def live_operation(processes: Processes, run_dir: Path, kind: str, **record) -> tuple[str, subprocess.Popen]:
    """An operation in flight in another (live) gpuos process; returns its op id."""
    proc = subprocess.Popen([sys.executable, "-c", _OPERATION, str(run_dir), kind,
                             json.dumps(record), "live"], stdout=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    processes.children.append(proc)
    op_id = proc.stdout.readline().strip()
    assert op_id, "the operation's process printed no op id"
    return op_id, proc


def kill_run(app_pid: int, proc: subprocess.Popen) -> None:
    """An application and its `gpuos run` (killing only the latter would leave the
    application holding the pipe), then the run reaped."""
    for pid in (app_pid, proc.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.communicate()


def mem_stats(env: dict, target: str | int) -> dict:
    """`gpuos mem stats TARGET --json` (a pid or a group)."""
    res = subprocess.run([sys.executable, "-m", "gpuos.cli", "mem", "stats", str(target), "--json"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


class ResidentApp:
    """libgpuos/tests/t_resident under `gpuos run GPUOS_ARGS`, started at once; it waits at
    its end for the file `stop` (test_resident.py, test_share.py)."""

    def __init__(self, build: Path, env: dict, tmp: Path, gpuos_args: list[str], rounds: int, seed: int,
                 *mode: str):
        tmp.mkdir(exist_ok=True)
        self.stop = tmp / "stop"
        self.proc = subprocess.Popen([sys.executable, "-m", "gpuos.cli", "run", "-q", *gpuos_args, "--",
                                      str(build / "tests" / "t_resident"), str(self.stop), str(rounds), str(seed),
                                      *mode], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.pid = 0

    def wait_ok(self, timeout: float = 300.0) -> "ResidentApp":
        """Until its work is done and checked ("ok"); fails the test if it was not, or if
        it has not said so within `timeout` seconds (killed then: a hang must not hold
        the whole suite)."""
        if not select.select([self.proc.stdout], [], [], timeout)[0]:
            out, err = self.kill()
            pytest.fail(f"t_resident said nothing in {timeout:.0f} s: {out} {err[-3000:]}")
        first = self.proc.stdout.readline().split()
        if first[:1] != ["ok"]:
            self.stop.touch()
            out, err = self.proc.communicate(timeout=60)
            pytest.fail(f"t_resident failed ({self.proc.returncode}): {' '.join(first)} {out} {err}")
        self.pid = int(self.proc.stdout.readline().split()[1])
        return self

    def kill(self) -> tuple[str, str]:
        """SIGKILL the application under `gpuos run`, then the run: their output."""
        try:
            kids = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()
        except OSError:
            kids = []
        for pid in [*map(int, kids), self.proc.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return self.proc.communicate(timeout=60)

    def stats(self, env: dict) -> dict:
        return mem_stats(env, self.pid)

    def finish(self) -> tuple[int, str]:
        """Let it end (killed if it has not within 60 s: a member still waiting for the
        GPU never looks for `stop`): its exit status and stderr."""
        self.stop.touch()
        try:
            _, err = self.proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            err = "killed, still running 60 s after its stop: " + self.kill()[1]
        return self.proc.returncode, err


# A process that holds a file it deleted (CRIU saves it as a ghost file) and counts into a
# log: argv[1] the log, argv[2] the file.
GHOST_HOLDER = """\
import os, sys, time
held = open(sys.argv[2], "w")  # open, then deleted: CRIU saves it as a ghost file
held.write("x" * 10000)
held.flush()
os.unlink(sys.argv[2])
log = open(sys.argv[1], "a", buffering=1)
i = 0
while True:
    log.write(f"{i}\\n")
    i += 1
    time.sleep(0.01)
"""
