#!/usr/bin/env python3
"""Bisect what breaks the driver's restore of a process after a CRIU dump (GPU host, root).

    tools/probes/cr_probe.py OUTDIR [--program jax|torch] [--experiments E0,E1,...]

Each experiment starts a fresh copy of the program, waits for steps, then:
  E0  lock, checkpoint, sleep, restore, unlock                     (driver alone)
  E1  lock, checkpoint, criu dump --leave-running, restore, unlock (what gpuos does)
  E2  lock, checkpoint, ptrace seize+interrupt+detach every thread, restore, unlock
  E3  lock, checkpoint, criu dump (kill), criu restore, restore, unlock
and then checks the program makes 5 more steps. It writes, per experiment, the threads
(comm, /proc/TID/syscall, wchan) at each point, the driver's restore thread id, CRIU's
log and the program's output into OUTDIR/<program>-<E>/, and a summary line.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from gpuos.config import find_criu
from gpuos.criu import Criu
from gpuos.cudadrv import CudaDriver
from gpuos.errors import GpuosError
from gpuos.workloads import TORCHJOB, steps_done

HERE = Path(__file__).resolve().parent
PROGRAMS = {
    "jax": [sys.executable, str(HERE.parents[1] / "tests/gpu/programs/jax_train.py"),
            "--steps", "100000", "--step-sleep", "0.02"],
    "torch": [sys.executable, str(TORCHJOB), "--mode", "train", "--steps", "100000",
              "--step-sleep", "0.02"],
}

libc = ctypes.CDLL(None, use_errno=True)
PTRACE_SEIZE, PTRACE_INTERRUPT, PTRACE_DETACH = 0x4206, 0x4207, 17


def threads(pid: int) -> list[dict]:
    out = []
    for tid in sorted(int(t) for t in os.listdir(f"/proc/{pid}/task")):
        d = {"tid": tid}
        for key in ("comm", "syscall", "wchan"):
            try:
                d[key] = Path(f"/proc/{pid}/task/{tid}/{key}").read_text().strip()
            except OSError as exc:
                d[key] = f"<{exc.strerror}>"
        try:
            st = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
            d["state"] = st[0]
        except OSError:
            d["state"] = "?"
        out.append(d)
    return out


def restore_tid(drv: CudaDriver, pid: int):
    fn = getattr(drv.cu, "cuCheckpointProcessGetRestoreThreadId", None)
    if fn is None:
        return "no such call"
    err, tid = fn(pid)
    return tid if err == drv.cu.CUresult.CUDA_SUCCESS else getattr(err, "name", str(err))


def ptrace_pause_all(pid: int) -> list[str]:
    notes = []
    tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    for tid in tids:
        if libc.ptrace(PTRACE_SEIZE, tid, 0, 0) != 0:
            notes.append(f"seize {tid}: errno {ctypes.get_errno()}")
    for tid in tids:
        libc.ptrace(PTRACE_INTERRUPT, tid, 0, 0)
    for tid in tids:
        status = ctypes.c_int()
        libc.waitpid(tid, ctypes.byref(status), 0x40000000)  # __WALL
    time.sleep(0.5)
    for tid in tids:
        if libc.ptrace(PTRACE_DETACH, tid, 0, 0) != 0:
            notes.append(f"detach {tid}: errno {ctypes.get_errno()}")
    return notes


def run(program: str, exp: str, out: Path, criu: Criu) -> dict:
    d = out / f"{program}-{exp}"
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    log = d / "steps.log"
    with open(d / "program.out", "w") as f:
        proc = subprocess.Popen(PROGRAMS[program] + ["--log", str(log)], stdin=subprocess.DEVNULL,
                                stdout=f, stderr=subprocess.STDOUT, start_new_session=True, cwd=d)
    pid = proc.pid
    res: dict = {"program": program, "exp": exp, "pid": pid, "steps": {}}
    snaps: dict = {}
    t0 = time.monotonic()
    while steps_done(log) < 20:
        if proc.poll() is not None or time.monotonic() - t0 > 240:
            res["error"] = "program died or too slow before the experiment"
            return res
        time.sleep(0.05)
    drv = CudaDriver()
    snaps["before"] = threads(pid)
    res["restore_tid_before"] = restore_tid(drv, pid)
    try:
        drv.lock(pid, 10000)
        drv.checkpoint(pid)
        snaps["checkpointed"] = threads(pid)
        res["restore_tid_checkpointed"] = restore_tid(drv, pid)
        t = time.monotonic()
        if exp == "E0":
            time.sleep(5)
        elif exp == "E1":
            criu.dump(pid, d / "img", True, ["--file-locks", "--shell-job"])
        elif exp == "E2":
            res["ptrace_notes"] = ptrace_pause_all(pid)
        elif exp == "E3":
            criu.dump(pid, d / "img", False, ["--file-locks", "--shell-job"])
            proc.wait()
            (d / "work").mkdir()
            root, _ = criu.restore(d / "img", d / "work", ["--file-locks", "--shell-job"])
            res["restored_pid"] = root
        res["between_s"] = round(time.monotonic() - t, 2)
        snaps["after_dump"] = threads(pid)
        res["state_after_dump"] = drv.state(pid)
        res["restore_tid_after_dump"] = restore_tid(drv, pid)
        try:
            drv.restore(pid, {})
            drv.unlock(pid)
            res["resume"] = "ok"
        except GpuosError as exc:
            res["resume"] = exc.message
            try:
                res["state_after_fail"] = drv.state(pid)
            except GpuosError as exc2:
                res["state_after_fail"] = exc2.message
    except GpuosError as exc:
        res["error"] = exc.message
    at = steps_done(log)
    t = time.monotonic()
    while steps_done(log) < at + 5 and time.monotonic() - t < 30:
        if proc.poll() is not None and exp != "E3":
            break
        time.sleep(0.05)
    res["steps"] = {"at_resume": at, "after": steps_done(log)}
    res["progressed"] = steps_done(log) >= at + 5
    try:
        snaps["end"] = threads(pid)
    except OSError:
        pass
    res["exit"] = proc.poll()
    if exp != "E3" and proc.poll() is None:
        os.kill(pid, signal.SIGKILL)
        proc.wait()
    elif exp == "E3":
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    (d / "threads.json").write_text(json.dumps(snaps, indent=1))
    (d / "result.json").write_text(json.dumps(res, indent=1))
    if (d / "img").exists():
        for f in (d / "img").iterdir():
            if f.name.startswith("pages-"):
                f.unlink()
    return res


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out", type=Path)
    p.add_argument("--program", action="append")
    p.add_argument("--experiments", default="E0,E1,E2,E3")
    a = p.parse_args()
    criu = Criu(find_criu(), Path("/tmp/gpuos-criu-plugins"))
    for program in a.program or ["jax"]:
        for exp in a.experiments.split(","):
            r = run(program, exp, a.out, criu)
            print(json.dumps({k: r.get(k) for k in ("program", "exp", "resume", "progressed",
                                                     "between_s", "error", "exit",
                                                     "restore_tid_before", "restore_tid_after_dump")}),
                  flush=True)


if __name__ == "__main__":
    main()
