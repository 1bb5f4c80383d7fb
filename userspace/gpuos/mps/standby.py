"""Standbys: a copy of an MPS client's command that waits at its first cuInit (cold), or
at its first kernel launch as a client of the spare server (warm).

Policy ``standby`` (docs/mps.md): beside each client the supervisor runs its command a
second time, under libgpuos, with ``GPUOS_MPS_STANDBY`` naming a FIFO of its own
(``standby/<client>.<n>``, owned by the client's user).  The copy runs its imports and
CPU-side set-up, then waits at its first cuInit (libgpuos/src/standby.c): no MPS
client yet, so a fault that takes the server's clients down does not take it.  After
such a fault, once the server takes clients again, the supervisor releases it and it
takes the victim's place, its start-up already paid.

With a spare server (`gpuos mps start --spare-server`) the copy is warm: it is given the
spare's pipe directory and ``GPUOS_MPS_STANDBY_AT=launch``, so it makes its context and
copies its weights in on the spare server and waits at its first kernel launch; a fault
on the active server leaves it alone and it is released at once.  While it waits it
loads the kernels the client has launched (``GPUOS_MPS_KERNELS``, a list the client
leaves under libgpuos: launch.kernel_list), so that its first iteration after the
release does not load them.

Beside the FIFO, FIFO.state (made here, the user's): libgpuos writes "waiting <pid>"
there as the copy begins to wait.  A standby that replaces an older one (started from a
newer checkpoint) takes its place only then (StandbyWaiting).

Release: open the FIFO for writing (every process of the copy waiting in open(2) for
reading goes on), then remove it (a later cuInit in the copy's tree finds no FIFO and
does not wait).  The write end stays open a moment longer, for a waiter that looked the
FIFO up just before it was removed.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from .gpu import GpuRef, MpsDirs
from .launch import (KERNELS_ENV, SHARE_ENV, TOKEN_ENV, ClientSpec, kernel_list, kernel_list_path,
                     mps_env, output_path, spawn, spec_path, with_libgpuos)
from .state import Client

STANDBY_ENV = "GPUOS_MPS_STANDBY"
STANDBY_AT_ENV = "GPUOS_MPS_STANDBY_AT"
HOLD_OPEN_S = 2.0  # the write end, after the rename


def fifo_path(dirs: MpsDirs, token: str) -> Path:
    """standby/<client>.<n> for the token <gpu>:<client>:standby:<n>."""
    _, client, _, n = token.rsplit(":", 3)
    return dirs.standby / f"{client}.{n}"


def state_path(fifo: Path) -> Path:
    return fifo.with_name(fifo.name + ".state")


def make_fifo(path: Path, uid: int, gid: int) -> None:
    """The FIFO a standby waits on, and its (empty) state file, both the user's."""
    path.parent.mkdir(parents=True, exist_ok=True)
    state = state_path(path)
    for p in (path, state):
        p.unlink(missing_ok=True)
    os.mkfifo(path, 0o600)
    fd = os.open(state, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    os.close(fd)
    if os.geteuid() == 0:
        for p in (path, state):
            os.chown(p, uid, gid)


def drop_fifo(path: Path) -> None:
    for p in (path, state_path(path)):
        p.unlink(missing_ok=True)


def waiting(path: Path) -> bool:
    """Has the standby on this FIFO begun to wait (libgpuos wrote its state file)?"""
    try:
        return state_path(path).stat().st_size > 0
    except OSError:
        return False


def start_standby(dirs: MpsDirs, gpu: GpuRef, client: Client, token: str,
                  slot: int | None = None, warm: bool = False, share_memory: bool = False):
    """The client's command as a standby (a subprocess.Popen), waiting at its first cuInit,
    or (warm) at its first launch, for the MPS daemon of slot; share_memory (warm): mapping
    its client's start-up memory in place of its own (libgpuos/src/sharemem.c)."""
    spec = ClientSpec.load(spec_path(dirs, client.id))
    env = mps_env(spec.env, dirs, gpu, slot)
    with_libgpuos(env)
    path = fifo_path(dirs, token)
    make_fifo(path, spec.uid, spec.gid)
    env[TOKEN_ENV] = token
    env["GPUOS_MPS_CLIENT"] = client.id
    env[STANDBY_ENV] = str(path)
    env.pop(STANDBY_AT_ENV, None)
    env.pop(KERNELS_ENV, None)
    env.pop(SHARE_ENV, None)
    if warm:
        env[STANDBY_AT_ENV] = "launch"
        env[KERNELS_ENV] = str(kernel_list(dirs, client.id, spec.uid, spec.gid))
        if share_memory:
            env[SHARE_ENV] = "1"
    try:
        return spawn(spec.cmd, spec.cwd, env, spec.uid, spec.gid, output_path(dirs, client),
                     users_file=client.output is not None)
    except BaseException:
        drop_fifo(path)
        raise


def preload_report(dirs: MpsDirs, client_id: str, standby_pid: int) -> dict | None:
    """What a warm standby has loaded ahead while it waits (the report libgpuos's
    preload.c writes beside its client's kernel list: names, loaded, not_found,
    images_loaded_ahead, taken, ...), or None."""
    path = kernel_list_path(dirs, client_id).with_name(f"launched.txt.standby.{standby_pid}")
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def memory_still_shared(shared: dict) -> int:
    """The bytes of its client's memory a standby still maps, from its report's
    memory_shared (those given back or put back are its own again)."""
    return shared["bytes"] - shared.get("given_back_bytes", 0) - shared["restored_bytes"]


class Releases:
    """Write ends held open for a moment after each release (the supervisor's)."""

    def __init__(self) -> None:
        self._held: list[tuple[float, int]] = []

    def release(self, path: Path) -> None:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:  # ENXIO: nobody waits yet (it will find no FIFO); ENOENT: gone
            fd = -1
        drop_fifo(path)
        if fd >= 0:
            self._held.append((time.monotonic() + HOLD_OPEN_S, fd))

    def expire(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        keep = []
        for deadline, fd in self._held:
            if now >= deadline:
                os.close(fd)
            else:
                keep.append((deadline, fd))
        self._held = keep

    def close(self) -> None:
        self.expire(float("inf"))
