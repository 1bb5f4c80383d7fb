"""Replicas: N copies of one image's processes side by side (``gpuos restore --replicas N``).

Each copy has the same pids, sockets and agent name as the others, so each lives in pid,
network and mount namespaces of its own, as in a container (nsinit.py is the pid 1 that
holds them). CRIU restores each copy from inside its namespaces; gpuos, outside, finds the
restored tasks under the replica's pid 1 and talks to them, the driver and the agent by
our pids (``Placement.pids``). Killing a replica's pid 1 ends the whole replica.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from . import nsinit, procs
from .criu import RESTORE_LOG, Criu, first_error, restored_root
from .errors import GpuosError, NoSuchProcess


@dataclass
class Placement:
    """Where one copy of the image's processes landed."""

    root: int                                            # our pid of the restored root
    pids: dict[int, int] = field(default_factory=dict)   # the image's pid -> ours
    init: int | None = None                              # a replica's pid 1 (ours), None in our namespaces

    def starts(self) -> list[list[int]]:
        """[pid, start time] of every process it has (for the journal)."""
        out = []
        for pid in ([self.init] if self.init else []) + list(self.pids.values()):
            try:
                out.append([pid, procs.stat(pid).starttime])
            except NoSuchProcess:
                pass
        return out

    def kill(self) -> None:
        for pid in [self.init] if self.init else list(self.pids.values()):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _report(reader) -> tuple[str, str]:
    line = reader.readline().strip()
    word, _, rest = line.partition(" ")
    return word, rest


def restore_one(criu: Criu, images: Path, workdir: Path, options: list[str],
                image_pids: list[int], on_init=None) -> Placement:
    """One replica: its namespaces, its pid 1, CRIU's restore inside (every task left
    stopped). ``on_init(pid)`` is told the replica's pid 1 as soon as it exists (so a
    journal can end it if gpuos dies). A failure ends the replica and raises."""
    args = criu.command(Criu.restore_args(images, workdir, options))
    r, w = os.pipe()
    try:
        launcher = subprocess.Popen([sys.executable, "-m", "gpuos.nsinit", str(w), "--", *args],
                                    preexec_fn=nsinit.replica_preexec, pass_fds=(w,),
                                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.PIPE)
    except BaseException:
        os.close(r)
        raise
    finally:
        os.close(w)
    init = None
    with os.fdopen(r) as reader:
        try:
            word, rest = _report(reader)
            launcher.wait()
            if word != "init":
                err = launcher.stderr.read().decode(errors="replace").strip()[-300:] if launcher.stderr else ""
                raise GpuosError(f"cannot start a replica's namespaces: {err or 'no report'}")
            init = int(rest)
            if on_init:
                on_init(init)
            word, rest = _report(reader)
        finally:
            if launcher.stderr:
                launcher.stderr.close()
        placement = Placement(root=0, init=init)
        try:
            if word == "error":
                raise GpuosError(f"a replica's pid 1 failed: {rest}")
            if word != "criu":
                raise GpuosError("a replica's pid 1 died before CRIU ended")
            if int(rest) != 0:
                raise GpuosError(f"criu restore failed (exit {rest}): {first_error(workdir / RESTORE_LOG)}")
            own_root = restored_root(workdir)
            for pid in procs.tree(init)[1:]:
                try:
                    placement.pids[procs.own_pid(pid)] = pid
                except NoSuchProcess:
                    continue
            missing = sorted(set(image_pids) - set(placement.pids))
            if missing or own_root not in placement.pids:
                raise GpuosError(f"the replica lacks pids {missing or [own_root]} of the image after CRIU's restore")
            placement.root = placement.pids[own_root]
        except BaseException:
            placement.kill()
            raise
    return placement
