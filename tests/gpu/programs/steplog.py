"""What every program of the transparency matrix shares: its arguments and its step log.

A line is ``<step> <what> <value> t <unix time>``, the format of gpuos.workloads.torchjob,
so ``gpuos.workloads.results`` compares two runs and ``steps_done`` counts steps. The
last line is ``done``. ``--step-sleep`` paces a run so a checkpoint lands mid-run.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import time


def parser(doc: str, steps: int = 60) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--log", required=True)
    p.add_argument("--step-sleep", type=float, default=0.05)
    return p


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


class StepLog:
    def __init__(self, args: argparse.Namespace):
        self.f = open(args.log, "a", buffering=1)
        self.sleep = args.step_sleep

    def step(self, step: int, what: str, value: object) -> None:
        """One step's result; then the pause that lets a checkpoint land between steps."""
        self.f.write(f"{step} {what} {value} t {time.time():.6f}\n")
        if self.sleep:
            time.sleep(self.sleep)

    def line(self, step: int, what: str, value: object) -> None:
        """A result that is not a step (start or end)."""
        self.f.write(f"{step} {what} {value}\n")

    def done(self) -> None:
        self.f.write("done\n")
        self.f.close()


def pid_file(path: str | None) -> None:
    if path:
        with open(path + ".tmp", "w") as f:
            f.write(f"{os.getpid()}\n")
        os.rename(path + ".tmp", path)
