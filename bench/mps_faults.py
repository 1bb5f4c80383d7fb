#!/usr/bin/env python3
"""MPS faults: blast radius and recovery times, stock MPS against gpuos-supervised MPS.

For each N (co-running clients: N-1 inference loops and one training loop, all
`python -m gpuos.workloads.mps_client`, each writing a heartbeat after every iteration),
each fault kind of gpuos-inject, and each mode:

- stock: `nvidia-cuda-mps-control -d` in private pipe/log directories (the compute mode
  is never changed), the clients started with its environment;
- supervised: `gpuos mps start` (private GPUOS_HOME, defaults otherwise), the clients
  through `gpuos mps run --policy restart`;
- standby: the same with `--policy standby`: each client has a second copy waiting at its
  first cuInit (the fault is injected once every copy waits there), released after the
  fault to take the victim's place;
- spare: `gpuos mps start --spare-server --policy standby`: the copies are warm, clients of
  a second MPS server waiting at their first kernel launch (the fault is injected once
  every copy waits there), released the moment the fault is seen;
- spare-end: spare with `--end-faulted-server`: the faulted MPS server is killed when the
  incident opens, not left until its clients have exited (the measurement that decides
  whether that option earns a place);
- spare-hold: spare with `--hold-victims 0.5`: the victims are stopped when the incident
  opens, their standbys released at once, and the victims killed 0.5 s later (their
  contexts' teardown after the standbys' first work, not during it);

before the fault, each client's iterations per second over --sample seconds (the
fault-free cost of a mode is its clients' rate against another mode's, same N and kind);

once every client has made progress, `gpuos faults watch --json --no-journal` is started
(to time detection) and then `gpuos faults inject --kind K --json` as one more MPS
client. Measured, from the fault (the moment the injector's `armed` line arrived; it
faults right after, --delay 0):

- which clients died (exit status, or for supervised ones a new pid in the heartbeat);
- detection: first Xid event from the watch (its arrival; the kernel's timestamp too),
  and for supervised MPS the supervisor's first `fault`/`incident-opened` event;
- server back: the first fresh probe client (`gpuos faults inject --kind none`) that
  succeeds (supervised: probes begin once the supervisor says `server-ready`, so that a
  probe does not join the incident), and the supervisor's `server-ready`;
- each victim's downtime: fault to its first heartbeat of a new run (supervised), or
  "not recovered" (stock: nothing restarts it); a client that survived: fault to its
  next heartbeat;
- with --train-checkpoint S, the training client saves its progress every S seconds and
  resumes from it at its start (`gpuos mps run --checkpoint`): the work its victim lost,
  measured (its iteration at the fault less the one its new run resumed from, at its rate)
  and as the supervisor's incident record says it (`lost_s`); with --standby-refresh R
  too, standby modes fault only once the training client's standby is one the supervisor
  started again from a checkpoint (R s old at least).

    python3 bench/mps_faults.py [--n 2,4,8] [--kinds oob-write,trap,...] [--modes stock,supervised,standby]
                                [--budget 540] [--scenario-timeout 150] [--quick] [--bystander warm|alloc|copy|module]
                                [--out bench/results] [--update-readme]
    python3 bench/mps_faults.py --readme-from bench/results/mps-faults-H100-DATE.json
    python3 bench/mps_faults.py --cost-rounds 10 [--cost-window 5] [--n 4] [--modes standby,spare]

With --cost-rounds R, no fault: the fault-free cost of keeping standbys, per standby mode
and N.  The clients run under that mode's `gpuos mps start`; R rounds, each one window of
--cost-window seconds with every client's standby waiting (`gpuos mps policy set --client
ID standby`, measured from 2 s after all of them wait) and one without (`restart`: from 2 s
after the standbys stopped), the order alternating between rounds.  The cost is the mean
difference of the clients' time per iteration (all of them together) over the mean
without, with its 95% interval over the rounds (bench/paired.py's rounds_overhead): the
3 s rate of a fault scenario cannot show 1%.  Into the same JSON, under "cost".

Writes bench/results/mps-faults-<gpu>-<date>.json after every scenario (scenarios of an
earlier run of the same day and GPU are kept, the ones run again replaced), prints a
Markdown table; progress on stderr.  Every process it starts carries a marker in its
environment and is killed at the end of its scenario, whatever happened.  Exits 1 if a
scenario failed to run (a fault that kills clients is a result, not a failure).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import select
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import readme_table
from kwait import WaitSampler
from paired import rounds_overhead
from gpuos import __version__
from gpuos import procs
from gpuos.faults import inject as inj
from gpuos.mps.control import is_server
from gpuos.mps.standby import memory_still_shared
from gpuos.mps.store import EventLog
from gpuos.workloads.mps_client import read_heartbeat
from gpuos.workloads.run import kill_tree, last_json_object, processes_with_env

MARKER = "GPUOS_MPS_BENCH"
FAULT_KINDS = [k for k in inj.KINDS if k != "none"]
ACTIONABLE = {"memory", "sm", "copy", "channel", "device", "unknown"}
MIN_SCENARIO_S = 40
READY_TIMEOUT = 90.0      # all clients' first heartbeat (8 cold torch starts under MPS)
PROBE_TIMEOUT = 20.0
SETTLE_S = 3.0            # after everything is resolved: late watch events (NVML join window)
STALL_S = 15.0            # stock: a client with no progress this long after the fault is a victim
POLICY = {"supervised": "restart", "standby": "standby", "spare": "standby",  # under `gpuos mps`
          "spare-end": "standby", "spare-hold": "standby"}
STANDBYS = ("standby", "spare", "spare-end", "spare-hold")  # modes whose clients have standbys
WARM = ("spare", "spare-end", "spare-hold")   # modes with a spare server (warm standbys)
HOLD_VICTIMS_S = 0.5      # spare-hold: gpuos mps start --hold-victims
MODES = ("stock", *POLICY)
# progress this long past the fault: a survivor (under gpuos mps: past the drain's signals)
SURVIVE_S = {"stock": 5.0} | dict.fromkeys(POLICY, 20.0)
NO_INCIDENT_S = 5.0       # supervised: the faulter gone this long and no incident: none will come
GIVE_UP_S = 30.0          # stock: probes failing this long after the clients are resolved: not back


def log(msg: str) -> None:
    print(f"[{datetime.now().strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def gpuos_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "gpuos.cli", *args]


def bystander_stall(beats: list[float], t0: float) -> dict[str, Any] | None:
    """The longest gap between a bystander's iterations that ends after the fault (its
    stall), from the iteration before it to the one after, in seconds from the fault;
    and its usual iteration time (the median gap) to compare it with."""
    gaps = [(b - a, a, b) for a, b in zip(beats, beats[1:]) if b > t0]
    if not gaps:
        return None
    usual = statistics.median(b - a for a, b in zip(beats, beats[1:]))
    g, a, b = max(gaps)
    return {"stall_s": g, "from_s": a - t0, "to_s": b - t0, "usual_s": usual}


def work_lost(c: dict, log: str, rates: list[float] | None, recorded: dict | None) -> dict:
    """A checkpointing victim's work lost: its iteration at the fault (its heartbeat then)
    less the one its new run resumed from (the new process's "resumed" line in the client's
    log; none: from its start, 0), in seconds at its own fault-free rate; beside what the
    supervisor's incident record says (recorded: lost_s, resumes_from)."""
    out: dict[str, Any] = {"lost_recorded_s": (recorded or {}).get("lost_s"),
                           "resumes_from_recorded": (recorded or {}).get("resumes_from")}
    prefix = f"mps_client: pid {c['new_pid']} resumed from iteration "
    resumed = next((int(ln[len(prefix):].split()[0]) for ln in log.splitlines() if ln.startswith(prefix)), 0)
    lost = c["before"][1] - resumed
    rate = rates[c["id"]] if rates and c["id"] < len(rates) else None
    out.update(resumed_iteration=resumed, lost_iterations=lost,
               lost_measured_s=round(lost / rate, 3) if rate else None)
    return out


def client_cmd(mode: str, heartbeat: Path, size: int, phases: Path | None = None,
               checkpoint: Path | None = None, every: float = 0.0) -> list[str]:
    return [sys.executable, "-m", "gpuos.workloads.mps_client", "--mode", mode,
            "--heartbeat", str(heartbeat), "--size", str(size), "--max-seconds", "900"] \
        + (["--phases", str(phases)] if phases else []) \
        + (["--checkpoint", str(checkpoint), "--checkpoint-every", str(every)] if checkpoint else [])


def first_phases(text: str, pid: int, t0: float) -> dict[str, float]:
    """From an mps_client --phases file: when each phase of pid's first iteration ended, in
    seconds from t0."""
    out = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 4 and parts[0] == str(pid) and parts[1] == "1":
            out[parts[2]] = float(parts[3]) - t0
    return out


# -- processes ----------------------------------------------------------------------------------

class StampedLines:
    """A process's output lines, read by a thread (_read) and stamped with their arrival
    time; `ended` once the process is gone."""

    def __init__(self) -> None:
        self.started = time.time()
        self.lines: list[tuple[float, str]] = []
        self.ended: float | None = None
        self._t = threading.Thread(target=self._read, daemon=True)

    def _read(self) -> None:
        raise NotImplementedError

    @property
    def returncode(self) -> int | None:
        raise NotImplementedError

    def kill(self) -> None:
        raise NotImplementedError

    def json_lines(self) -> list[tuple[float, dict]]:
        out = []
        for t, line in list(self.lines):
            try:
                obj = json.loads(line)
            except ValueError:
                continue
            if isinstance(obj, dict):
                out.append((t, obj))
        return out


class Lines(StampedLines):
    """A child of ours: its stdout's lines."""

    def __init__(self, cmd: list[str], env: dict[str, str], stderr_path: Path):
        self.cmd = cmd
        self.err = open(stderr_path, "w")
        self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=self.err, text=True, start_new_session=True)
        super().__init__()
        self._t.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append((time.time(), line.rstrip("\n")))
        self.proc.wait()
        self.ended = time.time()

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            kill_tree(self.proc.pid)
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        self._t.join(timeout=2)
        self.err.close()


class ExitWatch:
    """When a process began to exit (every thread exiting: procs.ending) and when it was
    gone (its whole thread group: its pidfd readable), looked at every millisecond by a
    thread: the faulter's CUDA process (gpuos-inject, the child of `gpuos faults inject`),
    since after a trap the co-runners' work waits for it to be gone (H200, README).  Not
    the leader's zombie state: the leader is a zombie while another thread of the process
    still closes its GPU files."""

    def __init__(self, pid: int):
        self.pid = pid
        self.exiting: float | None = None
        self.gone: float | None = None
        try:
            self._pidfd: int | None = os.pidfd_open(pid)
        except OSError:
            self._pidfd = None  # gone already
            self.exiting = self.gone = time.time()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._watch, daemon=True)
        self._t.start()

    def _watch(self) -> None:
        while not self._stop.is_set() and self.gone is None and self._pidfd is not None:
            now = time.time()
            gone = bool(select.select([self._pidfd], [], [], 0)[0])
            if self.exiting is None and (gone or procs.ending(self.pid)):
                self.exiting = now
            if gone:
                self.gone = now
            time.sleep(0.001)

    def stop(self) -> None:
        self._stop.set()
        self._t.join(timeout=1)
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None


class ClientLines(StampedLines):
    """A child of the supervisor's, not ours (--faulter client: a `gpuos mps run` client):
    the lines of its output file, read every millisecond (up to ~1 ms after a pipe's
    would arrive), until its pid is gone."""

    def __init__(self, out_path: Path, pid: int):
        self.pid, self.path = pid, out_path
        try:
            self._start: int | None = procs.stat(pid).starttime
        except procs.NoSuchProcess:
            self._start = None  # gone already: its lines are read once
        self._stop = threading.Event()
        super().__init__()
        self._t.start()

    def _alive(self) -> bool:
        try:
            st = procs.stat(self.pid)
        except procs.NoSuchProcess:
            return False
        return st.starttime == self._start and st.state != "Z"

    def _read(self) -> None:
        pos, partial = 0, ""
        while not self._stop.is_set():
            alive = self._alive()
            try:
                with open(self.path) as f:
                    f.seek(pos)
                    data = f.read()
                    pos = f.tell()
            except OSError:
                data = ""
            now = time.time()
            *done, partial = (partial + data).split("\n")
            self.lines.extend((now, line) for line in done)
            if not alive:
                self.ended = now
                return
            time.sleep(0.001)

    @property
    def returncode(self) -> int | None:
        return None  # the supervisor's: its victim-exited event has the status

    def kill(self) -> None:
        if self._alive():
            kill_tree(self.pid)
        self._stop.set()
        self._t.join(timeout=2)


def sweep(marker: str) -> list[int]:
    """SIGKILL every process of this run that is left (and its descendants)."""
    left = processes_with_env(MARKER, marker)
    for pid in left:
        kill_tree(pid)
    return left


def run_bounded(cmd: list[str], env: dict[str, str], timeout: float, out: Path) -> tuple[int | None, str]:
    """Run cmd to the end (stdout to a file, so a detached grandchild holding it cannot make
    us wait); None when killed at the limit.  Its stdout."""
    with open(out, "w+") as f:
        proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=f,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code: int | None = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_tree(proc.pid)
            proc.wait()
            code = None
        f.seek(0)
        return code, f.read()


# -- one scenario -------------------------------------------------------------------------------

class ScenarioFailed(Exception):
    pass


class Scenario:
    def __init__(self, mode: str, n: int, kind: str, limit: float, workdir: Path, gpu: dict,
                 size: int, sample_s: float = 3.0, bystander: str = "", phases: bool = False,
                 kernel_waits: bool = False, faulter: str = "bench", trackers: bool = True,
                 train_checkpoint: float = 0.0, standby_refresh: float = 0.0, share_memory: bool = False):
        self.mode, self.n, self.kind, self.size = mode, n, kind, size
        self.share_memory = share_memory and mode in WARM
        self.train_checkpoint, self.standby_refresh = train_checkpoint, standby_refresh
        self.trackers = trackers
        self.faulter_as = faulter if mode in POLICY else "bench"
        self.phases = phases
        self.bystander = bystander if mode in WARM else ""
        self.bystander_proc: subprocess.Popen | None = None
        self.kernel_waits = kernel_waits
        self.sampler: WaitSampler | None = None
        self.standby_of: dict[str, int | None] = {}  # the supervisor's client id -> its standby
        self.sample_s = sample_s
        self.deadline = time.monotonic() + limit
        self.dir = workdir
        self.dir.mkdir(parents=True)
        self.gpu = gpu
        self.marker = f"{os.getpid()}-{mode}-{n}-{kind}-{time.monotonic_ns()}"
        self.env = dict(os.environ, **{MARKER: self.marker})
        for k in [k for k in self.env if k.startswith("CUDA_MPS_")]:
            del self.env[k]
        self.mps_env: dict[str, str] = {}
        self.children: list[StampedLines] = []
        self.clients: list[dict[str, Any]] = []
        self.r: dict[str, Any] = {"mode": mode, "n": n, "kind": kind, "notes": []}
        self.t_fault: float | None = None
        self.faulter_exit: ExitWatch | None = None  # the faulter's CUDA process, once armed

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def note(self, msg: str) -> None:
        self.r["notes"].append(msg)
        log(f"{self.mode} N={self.n} {self.kind}: {msg}")

    # -- MPS up and down ---------------------------------------------------------------------
    def start_stock(self) -> None:
        from gpuos.mps.control import MpsControl, find_mps_binaries

        self.ctl = MpsControl(find_mps_binaries(self.env), self.dir / "pipe", self.dir / "log",
                              self.gpu.get("uuid"), base_env=self.env)
        (self.dir / "pipe").mkdir()
        self.r["daemon_pid"] = self.ctl.start_daemon(timeout=15)
        self.mps_env = self.ctl.env()

    def start_supervised(self) -> None:
        self.home = self.dir / "h"
        self.env["GPUOS_HOME"] = str(self.home)
        extra = (["--spare-server"] if self.mode in WARM else []) + (
            ["--end-faulted-server"] if self.mode == "spare-end" else []) + (
            ["--hold-victims", str(HOLD_VICTIMS_S)] if self.mode == "spare-hold" else []) + (
            [] if self.trackers else ["--no-fault-trackers"]) + (
            ["--standby-refresh", str(self.standby_refresh)] if self.standby_refresh else []) + (
            ["--share-standby-memory"] if self.share_memory else [])
        code, out = run_bounded(gpuos_cmd("mps", "start", "--gpu", "0", "--json", "--timeout", "60",
                                          *extra),
                                self.env, min(90, self.left()), self.dir / "mps-start.out")
        info = last_json_object(out)
        if code != 0 or not info or not info.get("ok"):
            raise ScenarioFailed(f"gpuos mps start: exit {code}: {out.strip()[-800:]}")
        self.r["supervisor_pid"], self.r["daemon_pid"] = info["supervisor_pid"], info["daemon_pid"]
        self.mps_env = dict(self.env, **info["env"])
        self.events_file = Path(info["pipe_dir"]).parent / "events.jsonl"

    def stop(self) -> None:
        for c in self.children:
            c.kill()
        if self.sampler is not None:
            self.sampler.stop()
        if self.bystander_proc is not None and self.bystander_proc.poll() is None:
            kill_tree(self.bystander_proc.pid)
            self.bystander_proc.wait()
        if self.mode == "stock" and hasattr(self, "ctl"):
            for c in self.clients:
                if c.get("proc") is not None and c["proc"].poll() is None:
                    kill_tree(c["proc"].pid)
            ok = self.ctl.quit(timeout=15)
            if not ok:
                self.note("the MPS daemon did not quit in 15 s: killed")
        elif self.mode in POLICY and hasattr(self, "home"):
            code, out = run_bounded(gpuos_cmd("mps", "stop", "--json", "--timeout", "45"),
                                    self.env, 60, self.dir / "mps-stop.out")
            self.r["stop"] = {"exit": code, "reply": last_json_object(out)}
            if code != 0:
                self.note(f"gpuos mps stop: exit {code}: {out.strip()[-400:]}")
        left = sweep(self.marker)
        if left:
            self.note(f"killed {len(left)} leftover processes: {left}")

    def preloads(self) -> list[dict]:
        """What each warm standby loaded while it waited (libgpuos/src/preload.c): the
        reports it left beside its client's kernel list, with the list's length."""
        out = []
        for report in sorted(self.home.glob("mps/*/kernels/*/launched.txt.standby.*")):
            try:
                rec = json.loads(report.read_text())
                listed = report.with_name("launched.txt").read_text().splitlines()
            except (OSError, ValueError):
                continue
            out.append(dict(rec, client=report.parent.name, listed_now=len(listed),
                            records=listed[:40]))
        return out

    # -- clients ---------------------------------------------------------------------------
    def start_clients(self) -> None:
        for i in range(self.n):
            role = "train" if i == self.n - 1 else "infer"
            hb = self.dir / f"hb{i}"
            c: dict[str, Any] = {"id": i, "role": role, "heartbeat": hb,
                                 "phases": self.dir / f"phases{i}" if self.phases else None}
            ckpt = self.dir / f"ckpt{i}.pt" if role == "train" and self.train_checkpoint else None
            cmd = client_cmd(role, hb, self.size, c["phases"], ckpt, self.train_checkpoint) + (
                ["--seed", str(7 + i)] if self.share_memory else [])  # its standby: the same weights
            if self.mode == "stock":
                out = open(self.dir / f"client{i}.log", "w")
                c["proc"] = subprocess.Popen(cmd, env=self.mps_env, stdin=subprocess.DEVNULL,
                                             stdout=out, stderr=subprocess.STDOUT,
                                             start_new_session=True)
                out.close()
                c["pid"] = c["proc"].pid
            else:
                code, text = run_bounded(
                    gpuos_cmd("mps", "run", "--policy", POLICY[self.mode], "--json",
                              "--output", str(self.dir / f"client{i}.log"),
                              *(["--checkpoint", str(ckpt)] if ckpt else []), "--", *cmd),
                    self.env, 30, self.dir / f"run{i}.out")
                reply = last_json_object(text)
                if code != 0 or not reply:
                    raise ScenarioFailed(f"gpuos mps run: exit {code}: {text.strip()[-600:]}")
                c["client"], c["pid"] = reply.get("client"), reply.get("pid")
            self.clients.append(c)
        deadline = time.monotonic() + min(READY_TIMEOUT, self.left() - 20)
        while time.monotonic() < deadline:
            beats = [read_heartbeat(c["heartbeat"]) for c in self.clients]
            if all(beats):
                for c, b in zip(self.clients, beats):
                    c["pid"] = b[2]
                return
            dead = [c["id"] for c in self.clients if c.get("proc") is not None and c["proc"].poll() is not None]
            if dead:
                raise ScenarioFailed(f"clients {dead} exited before their first iteration "
                                     f"(see {self.dir}/client*.log)")
            time.sleep(0.1)
        raise ScenarioFailed("not every client made progress in time "
                             f"({sum(1 for c in self.clients if read_heartbeat(c['heartbeat']))}/{self.n})")

    def start_bystander(self) -> None:
        """--bystander: one more inference loop, a client of the spare server from the start
        (not gpuos's: nothing recovers it), whose every iteration is logged: its longest gap
        across the fault says whether the faulted server's teardown holds up contexts that
        have nothing to do with it (the standbys' first kernels, on the same server).
        "alloc": it gives its memory back after each iteration, so that each one also
        allocates from the driver (what a standby's first iteration does); "copy": each
        iteration also copies its inputs in from the host (a copy engine's work, as a
        module's code loaded at a first launch is); "module": each iteration also loads a
        new module and runs its kernel (a first launch's code load, what a standby's first
        cuBLAS GEMM does when its kernel was not loaded ahead)."""
        code, out = run_bounded(gpuos_cmd("mps", "status", "--json"), self.env, 30, self.dir / "status.out")
        gpus = (last_json_object(out) or {}).get("gpus") or [{}]
        spare = (gpus[0].get("spare") or {}).get("pipe_dir")
        if code != 0 or not spare:
            raise ScenarioFailed(f"gpuos mps status: exit {code}, no spare server's pipe directory")
        self.beats_file = self.dir / "bystander.beats"
        cmd = client_cmd("infer", self.dir / "hb-bystander", self.size) + ["--beats", str(self.beats_file)] \
            + {"alloc": ["--fresh-memory"], "copy": ["--copy-in"],
               "module": ["--new-module"]}.get(self.bystander, [])
        with open(self.dir / "bystander.log", "w") as out:
            self.bystander_proc = subprocess.Popen(
                cmd, env=dict(self.env, CUDA_MPS_PIPE_DIRECTORY=str(spare)), stdin=subprocess.DEVNULL,
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + min(READY_TIMEOUT, self.left() - 20)
        while time.monotonic() < deadline:
            if read_heartbeat(self.dir / "hb-bystander"):
                return
            if self.bystander_proc.poll() is not None:
                raise ScenarioFailed(f"the bystander exited {self.bystander_proc.returncode} before "
                                     f"its first iteration (see {self.dir}/bystander.log)")
            time.sleep(0.1)
        raise ScenarioFailed("the bystander made no progress in time")

    def wait_standbys(self) -> None:
        """Every client's standby started (warm ones for mode spare) and waiting at its cuInit
        or first launch: in openat(2) (x86-64: 257) on two looks 0.3 s apart (the FIFO's
        open blocks; an import's opens do not)."""
        deadline = time.monotonic() + min(READY_TIMEOUT, self.left() - 20)
        while time.monotonic() < deadline:
            code, out = run_bounded(gpuos_cmd("mps", "clients", "--json"), self.env, 30,
                                    self.dir / "clients.out")
            rows = (last_json_object(out) or {}).get("clients", [])
            pids = [r.get("standby_pid") for r in rows if r.get("id")
                    and r.get("standby_warm") == (self.mode in WARM)]
            self.standby_of = {r["id"]: r.get("standby_pid") for r in rows if r.get("id")}
            # GPU memory (NVML) of each client and its standby while they wait: what a warm
            # standby costs, and what --share-standby-memory saves of it
            self.r["gpu_memory"] = {r["id"]: {"client": r.get("gpu_memory"), "standby": r.get("standby_gpu_memory")}
                                    for r in rows if r.get("id")}
            if len(pids) == self.n and all(pids):
                looks = []
                for _ in range(2):
                    looks.append(all(_syscall(p) == "257" for p in pids))
                    time.sleep(0.3)
                if all(looks):
                    self.r["standby_pids"] = pids
                    return
            time.sleep(0.5)
        raise ScenarioFailed("the standbys were not all waiting in time")

    def wait_standby_from_checkpoint(self) -> None:
        """--standby-refresh: until the training client's standby is one the supervisor started
        from a checkpoint (`gpuos mps clients --json`: standby_state_at), so that the fault
        tests a take-over that resumes from it."""
        train = next(c for c in self.clients if c["role"] == "train")
        deadline = time.monotonic() + min(READY_TIMEOUT, self.left() - 20)
        while time.monotonic() < deadline:
            code, out = run_bounded(gpuos_cmd("mps", "clients", "--json"), self.env, 30,
                                    self.dir / "clients.out")
            row = next((r for r in (last_json_object(out) or {}).get("clients", [])
                        if r.get("id") == train["client"]), {})
            if row.get("standby_state_at"):  # null while its standby is not alive
                self.r["train_standby_state_at"] = row["standby_state_at"]
                return
            time.sleep(0.5)
        raise ScenarioFailed("no standby of the training client started from a checkpoint in time")

    def sample_rates(self) -> None:
        """Each client's iterations per second over sample_s, before the fault."""
        first = [read_heartbeat(c["heartbeat"]) for c in self.clients]
        time.sleep(self.sample_s)
        rates = []
        for c, a in zip(self.clients, first):
            b = read_heartbeat(c["heartbeat"])
            ok = a and b and b[2] == a[2] and b[0] > a[0]
            rates.append((b[1] - a[1]) / (b[0] - a[0]) if ok else None)
        self.r["rates"] = rates
        got = [r for r in rates if r is not None]
        self.r["rate_median"] = statistics.median(got) if got else None

    # -- the fault ---------------------------------------------------------------------------
    def events(self) -> list[dict]:
        return EventLog(self.events_file).read() if self.mode in POLICY else []

    def fault(self) -> None:
        self.watch = Lines(gpuos_cmd("faults", "watch", "--json", "--no-journal"), self.env,
                           self.dir / "watch.err")
        self.children.append(self.watch)
        time.sleep(2.0)  # kmsg opened at its end, NVML registered
        if self.watch.proc.poll() is not None:
            self.note(f"gpuos faults watch exited {self.watch.proc.returncode}: "
                      f"{(self.dir / 'watch.err').read_text().strip()[-300:]}")
        for c in self.clients:
            b = read_heartbeat(c["heartbeat"])
            c["before"] = b
        inject = gpuos_cmd("faults", "inject", "--kind", self.kind, "--json")
        if self.faulter_as == "client":  # one of the supervisor's clients, recovered by none
            out = self.dir / "faulter.log"
            code, text = run_bounded(gpuos_cmd("mps", "run", "--policy", "none", "--json",
                                               "--output", str(out), "--", *inject),
                                     self.env, 30, self.dir / "faulter.run.out")
            reply = last_json_object(text) or {}
            if code != 0 or not reply.get("pid"):
                raise ScenarioFailed(f"gpuos mps run (the faulter): exit {code}: {text.strip()[-600:]}")
            self.faulter = ClientLines(out, reply["pid"])
            if self.sampler is not None:
                self.sampler.add(int(reply["pid"]), "faulter client")
            self.r["faulter_client"] = reply.get("client")
        else:
            self.faulter = Lines(inject, self.mps_env, self.dir / "faulter.err")
        self.children.append(self.faulter)
        deadline = time.monotonic() + min(60, self.left() - 10)
        while time.monotonic() < deadline:
            armed = [(t, o) for t, o in self.faulter.json_lines() if o.get("stage") == "armed"]
            if armed:
                self.t_fault = armed[0][0]
                if armed[0][1].get("pid"):
                    self.faulter_exit = ExitWatch(armed[0][1]["pid"])
                    if self.sampler is not None:
                        self.sampler.add(int(armed[0][1]["pid"]), "faulter")
                break
            if self.faulter.ended is not None:
                break
            time.sleep(0.02)
        self.r["faulter_started"] = self.faulter.started
        if self.t_fault is None:
            self.faulter.kill()
            err = self.dir / ("faulter.log" if self.faulter_as == "client" else "faulter.err")
            raise ScenarioFailed(f"the injector never armed: exit {self.faulter.returncode}: "
                                 f"{err.read_text().strip()[-400:]}; "
                                 f"{[l for _, l in self.faulter.lines][-3:]}")
        self.r["t_fault"] = self.t_fault

    def probe(self) -> tuple[bool, float, str]:
        code, out = run_bounded(gpuos_cmd("faults", "inject", "--kind", "none", "--json"),
                                self.mps_env, min(PROBE_TIMEOUT, max(1, self.left())),
                                self.dir / "probe.out")
        last = last_json_object(out) or {}
        return code == 0, time.time(), f"exit {code} {last.get('stage')} {last.get('error', '')}".strip()

    def observe(self) -> None:
        """Until every client is resolved, the server is back and the fault was seen, or the
        scenario's time is up."""
        t0 = self.t_fault
        assert t0 is not None
        probes: list[dict] = []
        server_back: float | None = None
        probe_thread: threading.Thread | None = None
        probe_result: list[tuple[bool, float, str, float]] = []

        def probe_once() -> None:
            started = time.time()
            ok, t, what = self.probe()
            probe_result.append((ok, t, what, started))

        resolved_at: float | None = None
        while self.left() > 5:
            now = time.time()
            for c in self.clients:
                self.update_client(c, t0)
            evs = self.events()
            ready = next((e for e in evs if e.get("event") in ("server-ready", "servers-swapped")
                          and e["time"] >= t0 - 1), None)
            closed = next((e for e in evs if e.get("event") == "incident-closed" and e["time"] >= t0 - 1), None)
            opened = any(e.get("event") == "incident-opened" and e["time"] >= t0 - 1 for e in evs)
            # A fault that stays in the faulter (seen: a device-side assert) opens no incident:
            # once the faulter is gone this long without one, the supervisor has nothing to do.
            quiet = (self.mode in POLICY and not opened and self.faulter.ended is not None
                     and now - self.faulter.ended > NO_INCIDENT_S)
            # probes: stock once the faulter is gone; supervised once the supervisor has a server
            may_probe = (self.faulter.ended is not None if self.mode == "stock"
                         else (ready is not None or closed is not None or quiet or now - t0 > 60))
            if server_back is None and may_probe and probe_thread is None:
                probe_thread = threading.Thread(target=probe_once, daemon=True)
                probe_thread.start()
            if probe_thread is not None and not probe_thread.is_alive():
                ok, t, what, started = probe_result[-1]
                probes.append({"started_s": started - t0, "ended_s": t - t0, "ok": ok, "result": what})
                probe_thread = None
                if ok:
                    server_back = t
                else:
                    time.sleep(0.5)
            clients_done = all(c.get("resolved") for c in self.clients)
            sup_done = self.mode == "stock" or closed is not None or (quiet and not opened)
            if clients_done and sup_done and self.faulter.ended is not None:
                resolved_at = resolved_at or time.monotonic()
                waited = time.monotonic() - resolved_at
                if server_back is not None and waited >= SETTLE_S:
                    break
                if self.mode == "stock" and server_back is None and waited >= GIVE_UP_S:
                    self.note(f"no probe client succeeded within {GIVE_UP_S:.0f} s of the clients' end")
                    break
            time.sleep(0.05)
        else:
            self.note("scenario time limit reached before everything was resolved")
        if probe_thread is not None:
            probe_thread.join(timeout=PROBE_TIMEOUT + 5)
        self.r["probes"] = probes
        self.r["server_back_s"] = None if server_back is None else server_back - t0

    def update_client(self, c: dict, t0: float) -> None:
        """Died: exited (stock) or a new pid in its heartbeat (supervised).  Back: its first
        heartbeat after the fault from a new run (supervised) or, for a survivor, its next."""
        if c.get("resolved") and not c.get("survived"):
            return  # survivors are still watched: a later death counts
        b = read_heartbeat(c["heartbeat"])
        proc = c.get("proc")
        if proc is not None and proc.poll() is not None and "exit" not in c:
            c["exit"], c["exited_s"] = proc.returncode, time.time() - t0
            c["died"], c["survived"] = True, False
            c["resolved"] = True  # stock: nothing restarts it
            return
        if (self.mode == "stock" and not c.get("resolved") and time.time() - t0 > STALL_S
                and (b is None or b[0] < t0)):
            c["died"], c["stalled"], c["resolved"] = True, True, True
            return
        if self.mode in POLICY and not c.get("died") and not _alive(c["pid"]):
            c["died"], c["exited_s"] = True, time.time() - t0
        if b is None:
            return
        t, it, pid = b
        if pid != c["pid"] or (c.get("before") and it < c["before"][1]):
            c["died"], c["survived"] = True, False
            c.setdefault("exited_s", None)
            c["new_pid"], c["back_s"], c["resolved"] = pid, t - t0, True
        elif t > t0 and not c.get("died") and c.get("before") and it > c["before"][1]:
            # progress after the fault from the same process: alive, if it goes on
            c.setdefault("next_beat_s", t - t0)
            if t - t0 > SURVIVE_S[self.mode]:
                c["survived"], c["resolved"] = True, True

    def summarize(self) -> None:
        t0 = self.t_fault
        assert t0 is not None
        fl = self.faulter.json_lines()
        fx = self.faulter_exit
        if fx is not None:
            fx.stop()
        self.r["faulter"] = {"exit": self.faulter.returncode, "as": self.faulter_as,
                             "stages": [{"arrived_s": t - t0, **o} for t, o in fl],
                             "ended_s": None if self.faulter.ended is None else self.faulter.ended - t0,
                             # its CUDA process (gpuos-inject): began to exit, was gone
                             "process_exiting_s": None if fx is None or fx.exiting is None else fx.exiting - t0,
                             "process_gone_s": None if fx is None or fx.gone is None else fx.gone - t0}
        faulter_pid = next((o.get("pid") for _, o in fl if o.get("pid")), None)
        self.r["faulter_pid"] = faulter_pid
        watch = [(t, o) for t, o in self.watch.json_lines() if o.get("type") == "fault"]
        self.r["watch_events"] = [{"arrived_s": t - t0, "kernel_s": o.get("time", t) - t0,
                                   "xid": o.get("xid"), "class": o.get("fault_class"),
                                   "pid": o.get("pid"), "source": o.get("source")} for t, o in watch]
        first = next(((t, o) for t, o in watch if o.get("fault_class") in ACTIONABLE
                      and o.get("time", t) >= t0 - 1), None)
        self.r["detect_s"] = None if first is None else first[0] - t0
        self.r["detect_kernel_s"] = None if first is None else first[1].get("time", first[0]) - t0
        self.r["detect_xid"] = None if first is None else first[1].get("xid")
        if self.mode in POLICY:
            evs = [e for e in self.events() if e.get("time", 0) >= t0 - 1]
            self.r["took_over"] = sum(1 for e in evs if e.get("event") == "victim-took-over")
            self.r["preloads"] = self.preloads()
            self.r["supervisor_events"] = [{k: e.get(k) for k in
                                            ("time", "event", "state", "incident", "client", "pid",
                                             "old_pid", "cause", "outcome", "seconds", "why",
                                             "detail", "victims", "note", "action", "parts", "pids")}
                                           for e in evs]
            for row, e in zip(self.r["supervisor_events"], evs):  # whose fault, by what
                if isinstance(e.get("fault"), dict):
                    row["fault"] = {k: e["fault"].get(k) for k in ("source", "pid", "client_pid", "xid")}

            def first_of(*names: str) -> float | None:
                e = next((e for e in evs if e.get("event") in names), None)
                return None if e is None else e["time"] - t0

            self.r["supervisor_detect_s"] = first_of("fault", "incident-opened")
            self.r["incident_opened_s"] = first_of("incident-opened")
            self.r["supervisor_server_ready_s"] = first_of("server-ready", "servers-swapped")
            self.r["incident_closed_s"] = first_of("incident-closed")
            # where the recovery's time went on the supervisor's side: its standbys' release,
            # and its loop's turns that took 0.05 s or more (what it saw nothing else during)
            self.r["released_s"] = first_of("standby-releasing")
            # and when the victims' exits were done (reaped): a release waits for every
            # thread of them to have begun exiting, no longer for this (state.py)
            reaped = [e["time"] - t0 for e in evs if e.get("event") == "victim-exited"]
            self.r["reaped_s"] = max(reaped) if reaped else None
            # deliverable 1: the supervisor's fault tracker named the injector
            self.r["faulter_named_s"] = next(
                (e["time"] - t0 for e in evs if e.get("event") == "fault"
                 and isinstance(e.get("fault"), dict) and e["fault"].get("source") == "uvm-tracker"
                 and e["fault"].get("pid") == self.r.get("faulter_pid")), None)
            self.r["slow_turns"] = [{"at_s": e["time"] - t0, "seconds": e.get("seconds"),
                                     "parts": e.get("parts")}
                                    for e in evs if e.get("event") == "slow-turn"]
            closed = next((e for e in evs if e.get("event") == "incident-closed"), None)
            self.r["incident_outcome"] = closed.get("outcome") if closed else None
            self.r["lost_recorded"] = {v["client"]: {"lost_s": v.get("lost_s"), "resumes_from": v.get("resumes_from"),
                                                     "ran_s": v.get("ran_s")}
                                       for v in (closed or {}).get("victims", []) if v.get("client")}
        rows = []
        for c in self.clients:
            row = {k: c.get(k) for k in ("id", "role", "pid", "client", "died", "exit", "exited_s",
                                         "stalled", "new_pid", "back_s", "next_beat_s", "survived")}
            row["before"] = list(c["before"]) if c.get("before") else None
            if c.get("phases") and c.get("new_pid"):
                try:
                    row["first_phases"] = first_phases(c["phases"].read_text(), c["new_pid"], t0)
                except OSError:
                    row["first_phases"] = {}
            if c.get("died"):
                row["downtime_s"] = c.get("back_s")  # None: not recovered
            else:
                row["downtime_s"] = c.get("next_beat_s")
            if self.train_checkpoint and c["role"] == "train" and c.get("new_pid") and row["before"]:
                try:
                    log = (self.dir / f"client{c['id']}.log").read_text(errors="replace")
                except OSError:
                    log = ""
                row.update(work_lost(c, log, self.r.get("rates"),
                                     self.r.get("lost_recorded", {}).get(c.get("client"))))
            rows.append(row)
        self.r["clients"] = rows
        if self.bystander:
            try:
                beats = [float(x) for x in self.beats_file.read_text().split()]
            except (OSError, ValueError):
                beats = []
            self.r["bystander"] = bystander_stall(beats, t0)
            if self.r["bystander"]:
                self.r["bystander"]["kind"] = self.bystander
        died = [c for c in rows if c["died"]]
        self.r["clients_died"] = len(died)
        downs = [c["downtime_s"] for c in died]
        self.r["victims_recovered"] = sum(1 for d in downs if d is not None)
        rec = [d for d in downs if d is not None]
        self.r["downtime_median_s"] = statistics.median(rec) if rec else None
        self.r["downtime_max_s"] = max(rec) if rec and len(rec) == len(downs) else None

    def steps(self) -> None:
        self.start_stock() if self.mode == "stock" else self.start_supervised()
        self.start_clients()
        if self.mode in STANDBYS:
            self.wait_standbys()
            if self.train_checkpoint and self.standby_refresh:
                self.wait_standby_from_checkpoint()
                self.wait_standbys()
        if self.bystander:
            self.start_bystander()
        self.sample_rates()
        if self.kernel_waits:
            self.start_sampler()
        self.fault()
        self.observe()
        if self.sampler is not None:
            self.sampler.stop()
            self.r["kernel_waits"] = self.sampler.waits(since=self.t_fault, every="standby")
            self.r["kernel_wait_samples"] = self.sampler.samples
        self.summarize()

    def start_sampler(self) -> None:
        """--kernel-waits: the clients', their standbys', the MPS servers', the supervisor's
        (its tracker closer: the close of an exited client's VA space) and, once started,
        the faulter's threads, where they wait in the kernel from just before the fault
        (bench/kwait.py)."""
        pids = {p: "mps-server" for p in procs.all_pids() if is_server(p)}
        if self.r.get("supervisor_pid"):
            pids[int(self.r["supervisor_pid"])] = "supervisor"
        for c in self.clients:
            if c.get("pid"):
                pids[int(c["pid"])] = f"client {c.get('client') or c['id']}"
        for cid, p in self.standby_of.items():
            if p:
                pids[int(p)] = f"standby {cid}"
        self.sampler = WaitSampler(pids)
        self.sampler.start()

    def run(self) -> dict[str, Any]:
        """steps(), its failure recorded and everything it started cleaned up whatever happens."""
        t_start = time.monotonic()
        try:
            self.steps()
        except ScenarioFailed as exc:
            self.r["error"] = str(exc)
            log(f"{self.mode} N={self.n} {self.kind}: FAILED: {exc}")
        except Exception as exc:  # noqa: BLE001 - record, clean up, go on with the next
            self.r["error"] = f"{type(exc).__name__}: {exc}"
            log(f"{self.mode} N={self.n} {self.kind}: FAILED: {self.r['error']}")
        finally:
            try:
                self.stop()
            except Exception as exc:  # noqa: BLE001
                self.note(f"cleanup: {type(exc).__name__}: {exc}")
                sweep(self.marker)
        self.r["wall_s"] = time.monotonic() - t_start
        return self.r


def cost_estimate(without: list[float], with_: list[float]) -> dict[str, Any]:
    """The cost of standbys from paired rounds of the clients' total rates (iterations per
    second, all clients together) without and with them: the time per iteration's mean
    difference over its mean without, with its 95% interval."""
    return rounds_overhead([1 / r for r in without], [1 / r for r in with_])


COST_SETTLE_S = 2.0  # before each window: 8 rounds without it ran at -2.5 ± 9.9% (H100)


class CostRun(Scenario):
    """Rounds of windows with and without every client's standby waiting (module doc)."""

    def __init__(self, mode: str, n: int, rounds: int, window: float, limit: float, workdir: Path,
                 gpu: dict, size: int):
        super().__init__(mode, n, "cost", limit, workdir, gpu, size, sample_s=window)
        self.rounds = rounds

    def set_policy(self, policy: str) -> None:
        for c in self.clients:
            code, out = run_bounded(gpuos_cmd("mps", "policy", "set", "--client", c["client"], policy,
                                              "--json"), self.env, 30, self.dir / "policy.out")
            if code != 0:
                raise ScenarioFailed(f"gpuos mps policy set {policy}: exit {code}: {out.strip()[-300:]}")

    def standbys_gone(self) -> None:
        deadline = time.monotonic() + min(30, self.left())
        while time.monotonic() < deadline:
            code, out = run_bounded(gpuos_cmd("mps", "clients", "--json"), self.env, 30,
                                    self.dir / "clients.out")
            rows = (last_json_object(out) or {}).get("clients", [])
            if code == 0 and not any(r.get("standby_pid") for r in rows if r.get("id")):
                time.sleep(1.0)  # their teardown's GPU work done
                return
            time.sleep(0.3)
        raise ScenarioFailed("the standbys were not stopped in time")

    def window(self, standbys: bool) -> float:
        if standbys:
            self.set_policy("standby")
            self.wait_standbys()
        else:
            self.set_policy("restart")
            self.standbys_gone()
        time.sleep(COST_SETTLE_S)  # a standby's start (or teardown) is not its waiting
        self.sample_rates()
        rates = self.r["rates"]
        if any(r is None for r in rates):
            raise ScenarioFailed(f"a client restarted or stalled during a window: {rates}")
        return sum(rates)

    def steps(self) -> None:
        without: list[float] = []
        with_: list[float] = []
        self.start_supervised()
        self.start_clients()
        for i in range(self.rounds):
            if self.left() < 4 * self.sample_s + 60:
                self.note(f"stopped after {i} rounds: the time limit")
                break
            for standbys in ((False, True) if i % 2 == 0 else (True, False)):
                (with_ if standbys else without).append(self.window(standbys))
        self.r.update({"window_s": self.sample_s, "without": without, "with": with_,
                       **cost_estimate(without, with_)})
        self.r.pop("rates", None)
        self.r.pop("rate_median", None)


def _syscall(pid: int) -> str | None:
    """The number of the system call pid is blocked in (/proc/PID/syscall), or None."""
    try:
        return Path(f"/proc/{pid}/syscall").read_text().split()[0]
    except (OSError, IndexError):
        return None


def _alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        st = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return st.rsplit(")", 1)[1].split()[0] != "Z"


# -- host, results, table ------------------------------------------------------------------------

def host_info() -> dict[str, Any]:
    from gpuos.mps.gpu import find_nvidia_smi

    info: dict[str, Any] = {"device": "unknown", "driver": "unknown", "uuid": None}
    smi = find_nvidia_smi()
    if smi:
        try:
            out = subprocess.run([str(smi), "-i", "0", "--query-gpu=name,driver_version,uuid,compute_mode",
                                  "--format=csv,noheader"], capture_output=True, text=True,
                                 timeout=30).stdout.strip()
            name, driver, uuid, cmode = [s.strip() for s in out.splitlines()[0].split(",")]
            info.update(device=name, driver=driver, uuid=uuid, compute_mode=cmode)
        except (subprocess.TimeoutExpired, OSError, ValueError, IndexError):
            pass
    info.update(gpuos=__version__, host={"hostname": socket.gethostname(), "kernel": platform.release(),
                                         "cpus": os.cpu_count(), "python": platform.python_version(),
                                         "euid": os.geteuid()})
    return info


def short_name(device: str) -> str:
    return device.removeprefix("NVIDIA ").split()[0]


def key(mode: str, n: int, kind: str) -> str:
    return f"{mode}/{n}/{kind}"


def fmt_s(v: float | None) -> str:
    return "—" if v is None else f"{v:.2f}"


def markdown(r: dict[str, Any]) -> str:
    lines = [f"{r['device']}, driver {r['driver']}, gpuos {r['gpuos']}, {r['date'][:10]}; N clients "
             "(N-1 inference loops, 1 training loop) plus the faulting injector as one more MPS client; "
             "times in seconds from the fault. Detection: first Xid event of `gpuos faults watch` "
             "(modes under gpuos mps: / the supervisor's first fault event). Server back: first probe "
             "client that succeeds. Downtime: fault to a victim's first iteration of its new run. "
             "Fault-free rate: the median client's iterations per second before the fault."
             + (" **Smoke run (--quick).**" if r.get("quick") else "")]
    if r["scenarios"]:  # none: a --cost-rounds run alone
        lines += ["", "| mode | N | kind | clients died | detection s | server back s "
                  "| victim downtime median / max s | fault-free rate, it/s | notes |",
                  "|---|---|---|---|---|---|---|---|---|"]
    order = {m: i for i, m in enumerate(MODES)}
    for k in sorted(r["scenarios"], key=lambda k: (int(k.split("/")[1]), k.split("/")[2],
                                                    order.get(k.split("/")[0], 2))):
        s = r["scenarios"][k]
        if "error" in s:
            why = " ".join(s["error"].split())  # one line: errors may quote JSON
            lines.append(f"| {s['mode']} | {s['n']} | {s['kind']} | — | — | — | — | — | failed: "
                         f"{why[:160].replace('|', '/')} |")
            continue
        det = fmt_s(s.get("detect_s"))
        if s["mode"] in POLICY:
            det += f" / {fmt_s(s.get('supervisor_detect_s'))}"
        died, rec = s["clients_died"], s["victims_recovered"]
        if died == 0:
            down = "no victims"
        elif rec == 0:
            down = "not recovered"
        else:
            down = f"{fmt_s(s['downtime_median_s'])} / {fmt_s(s['downtime_max_s'])}"
            if rec < died:
                down += f" ({died - rec} not recovered)"
        notes = "; ".join(s.get("notes", []))[:120].replace("|", "/")
        if s["mode"] in POLICY:
            what = f"incident {s['incident_outcome']}" if s.get("incident_outcome") else (
                "no incident" if s.get("incident_opened_s") is None else "incident not closed")
            if s["mode"] in STANDBYS and died:
                what += f"; {s.get('took_over', 0)}/{died} taken over by standbys"
                if s.get("released_s") is not None:
                    what += f", released at {fmt_s(s['released_s'])}"
                if s.get("reaped_s") is not None:
                    what += f", victims reaped by {fmt_s(s['reaped_s'])}"
            if died and "faulter_named_s" in s and s.get("incident_opened_s") is not None:
                what += ("; faulter not named by the supervisor" if s.get("faulter_named_s") is None
                         else f"; faulter named at {fmt_s(s['faulter_named_s'])}")
            by = s.get("bystander")
            if by:
                what += (f"; {by.get('kind', 'warm')} bystander on the spare stalled {fmt_s(by['stall_s'])} "
                         f"({fmt_s(by['from_s'])} to {fmt_s(by['to_s'])}; "
                         f"usually {by['usual_s'] * 1e3:.1f} ms)")
            ph = next((c for c in reversed(s.get("clients", [])) if c.get("first_phases")), None)
            if ph:
                what += (f"; the {ph['role']} victim's new first iteration: "
                         + ", ".join(f"{k} {fmt_s(v)}" for k, v in ph["first_phases"].items()
                                     if not k.startswith("layer")))
            lw = next((c for c in s.get("clients", []) if "lost_iterations" in c), None)
            if lw:
                what += (f"; the train victim lost {lw['lost_iterations']} iterations "
                         f"({fmt_s(lw['lost_measured_s'])} s; recorded {fmt_s(lw['lost_recorded_s'])} s "
                         f"since its {lw['resumes_from_recorded']})")
            shared = [p["memory_shared"] for p in s.get("preloads", []) if p.get("released") and p.get("memory_shared")]
            if shared:  # --share-standby-memory: what the standbys mapped of their clients'
                held = sum(memory_still_shared(x) for x in shared)
                what += (f"; standbys shared {held / 2**20:.0f} MiB of their clients' memory after the "
                         f"release, checks {max(x['check_seconds'] for x in shared):.2f} s at most")
                ends = [x["check_started_at"] + x["check_seconds"] - s["t_fault"] for x in shared
                        if x.get("check_started_at") and s.get("t_fault")]
                if ends:  # (results from before 2026-11-28's last lease do not say)
                    what += f", the last ending {max(ends):.2f} s after the fault"
            waited = standby_driver_wait(s)
            if waited:
                what += f"; {waited}"
            if s.get("slow_turns"):
                worst = max(s["slow_turns"], key=lambda t: t["seconds"] or 0)
                top = next(iter(worst.get("parts") or {}), "?")
                what += f"; slowest supervisor turn {fmt_s(worst['seconds'])} ({top})"
            notes = what + (f"; {notes}" if notes else "")
        rate = "—" if s.get("rate_median") is None else f"{s['rate_median']:.0f}"
        back = fmt_s(s.get("server_back_s")) if died else "never down"
        lines.append(f"| {s['mode']} | {s['n']} | {s['kind']} | {died}/{s['n']} | {det} | "
                     f"{back} | {down} | {rate} | {notes} |")
    costs = [f"\nFault-free cost of the standbys, {k.replace('/', ' N = ')}: "
             + (f"failed: {' '.join(c['error'].split())[:160]}" if "error" in c else
                f"{c['overhead_pct']:+.2f} ± {c['ci95_pct']:.2f}% in time per iteration over {c['rounds']} "
                f"rounds of {c['window_s']:g} s windows")
             for k, c in sorted(r.get("cost", {}).items()) if "error" in c or "overhead_pct" in c]
    return "\n".join(lines + [f"\n{n}" for n in r.get("notes", [])] + costs)


def standby_driver_wait(s: dict) -> str:
    """With --kernel-waits: the released standbys' longest wait in an NVIDIA ioctl that
    began after their release (what it asked), beside when the faulter's process was gone
    (after a fault the driver's lock is held by its teardown), and how many standbys had
    the printf buffer made while they waited (preload.c); "" without samples."""
    rel = s.get("released_s")
    waits = [w for w in s.get("kernel_waits") or [] if w.get("role", "").startswith("standby")
             and w.get("call") == "ioctl" and w.get("file", "").startswith("/dev/nvidia")
             and rel is not None and w["to_s"] >= rel]
    if not waits:
        return ""
    w = max(waits, key=lambda w: w["to_s"] - max(w["from_s"], rel))
    out = (f"standbys' longest driver wait after the release {w['to_s'] - max(w['from_s'], rel):.2f} s "
           f"({w.get('arg') or w['file']}, until {w['to_s']:.2f})")
    gone = (s.get("faulter") or {}).get("process_gone_s")
    if gone is not None:
        out += f", the faulter gone at {gone:.2f}"
    made = [p.get("printf_buffer_made") for p in s.get("preloads", []) if p.get("released")]
    if any(x is not None for x in made):
        out += f", printf buffer made ahead in {sum(x is True for x in made)}/{len(made)}"
    return out


def update_readme(table: str, source: Path) -> None:
    log(f"updated {readme_table.update_readme('mps-faults', table, source)}")


def default_scratch() -> str:
    """/dev/shm (memory) where this user can write there, else /tmp."""
    return "/dev/shm" if os.access("/dev/shm", os.W_OK | os.X_OK) else "/tmp"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", default="2,4,8", help="Numbers of co-running clients [2,4,8].")
    ap.add_argument("--kinds", default=",".join(FAULT_KINDS),
                    help=f"Fault kinds [{','.join(FAULT_KINDS)}].")
    ap.add_argument("--modes", default=",".join(MODES), help=f"[{','.join(MODES)}]")
    ap.add_argument("--size", type=int, default=1024, help="The clients' MLP width [1024].")
    ap.add_argument("--budget", type=float, default=540, help="Seconds for the whole benchmark [540].")
    ap.add_argument("--scenario-timeout", type=float, default=150, help="Seconds for one scenario [150].")
    ap.add_argument("--sample", type=float, default=3.0, metavar="S",
                    help="Seconds over which the clients' fault-free rate is taken [3]: 3 s "
                         "shows differences of about 20%%, not 1%%.")
    ap.add_argument("--bystander", choices=("warm", "alloc", "copy", "module"), default="",
                    help="Spare modes: one more inference loop on the spare server, its iterations "
                         "logged; alloc: each iteration allocates from the driver; copy: copies "
                         "its inputs in; module: loads a new module and runs its kernel "
                         "(Scenario.start_bystander).")
    ap.add_argument("--phases", action="store_true",
                    help="The clients write down when each phase of a process's first iterations "
                         "ended (mps_client --phases): where a recovered victim's first iteration "
                         "went, per client in the JSON (first_phases), the last one's in the notes.")
    ap.add_argument("--kernel-waits", action="store_true",
                    help="Sample where the clients', standbys' and MPS servers' threads wait in the "
                         "kernel (/proc stacks, every few ms, as root) from just before the fault; "
                         "waits of 20 ms or more in the JSON, and each of a standby's in the first second "
                         "(kernel_waits; bench/kwait.py).")
    ap.add_argument("--faulter", choices=("bench", "client"), default="bench",
                    help="Who starts the injector: the benchmark, as one more MPS client the "
                         "supervisor does not manage [bench]; or (client) `gpuos mps run "
                         "--policy none`, one of the supervisor's clients, its CUDA process a "
                         "child of the client's (modes under gpuos mps; stock: bench).")
    ap.add_argument("--no-fault-trackers", action="store_true",
                    help="Modes under gpuos mps: start the supervisor with --no-fault-trackers "
                         "(no UVM tracker on any client's address space: the faulter goes unnamed; "
                         "to see what the trackers cost a fault's teardown).")
    ap.add_argument("--train-checkpoint", type=float, default=0.0, metavar="S",
                    help="The training client saves its progress every S seconds and resumes from "
                         "it at its start (`gpuos mps run --checkpoint`); its victim's work lost is "
                         "measured and set beside the incident record's [0: off].")
    ap.add_argument("--share-standby-memory", action="store_true",
                    help="Spare modes: `gpuos mps start --share-standby-memory` (warm standbys map "
                         "their clients' start-up memory); each client's and standby's GPU memory is "
                         "recorded either way.")
    ap.add_argument("--standby-refresh", type=float, default=0.0, metavar="S",
                    help="Modes under gpuos mps: `gpuos mps start --standby-refresh S`; with "
                         "--train-checkpoint and standbys, the fault waits until the training client's "
                         "standby is one started from a checkpoint [0: the supervisor's default].")
    ap.add_argument("--scratch", default=default_scratch(), metavar="DIR",
                    help="Where the run's files go: MPS pipes and logs, and the clients' heartbeats "
                         "and phase marks, written at every iteration [/dev/shm where writable, "
                         "else /tmp]. On a disk those writes stalled clients: on the H200 host, "
                         "renames waited 15-50 ms on block discards after a fault.")
    ap.add_argument("--quick", action="store_true", help="Smoke run: N=2, oob-write and trap.")
    ap.add_argument("--cost-rounds", type=int, default=0, metavar="R",
                    help="No faults: R rounds of the fault-free cost of standbys per standby mode "
                         "and N (module doc) [0: off].")
    ap.add_argument("--cost-window", type=float, default=5.0, metavar="S",
                    help="Seconds of each window of --cost-rounds [5].")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--update-readme", action="store_true", help="Rewrite README.md's table.")
    ap.add_argument("--readme-from", metavar="JSON",
                    help="Only rewrite README.md's table from this result (no GPU needed).")
    a = ap.parse_args()
    if a.readme_from:
        src = Path(a.readme_from).resolve()
        update_readme(markdown(json.loads(src.read_text())), src)
        return
    if a.quick:
        a.n, a.kinds = "2", "oob-write,trap"
    ns = [int(x) for x in a.n.split(",")]
    kinds, modes = a.kinds.split(","), a.modes.split(",")
    bad = set(kinds) - set(FAULT_KINDS)
    if bad:
        ap.error(f"unknown kinds: {', '.join(sorted(bad))} (have: {', '.join(FAULT_KINDS)})")
    if set(modes) - set(MODES):
        ap.error(f"--modes: some of {', '.join(MODES)}")
    if any(n < 1 for n in ns):
        ap.error("--n: at least 1 client")
    try:
        inj.inject_binary()
    except inj.InjectorMissing as exc:
        sys.exit(f"mps_faults: {exc}")
    budget_end = time.monotonic() + a.budget
    result: dict[str, Any] = {
        "benchmark": "mps_faults",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        **host_info(), "quick": a.quick, "client_size": a.size, "fault_trackers": not a.no_fault_trackers, "standby_cublas_warm_up": os.environ.get("GPUOS_MPS_STANDBY_CUBLAS") != "0", "scratch": a.scratch, "scenarios": {}, "notes": [],
    }
    path = Path(a.out).resolve() / f"mps-faults-{short_name(result['device'])}-{result['date'][:10]}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():  # an earlier part of today's run: keep its scenarios and costs
        try:
            earlier = json.loads(path.read_text())
        except ValueError:
            earlier = {}
        result["scenarios"] = earlier.get("scenarios", {})
        if "cost" in earlier:
            result["cost"] = earlier["cost"]
    ran_failed = False
    tmp = Path(tempfile.mkdtemp(prefix="gmb-", dir=a.scratch))  # short: MPS socket paths are limited
    if a.cost_rounds:
        try:
            result.setdefault("cost", {})
            for i, (n, mode) in enumerate((n, m) for n in ns for m in modes if m in STANDBYS):
                left = budget_end - time.monotonic()
                log(f"cost {mode} N={n}: starting ({left:.0f} s of budget left)")
                c = CostRun(mode, n, a.cost_rounds, a.cost_window, left, tmp / f"c{i}", result,
                            a.size).run()
                result["cost"][f"{mode}/{n}"] = c
                ran_failed |= "error" in c
                if "error" not in c and "overhead_pct" in c:
                    log(f"cost {mode} N={n}: {c['overhead_pct']:+.2f} ± {c['ci95_pct']:.2f}% "
                        f"over {c['rounds']} rounds")
                path.write_text(json.dumps(result, indent=2, default=str) + "\n")
        finally:
            if not ran_failed:
                shutil.rmtree(tmp, ignore_errors=True)
        log(f"wrote {path}")
        return
    try:
        i = 0
        for n in ns:
            for kind in kinds:
                for mode in modes:
                    left = budget_end - time.monotonic()
                    if left < MIN_SCENARIO_S:
                        note = f"{key(mode, n, kind)}: skipped, the {a.budget:.0f} s budget was spent"
                        result["notes"].append(note)
                        log(note)
                        continue
                    log(f"{mode} N={n} {kind}: starting ({left:.0f} s of budget left)")
                    i += 1
                    s = Scenario(mode, n, kind, min(a.scenario_timeout, left), tmp / f"s{i}",
                                 result, a.size, a.sample, a.bystander, a.phases,
                                 a.kernel_waits, a.faulter, not a.no_fault_trackers,
                                 a.train_checkpoint, a.standby_refresh, a.share_standby_memory).run()
                    result["scenarios"][key(mode, n, kind)] = s
                    ran_failed |= "error" in s
                    if "error" not in s:
                        log(f"{mode} N={n} {kind}: died {s['clients_died']}/{n}, detect "
                            f"{fmt_s(s.get('detect_s'))} s, server back {fmt_s(s.get('server_back_s'))} s, "
                            f"recovered {s['victims_recovered']}, downtime max {fmt_s(s.get('downtime_max_s'))} s")
                    path.write_text(json.dumps(result, indent=2, default=str) + "\n")
    finally:
        if ran_failed:
            log(f"logs of the scenarios kept in {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    path.write_text(json.dumps(result, indent=2, default=str) + "\n")
    log(f"wrote {path}")
    table = markdown(result)
    print(table)
    if a.update_readme:
        update_readme(table, path)
    sys.exit(1 if ran_failed else 0)


if __name__ == "__main__":
    main()
