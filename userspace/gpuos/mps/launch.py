"""Starting MPS clients and recovery hooks, and finding them again after a gpuos crash.

Every process the supervisor starts carries GPUOS_MPS_TOKEN=<gpu>:<client>:<n> in
its environment, a token written to the state file before the process is started.
A supervisor that was killed between writing the token and learning the pid finds
the process by its token (/proc/PID/environ) instead of starting it twice.
"""

from __future__ import annotations

import os
import pwd
import shlex
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from .. import procs
from ..intercept.runner import libgpuos_path
from .gpu import GpuRef, MpsDirs
from .state import Client
from .store import write_json_atomic

TOKEN_ENV = "GPUOS_MPS_TOKEN"
KERNELS_ENV = "GPUOS_MPS_KERNELS"
SHARE_ENV = "GPUOS_MPS_SHARE_MEMORY"  # its start-up memory, mapped by its warm standby


@dataclass
class ClientSpec:
    """What `gpuos mps run` sent: enough to run the command again, as it was."""

    cmd: list[str]
    cwd: str
    env: dict[str, str]
    uid: int
    gid: int

    def save(self, path: Path) -> None:
        write_json_atomic(path, {"cmd": self.cmd, "cwd": self.cwd, "env": self.env,
                                 "uid": self.uid, "gid": self.gid}, mode=0o600)

    @classmethod
    def load(cls, path: Path) -> "ClientSpec":
        import json
        d = json.loads(path.read_text())
        return cls(cmd=d["cmd"], cwd=d["cwd"], env=d["env"], uid=d["uid"], gid=d["gid"])


def spec_path(dirs: MpsDirs, client_id: str) -> Path:
    return dirs.clients / f"{client_id}.json"


def output_path(dirs: MpsDirs, client: Client) -> Path:
    return Path(client.output) if client.output else dirs.root / "output" / f"{client.id}.log"


def mps_env(base: dict[str, str], dirs: MpsDirs, gpu: GpuRef, slot: int | None = None) -> dict[str, str]:
    """base with the MPS variables of this supervisor's daemon (with a spare server: the
    slot's own directories, never the link that follows the active one)."""
    env = {k: v for k, v in base.items() if not k.startswith("CUDA_MPS_")}
    env["CUDA_MPS_PIPE_DIRECTORY"] = str(dirs.pipe_of(slot))
    env["CUDA_MPS_LOG_DIRECTORY"] = str(dirs.log_of(slot))
    # The daemon sees only our GPU; a client's CUDA_VISIBLE_DEVICES is read against what the
    # server sees, so an index would be wrong: the UUID, or nothing.
    if gpu.uuid:
        env["CUDA_VISIBLE_DEVICES"] = gpu.uuid
    else:
        env.pop("CUDA_VISIBLE_DEVICES", None)
    env["GPUOS_MPS_GPU"] = gpu.key
    return env


def _identity(uid: int, gid: int) -> dict:
    """Popen arguments to run as uid/gid (only root may switch)."""
    if os.geteuid() != 0 or uid == os.geteuid():
        if uid != os.geteuid():
            raise PermissionError(f"the supervisor runs as uid {os.geteuid()} and cannot start "
                                  f"a process as uid {uid} (run it as root)")
        return {}
    try:
        name = pwd.getpwuid(uid).pw_name
        groups = os.getgrouplist(name, gid)
    except KeyError:
        groups = [gid]
    return {"user": uid, "group": gid, "extra_groups": groups}


def _open_output(path: Path, uid: int, gid: int) -> int:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o640)
    if os.geteuid() == 0:
        try:
            os.fchown(fd, uid, gid)
        except OSError:
            pass
    return fd


# Opens the output file as the client's user, then becomes the client (same pid).
_OPENER = ("import os,sys\n"
           "fd=os.open(sys.argv[1],os.O_WRONLY|os.O_CREAT|os.O_APPEND,0o640)\n"
           "os.dup2(fd,1);os.dup2(fd,2)\n"
           "os.execvp(sys.argv[3],sys.argv[3:])\n")


def spawn(argv: list[str], cwd: str, env: dict[str, str], uid: int, gid: int,
          output: Path, users_file: bool = False) -> subprocess.Popen:
    """Start argv in its own session (so its whole tree can be signalled), output appended.

    users_file: output is a path the user chose; as root, it is opened as the user (by a
    tiny exec wrapper), never with root's rights.
    """
    ident = _identity(uid, gid)
    if not os.path.isdir(cwd):
        raise FileNotFoundError(f"working directory {cwd} does not exist")
    if users_file and ident:
        return subprocess.Popen([sys.executable, "-c", _OPENER, str(output), "--", *argv],
                                cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True, close_fds=True, **ident)
    fd = _open_output(output, uid, gid)
    try:
        return subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=fd,
                                stderr=fd, start_new_session=True, close_fds=True, **ident)
    finally:
        os.close(fd)


def with_libgpuos(env: dict[str, str]) -> None:
    """env with libgpuos preloaded first."""
    lib = libgpuos_path()
    if " " in str(lib) or ":" in str(lib):
        raise ValueError(f"libgpuos path {lib} has a space or colon; LD_PRELOAD cannot name it")
    env["LD_PRELOAD"] = f"{lib} {env.get('LD_PRELOAD', '')}".strip()


def kernel_list_path(dirs: MpsDirs, client_id: str) -> Path:
    """Where a client with a warm standby leaves the kernels it launched and its standby
    reads them, to load them while it waits (libgpuos/src/preload.c)."""
    return dirs.root / "kernels" / client_id / "launched.txt"


def kernel_list(dirs: MpsDirs, client_id: str, uid: int, gid: int) -> Path:
    """kernel_list_path, its directory made as one of the client's own user, who writes it."""
    path = kernel_list_path(dirs, client_id)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    if os.geteuid() == 0:
        os.chown(path.parent, uid, gid)
    return path


def start_client(dirs: MpsDirs, gpu: GpuRef, client: Client, token: str, slot: int | None = None,
                 note_kernels: bool = False, share_memory: bool = False) -> subprocess.Popen:
    """The client's command, as sent; note_kernels: under libgpuos, leaving the names of
    the kernels it launches for its warm standby; share_memory: and serving it its
    start-up memory (libgpuos/src/sharemem.c)."""
    spec = ClientSpec.load(spec_path(dirs, client.id))
    env = mps_env(spec.env, dirs, gpu, slot)
    env[TOKEN_ENV] = token
    env["GPUOS_MPS_CLIENT"] = client.id
    env.pop(KERNELS_ENV, None)
    env.pop(SHARE_ENV, None)
    if note_kernels:
        with_libgpuos(env)
        env[KERNELS_ENV] = str(kernel_list(dirs, client.id, spec.uid, spec.gid))
        if share_memory:
            env[SHARE_ENV] = "1"
    return spawn(spec.cmd, spec.cwd, env, spec.uid, spec.gid, output_path(dirs, client),
                 users_file=client.output is not None)


def start_hook(dirs: MpsDirs, gpu: GpuRef, client: Client, hook: str, token: str,
               incident: dict) -> subprocess.Popen:
    """`sh -c HOOK` as the client's user, in its directory, told about the victim."""
    spec = ClientSpec.load(spec_path(dirs, client.id))
    env = mps_env(spec.env, dirs, gpu)
    env.update({
        TOKEN_ENV: token,
        "GPUOS_MPS_CLIENT": client.id,
        "GPUOS_MPS_VICTIM_PID": str(incident.get("pid") or ""),
        "GPUOS_MPS_VICTIM_CMD": shlex.join(spec.cmd),
        "GPUOS_MPS_VICTIM_CWD": spec.cwd,
        "GPUOS_MPS_VICTIM_EXIT": "" if incident.get("exit_status") is None
        else str(incident["exit_status"]),
        "GPUOS_MPS_INCIDENT": str(incident.get("id", "")),
        "GPUOS_MPS_FAULT_XIDS": ",".join(str(x) for x in incident.get("xids", []) if x is not None),
    })
    return spawn(["/bin/sh", "-c", hook], spec.cwd, env, spec.uid, spec.gid,
                 output_path(dirs, client), users_file=client.output is not None)


def find_by_token(token: str) -> tuple[int, int] | None:
    """(pid, starttime) of the oldest live process started with this token."""
    best: tuple[int, int] | None = None
    for pid in procs.all_pids():
        env = procs.read_environ(pid)
        if not env or env.get(TOKEN_ENV) != token:
            continue
        try:
            st = procs.stat(pid)
        except Exception:
            continue
        if st.state == "Z":
            continue
        if best is None or st.starttime < best[1]:
            best = (pid, st.starttime)
    return best


def starttime(pid: int) -> int | None:
    try:
        return procs.stat(pid).starttime
    except Exception:
        return None


def same_process(pid: int, start: int | None) -> bool:
    """pid is alive and, if start is known, still the process that had that starttime."""
    try:
        st = procs.stat(pid)
    except Exception:
        return False
    return st.state != "Z" and (start is None or st.starttime == start)


def signal_tree(pid: int, sig: int) -> bool:
    """Signal pid's process group (it leads one: start_new_session), else pid alone; and
    then its descendants that left the group (a session of their own) and use CUDA: a
    client's GPU process keeps MPS from serving again until it is gone, wherever it
    moved.  Descendants that do not use CUDA are left alone (a daemon it started)."""
    try:
        kin = procs.tree(pid)[1:]
    except (procs.NoSuchProcess, OSError):
        kin = []
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            return False
    except PermissionError:
        return False
    for p in kin:
        try:
            if os.getpgid(p) != pid and procs.uses_cuda(p):
                os.kill(p, sig)
        except (ProcessLookupError, PermissionError, procs.NoSuchProcess, OSError):
            continue  # gone, or not ours to signal
    return True


SIGNALS = {"SIGTERM": signal.SIGTERM, "SIGKILL": signal.SIGKILL, "SIGSTOP": signal.SIGSTOP}
