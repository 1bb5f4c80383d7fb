"""The C/R transparency matrix: every kind of GPU program checkpointed, killed, restored.

Each program runs once uninterrupted, then again: a third of the way in `gpuos
checkpoint` (which kills it), `gpuos restore`, and its step log must equal the
uninterrupted run's line for line (random inputs from a seed, results logged
exactly). Programs are in tests/gpu/programs/. Skipped cleanly without a GPU.
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

from gpuos.workloads import TORCHJOB, results, steps_done

from test_cr_gpu import _WHY, gpuos  # noqa: F401 - the same readiness check and CLI runner

pytestmark = [pytest.mark.gpu] + ([pytest.mark.skip(reason=_WHY)] if _WHY else [])

PROGRAMS = Path(__file__).with_name("programs")
STEPS = 45
PY = sys.executable


def matrix(mode: str) -> list[str]:
    return [PY, str(PROGRAMS / "matrix.py"), mode]


ROWS = {
    "cuda-runtime": None,  # built with nvcc below
    "driver-api-vmm": matrix("vmm"),
    "cupy": matrix("cupy-mix"),
    "torch-eager-train": [PY, str(TORCHJOB), "--mode", "train"],
    "torch-compile-train": matrix("torch-compile"),
    "cuda-graphs": matrix("cuda-graphs"),
    "hf-generate": matrix("hf-generate"),
    "jax-train": [PY, str(PROGRAMS / "jax_train.py")],
    "dataloader-workers": matrix("dataloader"),
    "threads-streams": matrix("threads-streams"),
    "two-gpu-processes": matrix("two-processes"),
    "hold-16gib": [PY, str(TORCHJOB), "--mode", "infer", "--hold-gib", "16", "--check-every", "10"],
}


# Seconds between steps of the paced run: two thirds of its steps must outlast the
# checkpoint (16 GiB under gpuos run: its preparation alone took 8 s on H100).
PACE = {"hold-16gib": 0.5, "torch-eager-train": 0.3}


def command(row: str, log: Path, sleep: float, workdir: Path) -> list[str]:
    if row == "cuda-runtime":
        exe = workdir / "cuda_runtime"
        if not exe.exists():
            nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
            subprocess.run([nvcc, "-O2", "-o", str(exe), str(PROGRAMS / "cuda_runtime.cu")], check=True)
        return [str(exe), str(log), str(STEPS), str(int(sleep * 1000)), "1234"]
    args = ["--steps", str(STEPS), "--log", str(log), "--step-sleep", str(sleep)]
    return ROWS[row] + args


GPUOS_RUN = [PY, "-m", "gpuos.cli", "run", "-q", "--"]


def start(row: str, workdir: Path, tag: str, sleep: float, under_run: bool = False
          ) -> tuple[subprocess.Popen, Path]:
    log = workdir / f"{tag}.log"
    out = open(workdir / f"{tag}.out", "w")
    proc = subprocess.Popen((GPUOS_RUN if under_run else []) + command(row, log, sleep, workdir),
                            stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                            start_new_session=True, cwd=PROGRAMS)
    return proc, log


def child_of(pid: int) -> int:
    """The one child of `gpuos run` (its workload)."""
    kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    assert len(kids) == 1, kids
    return int(kids[0])


def wait_gone(pid: int, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return
        if state == "Z":
            return
        assert time.monotonic() < deadline, f"pid {pid} still running"
        time.sleep(0.05)


def run_to_a_third(row: str, tmp_path: Path, under_run: bool = False
                   ) -> tuple[list[str], subprocess.Popen, Path]:
    """The row's uninterrupted results (plain), and a paced run of it a third of the way in
    (under `gpuos run` if asked)."""
    ref, ref_log = start(row, tmp_path, "ref", 0.0)
    assert ref.wait(timeout=600) == 0, (tmp_path / "ref.out").read_text()[-3000:]
    expected = results(ref_log)
    assert expected[-1] == "done" and len(expected) > STEPS
    proc, log = start(row, tmp_path, "run", PACE.get(row, 0.1), under_run)
    deadline = time.monotonic() + 300
    while steps_done(log) < STEPS // 3:
        assert proc.poll() is None, (tmp_path / "run.out").read_text()[-3000:]
        assert time.monotonic() < deadline, "too slow to reach a third of its steps"
        time.sleep(0.02)
    return expected, proc, log


@pytest.fixture
def env(tmp_path):
    """A private GPUOS_HOME. Its images go when the test ends, passed or not: the hold-16gib
    rows write up to 19 GB each, and the GPU hosts have 64 GiB of disk (a whole run once
    filled it, and the next checkpoint failed on ENOSPC)."""
    yield dict(os.environ, GPUOS_HOME=str(tmp_path / "home"), PYTHONUNBUFFERED="1")
    shutil.rmtree(tmp_path / "home" / "images", ignore_errors=True)


@pytest.mark.parametrize("row", list(ROWS))
def test_checkpoint_kill_restore_matches_uninterrupted(row, env, tmp_path):
    expected, proc, log = run_to_a_third(row, tmp_path)
    res = gpuos(env, "checkpoint", str(proc.pid), "--image", row, "--json", check=None)
    report = {"row": row, "checkpoint": res.stdout.strip()[-2000:] or res.stderr.strip()[-2000:]}
    assert res.returncode == 0, report
    out = json.loads(res.stdout)
    proc.wait(timeout=60)  # criu killed it; reap so its pid is free
    at = steps_done(log)
    assert 0 < at < STEPS
    res = gpuos(env, "restore", row, "--json", check=None)
    assert res.returncode == 0, {"row": row, "restore": res.stdout + res.stderr}
    wait_gone(proc.pid)
    got = results(log)
    print(json.dumps({"row": row, "gpu_pids": out["gpu_pids"], "pids": out["pids"], "at_step": at,
                      "size": out["size"], "timings": out["timings"],
                      "restore": json.loads(res.stdout)["timings"], "identical": got == expected}))
    assert got == expected


MOVABLE_ROWS = ["torch-eager-train", "cupy", "hf-generate", "hold-16gib"]


@pytest.mark.parametrize("row", MOVABLE_ROWS)
def test_under_gpuos_run_memory_goes_through_gpuos(row, env, tmp_path):
    """Under `gpuos run` the workload's device memory is movable: the checkpoint captures it
    through libgpuos's agent and hands it out before the driver's checkpoint, the restore
    fills it back at the same addresses; the step log equals the uninterrupted plain run's."""
    expected, run, log = run_to_a_third(row, tmp_path, under_run=True)
    app = child_of(run.pid)
    res = gpuos(env, "checkpoint", str(app), "--image", row, "--json", check=None)
    assert res.returncode == 0, res.stdout + res.stderr + (tmp_path / "run.out").read_text()[-3000:]
    out = json.loads(res.stdout)
    assert "movable-hold" in out["timings"], out["timings"]
    run.wait(timeout=60)
    at = steps_done(log)
    res = gpuos(env, "restore", row, "--json", check=None)
    assert res.returncode == 0, res.stdout + res.stderr
    wait_gone(app)
    got = results(log)
    print(json.dumps({"row": row, "under": "gpuos run", "at_step": at, "size": out["size"],
                      "timings": out["timings"], "restore": json.loads(res.stdout)["timings"],
                      "identical": got == expected}))
    assert got == expected


@pytest.mark.parametrize("row", ["torch-eager-train", "hf-generate", "hold-16gib"])
def test_under_gpuos_run_leave_running_is_identical(row, env, tmp_path):
    """Two --leave-running checkpoints in a row (periodic checkpoints: the second must find
    the process's memory as exportable as the first did); the run goes on identically.
    Then, the run over, the second image restored goes on from its checkpoint exactly as
    the uninterrupted run did: the training job wrote its weights, and the inference
    server its caches, while gpuos copied the snapshot into the image."""
    expected, run, log = run_to_a_third(row, tmp_path, under_run=True)
    app = child_of(run.pid)
    for k in range(2):
        res = gpuos(env, "checkpoint", str(app), "--image", f"{row}-live-{k}", "--leave-running", "--json",
                    check=None)
        assert res.returncode == 0, res.stdout + res.stderr + (tmp_path / "run.out").read_text()[-3000:]
        out = json.loads(res.stdout)
        print(json.dumps({"row": row, "under": "gpuos run", "leave_running": True, "checkpoint": k,
                          "stall_s": out.get("stall"), "timings": out["timings"], "size": out["size"]}))
    assert run.wait(timeout=600) == 0
    assert results(log) == expected
    log.rename(log.with_name("run.first.log"))
    log.touch()  # the restored process appends to it what it logs from its checkpoint on
    res = gpuos(env, "restore", f"{row}-live-1", "--json", check=None)
    assert res.returncode == 0, res.stdout + res.stderr
    wait_gone(app)
    got = results(log)
    print(json.dumps({"row": row, "restored_later": True, "restore": json.loads(res.stdout)["timings"],
                      "steps_after_restore": len(got)}))
    assert got and got[-1] == "done" and len(got) < len(expected), got
    assert got == expected[-len(got):]


def test_jax_leave_running_is_identical(env, tmp_path):
    expected, proc, log = run_to_a_third("jax-train", tmp_path)
    res = gpuos(env, "checkpoint", str(proc.pid), "--image", "jax-live", "--leave-running", "--json",
                check=None)
    assert res.returncode == 0, res.stdout + res.stderr
    assert proc.wait(timeout=600) == 0
    assert results(log) == expected
    gpuos(env, "images", "verify", "jax-live")


def test_managed_memory_is_refused_and_left_running(env, tmp_path):
    code = ("import time\nfrom cuda.bindings import runtime as rt\n"
            "err, p = rt.cudaMallocManaged(64 << 20, rt.cudaMemAttachGlobal); assert err == 0\n"
            "rt.cudaMemset(p, 1, 64 << 20); rt.cudaDeviceSynchronize()\n"
            "print('ready', flush=True)\n"
            "for i in range(600):\n    rt.cudaMemset(p, i, 64 << 20); rt.cudaDeviceSynchronize(); time.sleep(0.05)\n")
    proc = subprocess.Popen([PY, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        res = gpuos(env, "checkpoint", str(proc.pid), "--image", "managed", check=None)
        assert res.returncode == 6, res.stdout + res.stderr
        assert "uses CUDA managed memory" in res.stderr and "nothing was changed" in res.stderr
        time.sleep(1)
        assert proc.poll() is None
        assert not (Path(env["GPUOS_HOME"]) / "images" / "managed").exists()
    finally:
        proc.kill()
        proc.wait()


def test_cuda_ipc_is_refused_and_left_running(env, tmp_path):
    proc = subprocess.Popen([PY, str(PROGRAMS / "ipc_share.py")], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        line = ""
        while not line.startswith("ready"):
            line = proc.stdout.readline()
            assert line, "ipc_share.py exited early"
        child = int(line.split()[1])
        for pid in (proc.pid, child):  # exporter and importer alike
            res = gpuos(env, "checkpoint", str(pid), "--image", f"ipc-{pid}", check=None)
            assert res.returncode == 6, res.stdout + res.stderr
            assert "(CUDA IPC)" in res.stderr and "nothing was changed" in res.stderr
        res = gpuos(env, "ps", "--json", check=None)
        states = {p["pid"]: p["state"] for p in json.loads(res.stdout)["processes"]}
        assert states.get(proc.pid) == states.get(child) == "running", states
        assert not (Path(env["GPUOS_HOME"]) / "images").exists() or \
            not list((Path(env["GPUOS_HOME"]) / "images").iterdir())
    finally:
        os.killpg(proc.pid, 9)
        proc.wait()


def _gpu_of(pid: int) -> str | None:
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,gpu_uuid", "--format=csv,noheader"],
                         capture_output=True, text=True).stdout
    return next((u.strip() for p, u in (ln.split(",") for ln in out.splitlines() if "," in ln)
                 if int(p) == pid), None)


def _gpu_count() -> int:
    out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout
    return len([ln for ln in out.splitlines() if ln.startswith("GPU ")])


@pytest.mark.skipif(not _WHY and _gpu_count() < 2, reason="needs two GPUs of one model")
def test_restore_onto_the_other_gpu_matches_uninterrupted(env, tmp_path):
    """The driver's gpuPairs: checkpointed on GPU 0, restored on GPU 1 (`restore --gpu 1`)."""
    expected, proc, log = run_to_a_third("torch-eager-train", tmp_path)
    before = _gpu_of(proc.pid)
    gpuos(env, "checkpoint", str(proc.pid), "--image", "moved")
    proc.wait(timeout=60)
    res = gpuos(env, "restore", "moved", "--gpu", "1", "--json")
    gpu_map = json.loads(res.stdout)["gpu_map"]
    after = _gpu_of(proc.pid)
    wait_gone(proc.pid)
    print(json.dumps({"before": before, "after": after, "gpu_map": gpu_map}))
    assert before and after and before != after and gpu_map == {before: after}
    assert results(log) == expected
