#!/usr/bin/env python3
"""What a CUDA feature the driver's checkpoint cannot save looks like from outside (GPU host, root).

    tools/probes/features_probe.py OUTDIR [CASE...]

For each case a small program runs; the probe writes its /proc maps lines that name a
device or driver file, its fd targets, NVML's view, and what lock / checkpoint /
restore / unlock answer, to OUTDIR/features.json.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from gpuos.cudadrv import CudaDriver
from gpuos.errors import GpuosError

PY = sys.executable
CASES = {
    "plain": "import torch,time; x=torch.ones(1<<20,device='cuda'); torch.cuda.synchronize(); print('ready',flush=True); time.sleep(600)",
    "managed": ("import time\n"
                "from cuda.bindings import runtime as rt\n"
                "err,p=rt.cudaMallocManaged(64<<20, rt.cudaMemAttachGlobal); assert err==0, err\n"
                "rt.cudaMemset(p,1,64<<20); rt.cudaDeviceSynchronize()\n"
                "print('ready',flush=True); time.sleep(600)"),
    "nccl1": ("import os,time,torch,torch.distributed as dist\n"
              "os.environ.update(MASTER_ADDR='127.0.0.1',MASTER_PORT='29533')\n"
              "dist.init_process_group('nccl',rank=0,world_size=1)\n"
              "x=torch.ones(1<<20,device='cuda'); dist.all_reduce(x); torch.cuda.synchronize()\n"
              "print('ready',flush=True); time.sleep(600)"),
    "ipc": ("import time,torch,torch.multiprocessing as mp\n"
            "def child(q,e):\n"
            "    t=q.get(); s=float(t.sum()); print('child got',s,flush=True); e.wait()\n"
            "if __name__=='__main__':\n"
            "    ctx=mp.get_context('spawn'); q=ctx.Queue(); e=ctx.Event()\n"
            "    x=torch.ones(1<<20,device='cuda'); p=ctx.Process(target=child,args=(q,e)); p.start(); q.put(x)\n"
            "    time.sleep(8); print('ready',p.pid,flush=True); time.sleep(600)"),
    "forked": ("import os,time,torch\n"
               "x=torch.ones(1<<20,device='cuda'); h=torch.ones(1<<20).pin_memory(); torch.cuda.synchronize()\n"
               "c=os.fork()\n"
               "if c==0: time.sleep(600); os._exit(0)\n"
               "print('ready',c,flush=True); time.sleep(600)"),
    "cupy_pool": ("import cupy,time; cupy.cuda.set_allocator(cupy.cuda.MemoryAsyncPool().malloc)\n"
                  "x=cupy.ones(1<<20); cupy.cuda.Device().synchronize(); print('ready',flush=True); time.sleep(600)"),
}


def look(pid: int) -> dict:
    maps = []
    try:
        for line in open(f"/proc/{pid}/maps"):
            parts = line.split(None, 5)
            if len(parts) == 6 and ("/dev/" in parts[5] or "nvidia" in parts[5] or "memfd" in parts[5]
                                     or "shm" in parts[5]):
                maps.append(parts[5].strip())
    except OSError as exc:
        maps.append(str(exc))
    fds = []
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                fds.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
            except OSError:
                pass
    except OSError:
        pass
    count: dict[str, int] = {}
    for m in maps:
        count[m] = count.get(m, 0) + 1
    fdc: dict[str, int] = {}
    for f in fds:
        key = f if not f.startswith(("socket:", "pipe:", "anon_inode:[eventfd]")) else f.split("[")[0]
        fdc[key] = fdc.get(key, 0) + 1
    return {"maps": count, "fds": fdc}


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    drv = CudaDriver()
    results = {}
    for name, code in CASES.items():
        if sys.argv[2:] and name not in sys.argv[2:]:
            continue
        script = out / f"{name}.py"  # a file: spawned children re-import their functions from it
        script.write_text(code)
        proc = subprocess.Popen([PY, str(script)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
        lines = []
        t0 = time.monotonic()
        while time.monotonic() - t0 < 90:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line.strip())
            if line.startswith("ready"):
                break
        r: dict = {"output": lines[-5:]}
        pids = [proc.pid]
        if name in ("ipc", "forked") and lines and lines[-1].startswith("ready"):
            pids.append(int(lines[-1].split()[1]))
        for pid in pids:
            rr: dict = look(pid)
            try:
                rr["state"] = drv.state(pid)
            except GpuosError as exc:
                rr["state"] = exc.message
            steps = []
            try:
                for what, fn in (("lock", lambda: drv.lock(pid, 5000)), ("checkpoint", lambda: drv.checkpoint(pid)),
                                 ("restore", lambda: drv.restore(pid, {})), ("unlock", lambda: drv.unlock(pid))):
                    t = time.monotonic()
                    fn()
                    steps.append(f"{what} ok {time.monotonic() - t:.2f}s")
            except GpuosError as exc:
                steps.append(f"{what}: {exc.message}")
                try:
                    steps.append("state now " + drv.state(pid))
                except GpuosError as exc2:
                    steps.append("state now: " + exc2.message)
            rr["driver"] = steps
            r[str(pid)] = rr
        try:
            r["nvml_mps"] = [p.pid for d in range(drv.nvml.nvmlDeviceGetCount())
                             for p in drv.nvml.nvmlDeviceGetMPSComputeRunningProcesses(
                                 drv.nvml.nvmlDeviceGetHandleByIndex(d))]
        except Exception as exc:  # noqa: BLE001
            r["nvml_mps"] = repr(exc)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        results[name] = r
        print(name, json.dumps({k: v.get("driver") if isinstance(v, dict) else v for k, v in r.items()}), flush=True)
    (out / "features.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
