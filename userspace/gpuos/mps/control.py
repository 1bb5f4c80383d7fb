"""Talking to NVIDIA's MPS control daemon, nvidia-cuda-mps-control.

The daemon is started with ``nvidia-cuda-mps-control -d`` and our own
CUDA_MPS_PIPE_DIRECTORY / CUDA_MPS_LOG_DIRECTORY; it writes its pid to
``nvidia-cuda-mps-control.pid`` in the pipe directory.  Commands go to it by running
``nvidia-cuda-mps-control`` again with the command on its stdin, as
``echo get_server_list | nvidia-cuda-mps-control`` does.  Only documented commands are
used: ``get_server_list``, ``get_server_status <pid>``, ``get_client_list <pid>``,
``start_server -uid <uid>``, ``terminate_client <server pid> <client pid>``, ``quit``.

Finding daemons gpuos did not start: every process running
``nvidia-cuda-mps-control -d`` (or ``-f``) is one; its environment says its pipe
directory and the GPUs it sees.  A daemon whose CUDA_VISIBLE_DEVICES excludes our
GPU does not conflict; one that sees every GPU, or whose environment we may not
read, does.  A control socket in the default pipe directory (/tmp/nvidia-mps) that
answers is one too (its process may live in another pid namespace).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from .. import procs
from ..errors import MpsUnavailable
from .gpu import NVIDIA_BIN_DIRS, GpuRef

CONTROL = "nvidia-cuda-mps-control"
SERVER = "nvidia-cuda-mps-server"
PID_FILE = "nvidia-cuda-mps-control.pid"
DEFAULT_PIPE_DIR = Path("/tmp/nvidia-mps")
MPS_ENV = ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY")


def server_ready(status: str) -> bool:
    """Whether get_server_status's answer means the server accepts clients.

    NVIDIA documents the command, not its answers; ACTIVE (ready) and FAULT (a fatal
    fault: new clients refused until every client has exited) are what gpuos expects.
    An answer that says neither counts as ready unless it says it is initializing or
    faulted: a wrong "ready" costs a client start that fails and is retried, a wrong
    "not ready" would hold the recovery forever.
    """
    s = status.strip().upper()
    if not s or "FAULT" in s or s.startswith("INIT") or "NOT FOUND" in s or "INVALID" in s:
        return False
    return True


class MpsCommandError(Exception):
    """A control command failed (no daemon, an error answer, a timeout)."""


@dataclass(frozen=True)
class MpsBinaries:
    control: Path
    server: Path


def _executable(p: Path) -> bool:
    return p.is_file() and os.access(p, os.X_OK)


def find_mps_binaries(env: dict[str, str] | None = None) -> MpsBinaries:
    """nvidia-cuda-mps-control: $GPUOS_MPS_CONTROL, PATH, /usr/local/nvidia/bin, /usr/bin.

    nvidia-cuda-mps-server must be beside it (the daemon starts it from there or PATH).
    """
    env = os.environ if env is None else env
    explicit = env.get("GPUOS_MPS_CONTROL")
    if explicit:
        control = Path(explicit)
        if not _executable(control):
            raise MpsUnavailable(f"{CONTROL} not found at {control} (from GPUOS_MPS_CONTROL)")
    else:
        found = shutil.which(CONTROL, path=env.get("PATH"))
        candidates = ([Path(found)] if found else []) + [d / CONTROL for d in NVIDIA_BIN_DIRS]
        control = next((c for c in candidates if _executable(c)), None)
        if control is None:
            raise MpsUnavailable(
                f"{CONTROL} not found on PATH, in /usr/local/nvidia/bin or /usr/bin: install the "
                "NVIDIA driver's compute utilities, or set GPUOS_MPS_CONTROL")
    server = control.parent / SERVER
    if not _executable(server):
        found = shutil.which(SERVER, path=env.get("PATH"))
        if not found:
            raise MpsUnavailable(f"{SERVER} not found beside {control} or on PATH")
        server = Path(found)
    return MpsBinaries(control=control, server=server)


def _ints(text: str) -> list[int]:
    out = []
    for line in text.splitlines():
        for word in line.replace(",", " ").split():
            if word.isdigit():
                out.append(int(word))
    return out


class MpsControl:
    """One MPS control daemon: ours, in our pipe directory, pinned to one GPU."""

    def __init__(self, binaries: MpsBinaries, pipe_dir: Path, log_dir: Path,
                 visible: str | None, base_env: dict[str, str] | None = None):
        self.binaries = binaries
        self.pipe_dir, self.log_dir = Path(pipe_dir), Path(log_dir)
        self.visible = visible
        self.base_env = dict(os.environ if base_env is None else base_env)

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in self.base_env.items() if not k.startswith("CUDA_MPS_")}
        env["CUDA_MPS_PIPE_DIRECTORY"] = str(self.pipe_dir)
        env["CUDA_MPS_LOG_DIRECTORY"] = str(self.log_dir)
        if self.visible is not None:
            env["CUDA_VISIBLE_DEVICES"] = self.visible
        bindir = str(self.binaries.control.parent)
        env["PATH"] = bindir + os.pathsep + env.get("PATH", "/usr/bin:/bin")
        return env

    # -- commands ---------------------------------------------------------------------
    def _run(self, args: list[str], what: str, timeout: float, **kw) -> str:
        """Run the control binary; its stdout, or MpsCommandError saying `what` failed."""
        try:
            res = subprocess.run([str(self.binaries.control), *args], env=self.env(), text=True,
                                 timeout=timeout, **kw)
        except subprocess.TimeoutExpired:
            raise MpsCommandError(f"{what}: no answer in {timeout:g} s") from None
        except OSError as exc:
            raise MpsCommandError(f"{what}: {exc}") from None
        if res.returncode != 0:
            msg = ((res.stderr or "").strip() or (res.stdout or "").strip()
                   or f"exit status {res.returncode}")
            raise MpsCommandError(f"{what}: {msg.splitlines()[-1]}")
        return res.stdout or ""

    def command(self, line: str, timeout: float = 10.0) -> str:
        return self._run([], repr(line), timeout, input=line + "\n", capture_output=True)

    def server_list(self) -> list[int]:
        return _ints(self.command("get_server_list"))

    def server_status(self, server_pid: int) -> str:
        out = self.command(f"get_server_status {server_pid}").strip()
        return out.splitlines()[-1].strip() if out else ""

    def client_list(self, server_pid: int) -> list[int]:
        return _ints(self.command(f"get_client_list {server_pid}"))

    def start_server(self, uid: int) -> str:
        return self.command(f"start_server -uid {uid}", timeout=30.0)

    def terminate_client(self, server_pid: int, client_pid: int) -> str:
        return self.command(f"terminate_client {server_pid} {client_pid}")

    # -- the daemon ----------------------------------------------------------------------
    def daemon_pid(self) -> int | None:
        """The pid in our pipe directory's pid file, if that process is a live control daemon."""
        try:
            pid = int((self.pipe_dir / PID_FILE).read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None
        return pid if is_control_daemon(pid) else None

    def start_daemon(self, timeout: float = 15.0) -> int:
        """Start the daemon (-d) and wait until it answers; its pid.

        Its output goes to a file, not a pipe: a daemon that kept a pipe open would make
        us wait for its end.
        """
        self.log_dir.mkdir(parents=True, exist_ok=True)
        out = self.log_dir / "gpuos-control-start.log"
        with open(out, "w+") as f:
            try:
                self._run(["-d"], f"{CONTROL} -d", timeout, stdin=subprocess.DEVNULL,
                          stdout=f, stderr=subprocess.STDOUT, cwd="/")
            except MpsCommandError as exc:
                f.seek(0)
                said = f.read().strip().splitlines()
                raise MpsCommandError(f"{exc}" + (f" ({said[-1]})" if said else "")) from None
        deadline = time.monotonic() + timeout
        last = "no pid file"
        while time.monotonic() < deadline:
            pid = self.daemon_pid()
            if pid is not None:
                try:
                    self.server_list()
                    return pid
                except MpsCommandError as exc:
                    last = str(exc)
            time.sleep(0.05)
        raise MpsCommandError(f"{CONTROL} -d started but did not answer in {timeout:g} s ({last}); "
                              f"see {self.log_dir / 'control.log'}")

    def quit(self, timeout: float = 30.0) -> bool:
        """Ask the daemon to quit; wait for it (and its servers) to exit.  Whether they did."""
        pid = self.daemon_pid()
        servers: list[int] = []
        if pid is None:
            return True
        try:
            servers = self.server_list()
        except MpsCommandError:
            pass
        try:
            self.command("quit", timeout=timeout)
        except MpsCommandError:
            pass
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not procs.alive(pid) and not any(procs.alive(s) for s in servers):
                return True
            time.sleep(0.05)
        return False


# -- finding daemons -------------------------------------------------------------------------

def _argv_is(argv: list[str], name: str) -> bool:
    """argv runs `name` (directly, or as a script: python3 /path/name ...)."""
    return any(os.path.basename(a) == name for a in argv[:2])


def _live_argv(pid: int) -> list[str]:
    """A live process's argv; [] if it is gone, a zombie or unreadable."""
    try:
        argv = procs.cmdline(pid)
        return argv if procs.alive(pid) else []
    except Exception:
        return []


def is_server(pid: int) -> bool:
    """A live MPS server (what a control daemon starts per user)."""
    return _argv_is(_live_argv(pid), SERVER)


def is_control_daemon(pid: int) -> bool:
    argv = _live_argv(pid)
    return _argv_is(argv, CONTROL) and ("-d" in argv or "-f" in argv)


@dataclass(frozen=True)
class DaemonInfo:
    pid: int
    pipe_dir: str | None       # None: its environment could not be read
    visible: str | None        # its CUDA_VISIBLE_DEVICES; None: unset (every GPU) or unreadable
    readable: bool

    def describe(self) -> str:
        where = f"pipe directory {self.pipe_dir}" if self.pipe_dir else "pipe directory unknown"
        sees = ("GPUs unknown (its environment is not readable: run as root)" if not self.readable
                else f"CUDA_VISIBLE_DEVICES={self.visible}" if self.visible is not None
                else "every GPU")
        return f"pid {self.pid} ({where}; {sees})"


def control_daemons() -> list[DaemonInfo]:
    out = []
    for pid in procs.all_pids():
        if pid == os.getpid() or not is_control_daemon(pid):
            continue
        env = procs.read_environ(pid)
        if env is None:
            out.append(DaemonInfo(pid, None, None, False))
        else:
            out.append(DaemonInfo(pid, env.get("CUDA_MPS_PIPE_DIRECTORY") or str(DEFAULT_PIPE_DIR),
                                  env.get("CUDA_VISIBLE_DEVICES"), True))
    return out


def serves_gpu(d: DaemonInfo, gpu: GpuRef) -> bool:
    """Whether daemon d may serve gpu (unknown counts as yes)."""
    if not d.readable or d.visible is None:
        return True
    for entry in (e.strip() for e in d.visible.split(",")):
        if not entry:
            continue
        if entry.isdigit():
            if gpu.index is None or int(entry) == gpu.index:
                return True
        elif entry.startswith(("GPU-", "MIG-")):
            if gpu.uuid is None or gpu.uuid.lower().startswith(entry.lower()):
                return True
        else:
            return True  # a form we do not parse: assume the worst
    return False


def answers(pipe_dir: Path, binaries: MpsBinaries, timeout: float = 3.0) -> bool:
    """Whether a control daemon answers on pipe_dir's control socket."""
    if not (pipe_dir / "control").exists():
        return False
    ctl = MpsControl(binaries, pipe_dir, pipe_dir, None)
    try:
        ctl.command("get_server_list", timeout=timeout)
        return True
    except MpsCommandError:
        return False


def foreign_daemons(ours_pipe: Path | list[Path], our_daemon: int | None | set[int], gpu: GpuRef,
                    binaries: MpsBinaries | None = None,
                    env: dict[str, str] | None = None) -> list[str]:
    """Descriptions of MPS control daemons gpuos did not start that conflict with ours.
    ours_pipe, our_daemon: one pipe directory and daemon, or (with a spare server) each
    slot's."""
    env = os.environ if env is None else env
    pipes = [ours_pipe] if isinstance(ours_pipe, (str, Path)) else list(ours_pipe)
    ours = {os.path.realpath(p) for p in pipes}
    mine = our_daemon if isinstance(our_daemon, set) else {our_daemon}
    found: list[str] = []
    seen_dirs: set[str] = set()
    for d in control_daemons():
        if d.pid in mine:
            continue
        if d.pipe_dir:
            seen_dirs.add(os.path.realpath(d.pipe_dir))
        if d.pipe_dir and os.path.realpath(d.pipe_dir) in ours:
            found.append(f"{d.describe()} uses gpuos's own pipe directory")
        elif serves_gpu(d, gpu):
            found.append(d.describe())
    if binaries is not None:
        defaults = {str(DEFAULT_PIPE_DIR)}
        if env.get("CUDA_MPS_PIPE_DIRECTORY"):
            defaults.add(env["CUDA_MPS_PIPE_DIRECTORY"])
        for p in sorted(defaults):
            real = os.path.realpath(p)
            if real in ours or real in seen_dirs:
                continue
            if answers(Path(p), binaries):
                found.append(f"a daemon answering on {p}/control (not visible here: another "
                             "container or pid namespace?)")
    return found
