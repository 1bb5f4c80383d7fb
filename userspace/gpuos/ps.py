"""The GPU processes on this host, with their checkpoint state.

NVML lists processes with a context on a GPU; a process that is checkpointed
holds none, so /proc is also searched for processes with the CUDA driver
mapped, and the driver's checkpoint API gives each one's state.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from . import procs
from .cudadrv import UNINITIALIZED, GpuDriver
from .errors import GpuosError


@dataclass
class GpuProcessRow:
    pid: int
    command: str
    gpu_memory: int  # bytes, summed over GPUs
    gpus: list[str]  # UUIDs
    state: str  # running | locked | checkpointed | failed | cpu (libcuda loaded, CUDA never
    #             initialized: CRIU alone saves it) | unknown (with why)


def cuda_pids() -> list[int]:
    pids = []
    for pid in procs.all_pids():
        try:
            if procs.uses_cuda(pid):
                pids.append(pid)
        except GpuosError:  # gone, or not ours to read
            continue
    return pids


def gpu_processes(driver: GpuDriver) -> list[GpuProcessRow]:
    usage: dict[int, list[tuple[str, int]]] = {}
    for gp in driver.processes():
        usage.setdefault(gp.pid, []).append((gp.uuid, gp.used_memory))
    rows = []
    me = os.getpid()
    for pid in sorted(set(usage) | set(cuda_pids())):
        if pid == me:
            continue
        try:
            command = " ".join(procs.cmdline(pid)) or f"[{procs.stat(pid).comm}]"
        except GpuosError:
            continue
        try:
            if procs.stat(pid).state == "T":  # the driver would wait for its restore thread
                state = "stopped (`gpuos recover` resumes one gpuos left stopped)"
            else:
                state = driver.state(pid)
            if state == UNINITIALIZED:
                state = "cpu"
        except GpuosError as exc:
            state = f"unknown ({exc.message})"
        used = usage.get(pid, [])
        rows.append(GpuProcessRow(pid=pid, command=command, gpu_memory=sum(m for _, m in used),
                                  gpus=sorted({u for u, _ in used}), state=state))
    return rows
