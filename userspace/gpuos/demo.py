"""`gpuos demo`: checkpoint, kill and restore a real PyTorch training job, and prove
that it went on exactly as if nothing had happened.

1. run the bundled training job uninterrupted (the reference);
2. start it again; once it is a third of the way through, checkpoint it
   (CRIU kills it after the dump) and restore it from the image;
3. wait for the restored job to finish and compare its loss trajectory, step
   by step and bit for bit, with the reference.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from . import procs
from .checkpoint import CheckpointRequest, CheckpointResult, checkpoint
from .errors import DemoMismatch, GpuosError, NoGpu
from .observe import Observer, Silent
from .restore import RestoreResult, restore
from .runtime import Runtime
from .workloads import TORCHJOB, results, steps_done

IMAGE_NAME = "gpuos-demo"


@dataclass
class DemoReport:
    steps: int
    checkpoint_at_step: int
    identical: bool
    first_difference: str | None
    checkpoint: CheckpointResult
    restore: RestoreResult
    workdir: Path


def _start_job(workdir: Path, tag: str, steps: int, step_sleep: float) -> tuple[subprocess.Popen, Path]:
    log = workdir / f"{tag}.log"
    out = open(workdir / f"{tag}.out", "w")
    # A session of its own and no terminal: CRIU dumps and restores it whole.
    proc = subprocess.Popen(
        [sys.executable, str(TORCHJOB), "--mode", "train", "--steps", str(steps),
         "--log", str(log), "--step-sleep", str(step_sleep)],
        stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        cwd=workdir)
    out.close()
    return proc, log


def _fail_output(workdir: Path, tag: str) -> str:
    try:
        tail = (workdir / f"{tag}.out").read_text().strip().splitlines()[-3:]
    except FileNotFoundError:
        tail = []
    return " | ".join(tail) or "no output"


def run_demo(rt: Runtime, steps: int = 150, step_sleep: float = 0.02, keep: bool = False,
             observer: Observer = Silent(), say: Callable[[str], None] = lambda s: None) -> DemoReport:
    rt.driver()  # raises NoGpu / DriverUnsupported first, in one line
    try:
        import torch  # noqa: F401  (the job needs it; fail here, not in the child)
    except ImportError:
        raise NoGpu("the demo needs PyTorch with CUDA (import torch failed)") from None
    criu = rt.criu()
    criu.check_version()
    workdir = Path(tempfile.mkdtemp(prefix="gpuos-demo-"))

    say(f"reference: training {steps} steps uninterrupted")
    ref, ref_log = _start_job(workdir, "reference", steps, step_sleep)
    if ref.wait() != 0:
        raise GpuosError(f"the reference run failed: {_fail_output(workdir, 'reference')}")

    say("second run: will be checkpointed, killed and restored a third of the way in")
    job, log = _start_job(workdir, "restored", steps, step_sleep)
    target = steps // 3
    while steps_done(log) < target:
        if job.poll() is not None:
            raise GpuosError(f"the training job exited early: {_fail_output(workdir, 'restored')}")
        time.sleep(0.01)
    say(f"checkpointing pid {job.pid} (CRIU kills it once the image is written)")
    cp = checkpoint(CheckpointRequest(pid=job.pid, image=IMAGE_NAME), rt.paths.run, rt.store,
                    rt.driver, criu, observer)
    at_step = steps_done(log)
    job.wait()  # reap it, or its pid stays taken and the restore cannot have it
    say(f"job killed at step {at_step}; restoring {cp.path}")
    rs = restore(IMAGE_NAME, rt.paths.run, rt.store, rt.driver, criu, observer=observer)
    say(f"restored as pid {rs.pid}; waiting for it to finish")
    deadline = time.monotonic() + 600
    while procs.alive(rs.pid):
        if time.monotonic() > deadline:
            raise GpuosError(f"the restored job (pid {rs.pid}) did not finish in 10 minutes")
        time.sleep(0.05)

    want, got = results(ref_log), results(log)
    diff = next((f"line {i + 1}: expected {a!r}, got {b!r}"
                 for i, (a, b) in enumerate(zip(want, got)) if a != b), None)
    if diff is None and len(want) != len(got):
        diff = f"the reference logged {len(want)} lines, the restored run {len(got)}"
    if got[-1:] != ["done"]:
        diff = diff or f"the restored run did not finish: {_fail_output(workdir, 'restored')}"
    report = DemoReport(steps=steps, checkpoint_at_step=at_step, identical=diff is None,
                        first_difference=diff, checkpoint=cp, restore=rs, workdir=workdir)
    if diff:
        raise DemoMismatch(f"the restored run differs from the uninterrupted one: {diff} "
                           f"(logs in {workdir})")
    if not keep:
        shutil.rmtree(workdir)
    return report
