#!/usr/bin/env python3
"""What does a warm standby still pay after its release?  (issue 20, fast restart; GPU host.)

    python3 tools/probes/standby_release_probe.py [--modes infer,train] [--out FILE.json]

WHY
  With a spare server (`gpuos mps start --spare-server`) a standby waits at its first
  kernel launch (libgpuos, GPUOS_MPS_STANDBY_AT=launch): context made, weights copied in.
  Measured on an H200, its first iteration after the release still took 0.3-0.6 s of
  the victims' downtime.  What part is the standby's own start of GPU work (kernels
  loaded at their first launch, cuBLAS's handle and workspace), and what part the GPU
  busy with the faulted server?  This probe releases standbys with no fault anywhere.

WHAT IT DOES
  For each mode (the benchmark's clients: python -m gpuos.workloads.mps_client) and each
  module-loading setting (CUDA_MODULE_LOADING lazy, the default, and eager): start the
  client under libgpuos as a warm standby, no MPS; wait until it waits in openat(2) at
  its FIFO; read its GPU memory (NVML); release it; time the release to its first,
  second and tenth heartbeat.  Three repeats each.

Everything measured goes to the JSON.  Exit 0 when it ran, 1 when the setup failed.
Everything it started is killed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gpuos.intercept.runner import libgpuos_path
from gpuos.mps.standby import Releases
from gpuos.workloads.mps_client import read_heartbeat


def waiting(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/syscall").read_text().split()[:1] == ["257"]  # openat
    except OSError:
        return False


def gpu_memory(pid: int) -> int | None:
    try:
        import pynvml
        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h):
            if p.pid == pid:
                return p.usedGpuMemory
    except Exception:  # noqa: BLE001 - a probe: say nothing rather than fail
        return None
    return None


def one(mode: str, loading: str, d: Path) -> dict:
    fifo = d / f"standby-{mode}-{loading}"
    hb = d / f"hb-{mode}-{loading}"
    os.mkfifo(fifo, 0o600)
    env = dict(os.environ, LD_PRELOAD=str(libgpuos_path()), GPUOS_MPS_STANDBY=str(fifo),
               GPUOS_MPS_STANDBY_AT="launch", CUDA_MODULE_LOADING=loading.upper())
    env.pop("CUDA_MPS_PIPE_DIRECTORY", None)
    t_start = time.time()
    p = subprocess.Popen([sys.executable, "-m", "gpuos.workloads.mps_client", "--mode", mode,
                          "--heartbeat", str(hb), "--max-seconds", "60"], env=env,
                         stdout=subprocess.DEVNULL, stderr=open(d / f"err-{mode}-{loading}", "w"))
    r: dict = {"mode": mode, "loading": loading, "pid": p.pid}
    try:
        deadline = time.monotonic() + 90
        while not (waiting(p.pid) and (time.sleep(0.3) or waiting(p.pid))):
            if p.poll() is not None or time.monotonic() > deadline:
                r["error"] = f"never waited (exit {p.poll()})"
                return r
            time.sleep(0.1)
        r["to_wait_s"] = time.time() - t_start
        time.sleep(1.0)
        r["gpu_memory_held"] = gpu_memory(p.pid)
        releases = Releases()
        t_rel = time.time()
        releases.release(fifo)
        beats: dict[int, float] = {}
        deadline = time.monotonic() + 60
        while 10 not in beats and time.monotonic() < deadline and p.poll() is None:
            b = read_heartbeat(hb)
            if b and b[1] not in beats:
                beats[b[1]] = b[0]
            time.sleep(0.0005)
        releases.close()
        for it in (1, 2, 10):
            r[f"release_to_iter{it}_s"] = beats[it] - t_rel if it in beats else None
        r["gpu_memory_running"] = gpu_memory(p.pid)
    finally:
        p.kill()
        p.wait()
        fifo.unlink(missing_ok=True)
        hb.unlink(missing_ok=True)
    return r


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--modes", default="infer,train")
    ap.add_argument("--loadings", default="lazy,eager")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default="standby-release-probe.json")
    a = ap.parse_args()
    runs = []
    with tempfile.TemporaryDirectory(prefix="srp-") as tmp:
        for _ in range(a.repeat):
            for mode in a.modes.split(","):
                for loading in a.loadings.split(","):
                    r = one(mode, loading, Path(tmp))
                    print(json.dumps(r), flush=True)
                    runs.append(r)
    summary = {}
    for mode in a.modes.split(","):
        for loading in a.loadings.split(","):
            rs = [r for r in runs if r["mode"] == mode and r["loading"] == loading and "error" not in r]
            summary[f"{mode}/{loading}"] = {
                k: statistics.median(v) if (v := [r[k] for r in rs if r.get(k) is not None]) else None
                for k in ("release_to_iter1_s", "release_to_iter2_s", "release_to_iter10_s",
                          "gpu_memory_held", "to_wait_s")}
    out = {"probe": "standby-release", "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
           "device": _device(), "runs": runs, "summary": summary}
    Path(a.out).write_text(json.dumps(out, indent=1))
    print(json.dumps(summary, indent=1))
    return 0 if any("error" not in r for r in runs) else 1


def _device() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return "?"


if __name__ == "__main__":
    sys.exit(main())
