"""Checkpoint/restore of real PyTorch processes on a real GPU, through the `gpuos` CLI.

Skipped cleanly without a GPU with the driver's checkpoint API, a working
criu, or root.  Every comparison is against an uninterrupted run of the same
job with the same seed: results must be bit-identical.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import criu_unusable

from gpuos.workloads import TORCHJOB, results, steps_done

pytestmark = pytest.mark.gpu

STEPS = 90
SLEEP = 0.03


def _gpu_ready() -> str | None:
    why = criu_unusable()
    if why:
        return why
    probe = subprocess.run(
        [sys.executable, "-c", "from gpuos.cudadrv import CudaDriver; CudaDriver().devices()"],
        capture_output=True, text=True)
    if probe.returncode != 0:
        return f"no GPU with the checkpoint API: {probe.stderr.strip().splitlines()[-1:]}"
    return None


_WHY = _gpu_ready()
if _WHY:
    pytestmark = [pytest.mark.gpu, pytest.mark.skip(reason=_WHY)]


class Job:
    """A torchjob process in its own session, stdio to files."""

    def __init__(self, workdir: Path, tag: str, mode: str, steps: int = STEPS, sleep: float = SLEEP,
                 hold_gib: float = 0.0, prefix: list[str] | None = None):
        self.log = workdir / f"{tag}.log"
        self.out = workdir / f"{tag}.out"
        args = ["--mode", mode, "--steps", str(steps), "--log", str(self.log),
                "--step-sleep", str(sleep), "--hold-gib", str(hold_gib)]
        cmd = prefix + args if prefix else [sys.executable, str(TORCHJOB), *args]
        with open(self.out, "w") as out:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out,
                                         stderr=subprocess.STDOUT, start_new_session=True,
                                         cwd=workdir)
        self.pid = self.proc.pid

    def wait_steps(self, n: int, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while steps_done(self.log) < n:
            assert self.proc.poll() is None, f"job died: {self.out.read_text()[-2000:]}"
            assert time.monotonic() < deadline, "job too slow"
            time.sleep(0.01)

    def wait_gone(self, timeout: float = 300) -> None:
        """Wait for the job to end, whether or not it is still our child."""
        deadline = time.monotonic() + timeout
        while True:
            self.proc.poll()  # reaps it if it is still our child and has exited
            try:
                state = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except FileNotFoundError:
                return
            if state == "Z":  # a child of ours, or of init about to reap it
                return
            assert time.monotonic() < deadline, f"pid {self.pid} still running"
            time.sleep(0.05)

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.wait_gone(30)


@pytest.fixture
def env(tmp_path):
    e = dict(os.environ, GPUOS_HOME=str(tmp_path / "home"), GPUOS_HOT=str(tmp_path / "hot"), PYTHONUNBUFFERED="1")
    return e


@pytest.fixture
def jobs(tmp_path):
    started: list[Job] = []

    def start(tag: str, mode: str, **kw) -> Job:
        job = Job(tmp_path, tag, mode, **kw)
        started.append(job)
        return job

    yield start
    for job in started:
        job.kill()


def gpuos(env, *args, check: int | None = 0) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "gpuos.cli", *args], env=env,
                          capture_output=True, text=True, timeout=600)
    if check is not None:
        assert proc.returncode == check, (
            f"gpuos {' '.join(args)} exited {proc.returncode}, expected {check}\n"
            f"stdout: {proc.stdout[-3000:]}\nstderr: {proc.stderr[-3000:]}")
    return proc


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Uninterrupted runs of each job, computed once."""
    workdir = tmp_path_factory.mktemp("reference")
    refs = {}
    for mode, hold in (("train", 1.0), ("infer", 0.0)):
        job = Job(workdir, mode, mode, sleep=0.0, hold_gib=hold)
        assert job.proc.wait(timeout=600) == 0, job.out.read_text()[-2000:]
        refs[mode] = results(job.log)
        assert refs[mode][-1] == "done" and len(refs[mode]) > STEPS
    return refs


def gpu_state(env, pid: int) -> str | None:
    rows = json.loads(gpuos(env, "ps", "--json").stdout)["processes"]
    return next((r["state"] for r in rows if r["pid"] == pid), None)


def test_training_checkpoint_kill_restore_is_bit_identical(env, jobs, reference):
    job = jobs("train", "train", hold_gib=1.0)
    job.wait_steps(STEPS // 3)
    out = json.loads(gpuos(env, "checkpoint", str(job.pid), "--image", "train", "--json").stdout)
    assert out["gpu_pids"] == [job.pid]
    assert out["size"] > 1 << 30  # the held GiB is in the image
    job.proc.wait(timeout=30)  # CRIU killed it; reap so its pid is free
    at = steps_done(job.log)
    assert at < STEPS
    restored = json.loads(gpuos(env, "restore", "train", "--json").stdout)
    assert restored["pid"] == job.pid
    assert gpu_state(env, job.pid) == "running"
    job.wait_gone()
    assert results(job.log) == reference["train"]


def test_inference_leave_running_is_identical(env, jobs, reference):
    job = jobs("infer", "infer")
    job.wait_steps(STEPS // 3)
    out = json.loads(gpuos(env, "checkpoint", str(job.pid), "--image", "inf", "--leave-running",
                           "--json").stdout)
    assert out["stall"] and out["stall"] > 0
    assert gpu_state(env, job.pid) == "running"
    assert job.proc.wait(timeout=300) == 0
    assert results(job.log) == reference["infer"]
    gpuos(env, "images", "verify", "inf")


def test_restore_refuses_taken_pid_and_leaves_process_alone(env, jobs, reference):
    job = jobs("taken", "infer")
    job.wait_steps(10)
    gpuos(env, "checkpoint", str(job.pid), "--image", "taken", "--leave-running")
    res = gpuos(env, "restore", "taken", check=14)
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("gpuos:")]
    assert len(errors) == 1 and str(job.pid) in errors[0]
    assert job.proc.wait(timeout=300) == 0
    assert results(job.log) == reference["infer"]


def test_lock_timeout_on_busy_gpu_leaves_process_running(env, jobs):
    job = jobs("busy", "busy", steps=8, sleep=0.0)
    job.wait_steps(1)
    res = gpuos(env, "checkpoint", str(job.pid), "--lock-timeout", "0.05", check=7)
    assert "left running" in res.stderr
    assert gpu_state(env, job.pid) == "running"
    assert job.proc.wait(timeout=120) == 0
    assert not list((Path(env["GPUOS_HOME"]) / "images").glob("*"))


def test_criu_failure_after_gpu_checkpoint_puts_process_back(env, jobs, reference):
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        # An established TCP connection: criu refuses it without --tcp-established,
        # after the driver already checkpointed the GPU state.
        prefix = [sys.executable, "-c",
                  "import runpy, socket, sys; s = socket.create_connection(('127.0.0.1', %d)); "
                  "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')" % port,
                  str(TORCHJOB)]
        job = jobs("tcp", "infer", prefix=prefix)
        conn, _ = server.accept()
        job.wait_steps(10)
        res = gpuos(env, "checkpoint", str(job.pid), "--image", "tcp", check=8)
        assert "left running" in res.stderr
        assert gpu_state(env, job.pid) == "running"
        assert job.proc.wait(timeout=300) == 0
        conn.close()
    assert results(job.log) == reference["infer"]
    assert not (Path(env["GPUOS_HOME"]) / "images" / "tcp").exists()


def test_restore_checks_gpu_model_and_memory(env, jobs):
    job = jobs("model", "infer", steps=100000)
    job.wait_steps(5)
    gpuos(env, "checkpoint", str(job.pid), "--image", "model", "--leave-running")
    image = Path(env["GPUOS_HOME"]) / "images" / "model"
    manifest_path = image / "manifest.json"
    original = manifest_path.read_text()
    m = json.loads(original)
    for g in m["gpus"]:
        g["name"], g["uuid"] = "NVIDIA Imaginary GPU", "GPU-00000000-0000-0000-0000-000000000000"
    manifest_path.write_text(json.dumps(m))
    res = gpuos(env, "restore", "model", check=12)
    assert "Imaginary" in res.stderr
    m = json.loads(original)
    for g in m["gpus"]:
        g["memory_used_by_image"] = 1 << 50
    manifest_path.write_text(json.dumps(m))
    gpuos(env, "restore", "model", check=13)
    assert job.proc.poll() is None  # nothing touched the running job


@pytest.mark.parametrize("phase", ["lock", "gpu-checkpoint", "criu-dump", "store", "publish"])
def test_gpuos_killed_at_each_phase_loses_nothing(env, jobs, reference, tmp_path, phase):
    job = jobs(f"kill-{phase}", "infer")
    job.wait_steps(10)
    # An earlier image of the same name, which must survive.
    gpuos(env, "checkpoint", str(job.pid), "--image", "victim", "--leave-running")
    before = json.loads(gpuos(env, "images", "show", "victim", "--json").stdout)["manifest"]
    hold = tmp_path / f"hold-{phase}"
    proc = subprocess.Popen([sys.executable, "-m", "gpuos.cli", "checkpoint", str(job.pid),
                             "--image", "victim"],
                            env=dict(env, GPUOS_TEST_HOLD_AT=phase, GPUOS_TEST_HOLD_FILE=str(hold)),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not hold.exists():
        assert proc.poll() is None and time.monotonic() < deadline, "gpuos never reached " + phase
        time.sleep(0.01)
    if phase == "criu-dump":  # checkpointed, and held stopped (hold.py): ps does not ask the driver
        assert gpu_state(env, job.pid).startswith("stopped")
    proc.kill()
    proc.wait()
    after_kill = json.loads(gpuos(env, "images", "show", "victim", "--json").stdout)["manifest"]
    assert after_kill == before  # the previous image is intact
    gpuos(env, "recover")
    dumped = phase in ("store", "publish")
    if not dumped:
        assert gpu_state(env, job.pid) == "running"
        assert job.proc.wait(timeout=300) == 0
    else:
        job.proc.wait(timeout=30)  # criu killed it after the dump; the new image is published
        new = json.loads(gpuos(env, "images", "show", "victim", "--json").stdout)["manifest"]
        assert new["created"] >= before["created"] and new["files"] != before["files"]
        gpuos(env, "restore", "victim")
        job.wait_gone()
    assert results(job.log) == reference["infer"]
    assert not list((Path(env["GPUOS_HOME"]) / "run").glob("op-*.json"))


def test_demo(env):
    res = gpuos(env, "demo", "--steps", "60", "--json")
    out = json.loads(res.stdout)
    assert out["ok"] and out["identical"] and 0 < out["checkpoint_at_step"] < 60
