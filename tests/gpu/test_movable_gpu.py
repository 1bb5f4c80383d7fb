"""Movable memory on a real GPU: libgpuos's agent moves a running process's device memory.

t_agent (libgpuos/tests/t_agent.c, built here against the real libcuda) checks every byte
of its memory at every iteration; real workloads of the suite train while their memory
is captured, released and filled again, or handed out and mapped back, several times;
their results must be bit-identical to an uninterrupted run.  Timings of each move are
printed (pytest -s) and written to $GPUOS_MOVABLE_TIMINGS if set.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from gpu_needs import probe, torch_gpu_marks

from gpuos.movable import Agent, agent_available
from gpuos.workloads.run import last_json_object, private_caches, run, suite_cmd, under_gpuos


REPO = Path(__file__).resolve().parents[2]
CUDA_INC = next((p for p in ("/usr/local/cuda/include", *sorted(map(str, Path("/usr/local").glob("cuda-*/include"))))
                 if Path(p, "cuda.h").exists()), None)
# steps enough for several moves while it trains
WORKLOADS = {
    "gpt-train": ["--layers", "4", "--seq", "256", "--steps", "400", "--warmup", "1"],
    "resnet50-train": ["--batch", "8", "--steps", "300", "--warmup", "1"],
    "cupy": ["--size", "512", "--steps", "40000", "--warmup", "1"],
}


pytestmark = torch_gpu_marks()


def record(what: str, **timings) -> None:
    line = json.dumps({"what": what, **timings})
    print(line)
    path = os.environ.get("GPUOS_MOVABLE_TIMINGS")
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")


def memfd(size: int) -> int:
    fd = os.memfd_create("gpuos-test-capture")
    os.ftruncate(fd, max(size, 1))
    return fd


def cycle_fill(ag: Agent, what: str) -> None:
    """PREPARE a staging memfd (while it runs), HOLD, CAPTURE, RELEASE (nobody holds the
    memory), FILL new memory, RESUME, UNPREPARE. A program still growing may outgrow the
    staging area between PREPARE and HOLD: then, as handout.py does, a larger one is
    prepared while it is held."""
    n, nbytes = ag.hold()  # the size now; the staging area gets room to grow
    ag.resume()
    size = nbytes * 2 + (256 << 20)
    fd = memfd(size)
    try:
        t = time.perf_counter()
        os.posix_fallocate(fd, 0, size)
        populate_s = time.perf_counter() - t
        prep = ag.prepare(fd, size)
        t0 = time.perf_counter()
        n, nbytes = ag.hold()
        t_hold = time.perf_counter() - t0
        if nbytes > size:
            os.close(fd)
            size = nbytes
            fd = memfd(size)
            prep = ag.prepare(fd, size)
        cap = ag.capture()
        ag.release()
        fill = ag.fill()
        ag.resume()
        stopped = time.perf_counter() - t0
        ag.unprepare()
    finally:
        os.close(fd)
    record(what, move="capture-release-fill", allocations=n, bytes=nbytes, populate_s=round(populate_s, 3),
           prepare_s=round(prep.ns / 1e9, 3), registered=bool(prep.arg), hold_s=round(t_hold, 4),
           capture_gbps=round(nbytes / max(cap.ns, 1), 2), fill_gbps=round(nbytes / max(fill.ns, 1), 2),
           stopped_s=round(stopped, 3))


def cycle_handout(ag: Agent, what: str) -> None:
    """HOLD, EXPORT, RELEASE (only this process's fds keep the memory), MAP back, RESUME."""
    t0 = time.perf_counter()
    n, nbytes = ag.hold()
    fds = ag.export()
    try:
        ag.release()
        t1 = time.perf_counter()
        ag.map(fds)
        t_map = time.perf_counter() - t1
    finally:
        for fd in fds:
            os.close(fd)
    ag.resume()
    record(what, move="export-release-map", allocations=n, bytes=nbytes, map_s=round(t_map, 4),
           stopped_s=round(time.perf_counter() - t0, 3))


def children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


def wait_for_agent_with_memory(run_pid: int, deadline: float) -> int:
    """The pid of the process under `gpuos run` once it serves the agent and holds movable memory."""
    while time.monotonic() < deadline:
        for pid in children(run_pid):
            if agent_available(pid):
                with Agent(pid) as ag:
                    n, _ = ag.hold()
                    ag.resume()
                if n:
                    return pid
        time.sleep(0.2)
    raise AssertionError("the workload never held movable memory under an agent")


@pytest.mark.skipif(CUDA_INC is None or shutil.which("gcc") is None, reason="needs gcc and cuda.h")
def test_t_agent_memory_moves_on_the_gpu(tmp_path):
    exe = tmp_path / "t_agent"
    subprocess.run(["gcc", "-O2", f"-I{CUDA_INC}", str(REPO / "libgpuos/tests/t_agent.c"), "-o", str(exe), "-lcuda"],
                   check=True)
    stop = tmp_path / "stop"
    proc = subprocess.Popen(under_gpuos([str(exe), str(stop), "5"], "-q"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline().split()
        assert line and line[0] == "ready", proc.stderr.read()
        pid = int(line[1])
        with Agent(pid) as ag:
            for _ in range(2):
                cycle_fill(ag, "t_agent")
                cycle_handout(ag, "t_agent")
        stop.touch()
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0 and out.split()[0] == "ok", err
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.parametrize("workload", list(WORKLOADS))
def test_a_workload_trains_on_while_its_memory_moves(workload, tmp_path):
    """Three moves of each kind while it trains; the result is the uninterrupted run's."""
    if workload == "cupy" and probe("import cupy; cupy.cuda.runtime.getDeviceCount()"):
        pytest.skip("needs CuPy")
    env = dict(os.environ, **private_caches(tmp_path / "cache"))
    cmd = suite_cmd(workload, WORKLOADS[workload])
    plain = run(cmd, 280, env)
    assert plain.returncode == 0, plain.describe()
    proc = subprocess.Popen(under_gpuos(cmd, "-q"), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)
    try:
        pid = wait_for_agent_with_memory(proc.pid, time.monotonic() + 120)
        moves = 0
        with Agent(pid) as ag:
            for _ in range(3):
                cycle_fill(ag, workload)
                time.sleep(0.3)
                cycle_handout(ag, workload)
                time.sleep(0.3)
                moves += 2
                if proc.poll() is not None:
                    break
        out, err = proc.communicate(timeout=280)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    assert moves >= 2, "the workload ended before its memory was moved: give it more steps"
    assert last_json_object(out)["checksum"] == plain.result()["checksum"]


def test_two_gpus_of_one_process_copy_between_their_movable_memory(tmp_path):
    """PyTorch copies between two GPUs: movable memory must be reachable from the peer
    (measured on 2 x H200 before gpuos gave peers access: the copy failed)."""
    if probe("import torch; assert torch.cuda.device_count() >= 2, 'one GPU'"):
        pytest.skip("needs two GPUs")
    prog = [sys.executable, str(REPO / "tests/gpu/programs/two_gpus.py")]
    plain = subprocess.run(prog, capture_output=True, text=True, timeout=200)
    assert plain.returncode == 0, plain.stderr[-2000:]
    moved = subprocess.run(under_gpuos(prog, "-q"), capture_output=True, text=True, timeout=200)
    assert moved.returncode == 0, moved.stderr[-2000:]
    assert moved.stdout.split()[-1] == plain.stdout.split()[-1]
