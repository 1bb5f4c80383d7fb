"""Run a suite workload in a child process, plain or under `gpuos run`, with a hard time limit.

Shared by bench/intercept_overhead.py and tests/gpu/test_intercept_gpu.py.  A run that
overstays its limit is killed with everything it started (`gpuos run`, the workload, and
torch.compile's workers), so a hung workload cannot hold the GPU.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence


def suite_cmd(workload: str, args: Sequence[str] = ()) -> list[str]:
    return [sys.executable, "-m", "gpuos.workloads.suite", workload, *args, "--json"]


def under_gpuos(cmd: Sequence[str], *options: str) -> list[str]:
    """cmd under `gpuos run OPTIONS -- cmd` (the module, so no console script is needed)."""
    return [sys.executable, "-m", "gpuos.cli", "run", *options, "--", *cmd]


def private_caches(root: Path) -> dict[str, str]:
    """Environment giving Inductor, Triton and CuPy kernel caches of their own under root, so
    that a run compiles what it needs instead of reusing what another run left."""
    return {"TORCHINDUCTOR_CACHE_DIR": str(root / "inductor"), "TRITON_CACHE_DIR": str(root / "triton"),
            "CUPY_CACHE_DIR": str(root / "cupy")}


@dataclass
class Finished:
    cmd: list[str]
    returncode: int | None  # None: killed at the time limit
    stdout: str
    stderr: str
    wall_s: float

    def outcome(self) -> str:
        return (f"timed out after {self.wall_s:.0f} s" if self.returncode is None
                else f"exited {self.returncode}")

    def describe(self) -> str:
        """What happened, for an error message."""
        return f"{' '.join(self.cmd)}: {self.outcome()}\nstderr (end): {self.stderr[-3000:]}"

    def result(self) -> dict[str, Any]:
        """The workload's JSON line (the last line of its stdout)."""
        lines = self.stdout.strip().splitlines()
        try:
            return json.loads(lines[-1])
        except (IndexError, ValueError):
            raise RuntimeError(f"no JSON result: {self.describe()}") from None


def run(cmd: Sequence[str], timeout: float, env: dict[str, str] | None = None) -> Finished:
    t0 = time.monotonic()
    proc = subprocess.Popen(list(cmd), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
        code: int | None = proc.returncode
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        out, err = proc.communicate()
        code = None
    return Finished(list(cmd), code, out, err, time.monotonic() - t0)


def last_json_object(text: str) -> dict | None:
    """The last top-level JSON object in a command's output: the last of JSON lines, or a
    pretty-printed object (`gpuos ... --json`), with any other lines around it."""
    lines = text.splitlines()
    decoder = json.JSONDecoder()
    for i in range(len(lines) - 1, -1, -1):
        if not lines[i].startswith("{"):
            continue
        try:
            obj, _ = decoder.raw_decode("\n".join(lines[i:]))
        except ValueError:
            continue
        if isinstance(obj, dict):
            return obj
    return None


def processes_with_env(var: str, value: str) -> list[int]:
    """Processes whose environment has var=value (what a harness marks everything it
    starts with, to find and kill it all at the end), never this process."""
    needle = f"{var}={value}".encode()
    out = []
    for d in Path("/proc").glob("[0-9]*"):
        pid = int(d.name)
        if pid == os.getpid():
            continue
        try:
            env = (d / "environ").read_bytes()
        except OSError:
            continue
        if needle in env.split(b"\0"):
            out.append(pid)
    return out


def kill_tree(root: int) -> None:
    """SIGKILL root and all its descendants.  They are stopped first, until no new one
    appears, so none can fork or be reparented away while we look."""
    seen: set[int] = set()
    while True:
        new = [pid for pid in _tree(root) if pid not in seen]
        if not new:
            break
        for pid in new:
            _signal(pid, signal.SIGSTOP)
        seen.update(new)
    for pid in seen:
        _signal(pid, signal.SIGKILL)


def _tree(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):  # gone meanwhile
            continue
        children.setdefault(ppid, []).append(int(stat.parent.name))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, ()))
    return found


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
