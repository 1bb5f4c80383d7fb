"""Run a suite workload in a child process, plain or under `gpuos run`, with a hard time limit.

Shared by bench/intercept_overhead.py, bench/oversub.py and the GPU tests.  A run that
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

from .. import procs


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
    out = []
    for d in Path("/proc").glob("[0-9]*"):
        pid = int(d.name)
        if pid != os.getpid() and (procs.read_environ(pid) or {}).get(var) == value:
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


def run_polling_mem_stats(cmd: Sequence[str], timeout: float, env: dict[str, str] | None = None,
                          every: float = 0.2) -> tuple[Finished, Any]:
    """Run `gpuos run ... -- CMD` (cmd), asking the application's agent for its memory
    scheduler's figures (MEM_STATS) every `every` seconds while it runs: the run, and the
    last figures (gpuos.movable.MemStats; None if its agent never answered)."""
    from ..movable import Agent, AgentError, agent_available

    t0 = time.monotonic()
    proc = subprocess.Popen(list(cmd), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    last = None
    app = None
    try:
        while proc.poll() is None and time.monotonic() - t0 < timeout:
            time.sleep(every)
            if app is None:
                try:
                    kids = [int(x) for x in Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()]
                except OSError:
                    kids = []
                app = next((k for k in kids if agent_available(k)), None)
                if app is None:
                    continue
            try:
                with Agent(app, timeout=10) as agent:
                    last = agent.mem_stats()
            except (AgentError, OSError):
                pass  # gone, or its lock held longer than the timeout: the next look, or the last figures
        timed_out = proc.poll() is None
        if timed_out:
            kill_tree(proc.pid)
        out, err = proc.communicate()
    except BaseException:
        kill_tree(proc.pid)
        proc.communicate()
        raise
    return Finished(list(cmd), None if timed_out else proc.returncode, out, err, time.monotonic() - t0), last


def wait_file(path: Path, timeout: float, proc: subprocess.Popen | None = None) -> float:
    """Wait for path to appear (failing early if proc exits first); the time it was seen."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{proc.args} exited with {proc.returncode} before {path} appeared")
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {path}")
        time.sleep(0.0005)
    return time.time()


def start_served(model: str, d: Path, env: dict) -> subprocess.Popen:
    """A gpuos.workloads.serve server of `model` under `gpuos run`, answering requests in d
    (made here, with request 0 waiting); not waited for (served() waits).  Its output goes
    nowhere: CRIU restores an open file only at the size it had at the checkpoint, and a
    log that restored copies wrote to would have grown."""
    d.mkdir()
    (d / "req-0").write_text("")
    return subprocess.Popen([sys.executable, "-m", "gpuos.cli", "run", "-q", "--", sys.executable, "-m",
                             "gpuos.workloads.serve", "--model", model, "--requests", str(d)],
                            env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)


def served(proc: subprocess.Popen, d: Path, timeout: float = 900.0) -> int:
    """The server's pid, once it answered request 0."""
    wait_file(d / "resp-0", timeout, proc)
    return int((d / "ready").read_text())
