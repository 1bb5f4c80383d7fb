"""`gpuos faults inject`: trigger one GPU fault in a process of its own (docs/inject.md).

The work is done by gpuos-inject, a small CUDA program built from inject/ and shipped
as gpuos/_native/gpuos-inject ($GPUOS_INJECT overrides).  This module finds it, runs
it, passes its output through line by line and exits with its exit code, which says
what happened (EXIT_CODES).  It never faults anything but the program it starts.

Importable on its own; `inject` is a click command for the `faults` group
(``faults.add_command(inject)``), ``inject_cmd()`` the same as a function.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from pathlib import Path
from typing import Callable

import click

ENV = "GPUOS_INJECT"
BINARY = "gpuos-inject"

# Kind -> the driver error it must produce (gpuos-inject --list has the Xids).
KINDS = {
    "oob-write": "CUDA_ERROR_ILLEGAL_ADDRESS",
    "oob-read": "CUDA_ERROR_ILLEGAL_ADDRESS",
    "ro-write": "CUDA_ERROR_ILLEGAL_ADDRESS",
    "illegal-instruction": "CUDA_ERROR_ILLEGAL_INSTRUCTION",
    "trap": "CUDA_ERROR_LAUNCH_FAILED",
    "assert": "CUDA_ERROR_ASSERT",
    "none": "CUDA_SUCCESS",
}

EXIT_EXPECTED = 0    # the kind's expected error was observed (none: no error)
EXIT_USAGE = 2       # bad usage
EXIT_SETUP = 3       # setup failed: no driver, no GPU, ... (also: gpuos-inject not found)
EXIT_UNEXPECTED = 4  # another error than the kind's
EXIT_NO_FAULT = 5    # no error at all
EXIT_WORK = 6        # the work before the fault failed (a victim of a co-runner's fault)

EXIT_CODES = {
    EXIT_EXPECTED: "the expected error was observed (none: no error)",
    EXIT_USAGE: "bad usage",
    EXIT_SETUP: "setup failed before the fault (no driver, no GPU, gpuos-inject missing, ...)",
    EXIT_UNEXPECTED: "the driver reported another error than expected",
    EXIT_NO_FAULT: "no error at all: the fault did not happen",
    EXIT_WORK: "the work before the fault failed",
}


class InjectorMissing(Exception):
    """gpuos-inject is not where it should be."""


def inject_binary() -> Path:
    """The gpuos-inject to run: $GPUOS_INJECT, else the one shipped in the package."""
    env = os.environ.get(ENV)
    if env:
        path = Path(env)
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise InjectorMissing(f"${ENV} is {env}, which is not an executable file")
        return path
    from .. import _native
    path = Path(_native.__file__).resolve().parent / BINARY
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise InjectorMissing(
            f"{path} is missing: gpuos-inject is built with nvcc when gpuos is installed "
            f"(setup.py, inject/Makefile); reinstall gpuos where the CUDA toolkit is, or set "
            f"${ENV} to a built one")
    return path


def inject_argv(kind: str, *, delay: float = 0.0, device: int = 0, after_iterations: int = 1,
                json_out: bool = False, binary: Path | None = None) -> list[str]:
    """The command line that runs gpuos-inject."""
    argv = [str(binary or inject_binary()), "--kind", kind, "--delay", repr(float(delay)),
            "--device", str(device), "--after-iterations", str(after_iterations)]
    if json_out:
        argv.append("--json")
    return argv


def inject_cmd(kind: str, *, delay: float = 0.0, device: int = 0, after_iterations: int = 1,
               json_out: bool = False, out: Callable[[str], None] | None = None,
               err: Callable[[str], None] | None = None) -> int:
    """Run gpuos-inject, pass its stdout and stderr on line by line, return its exit code.

    `out` and `err` get each line without its newline (default: click.echo to stdout,
    stderr).  A missing binary is EXIT_SETUP, with one line on `err` (and a JSON line on
    `out` with json_out); a death by signal N is 128+N.
    """
    out = out or (lambda line: click.echo(line))
    err = err or (lambda line: click.echo(line, err=True))
    try:
        argv = inject_argv(kind, delay=delay, device=device, after_iterations=after_iterations,
                           json_out=json_out)
    except InjectorMissing as exc:
        if json_out:
            import json
            out(json.dumps({"kind": kind, "pid": None, "stage": "setup-failed", "step": "binary",
                            "error": "injector-missing", "code": 0, "message": str(exc),
                            "exit": EXIT_SETUP}))
        err(f"gpuos: {exc}")
        return EXIT_SETUP
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, bufsize=1)

    def pump(stream, sink):
        for line in stream:
            sink(line.rstrip("\n"))

    t = threading.Thread(target=pump, args=(proc.stderr, err), daemon=True)
    t.start()
    # SIGUSR1 ends gpuos-inject's work loop and delay: pass it on from here too.
    forward = threading.current_thread() is threading.main_thread()
    if forward:
        previous = signal.signal(signal.SIGUSR1, lambda *_: proc.send_signal(signal.SIGUSR1))
    try:
        pump(proc.stdout, out)
        rc = proc.wait()
    except KeyboardInterrupt:
        proc.terminate()
        rc = proc.wait()
    finally:
        if forward:
            signal.signal(signal.SIGUSR1, previous)
    t.join()
    return 128 - rc if rc < 0 else rc


@click.command("inject", epilog="\b\nExit codes (gpuos-inject's):\n" + "\n".join(
    f"  {code} {what}" for code, what in EXIT_CODES.items()))
@click.option("--kind", required=True, type=click.Choice(list(KINDS)),
              help="The fault: see docs/inject.md (expected error, Xid).")
@click.option("--delay", type=click.FloatRange(0, 86400), default=0.0, show_default=True,
              help="Seconds between arming (stage \"armed\") and the fault.")
@click.option("--device", type=click.IntRange(0), default=0, show_default=True,
              help="CUDA device ordinal.")
@click.option("--after-iterations", type=click.IntRange(0), default=1, show_default=True,
              help="Work iterations before arming; 0: until SIGUSR1 reaches gpuos-inject.")
@click.option("--json", "json_out", is_flag=True, help="One JSON object a line per stage.")
@click.pass_context
def inject(ctx: click.Context, kind: str, delay: float, device: int, after_iterations: int,
           json_out: bool) -> None:
    """Trigger one GPU fault in a process of its own and report the CUDA error.

    Runs gpuos-inject: it does real work on the GPU, arms the fault, prints stage
    "armed", waits --delay seconds, faults, and prints the error the driver reported.
    Only that process faults (under MPS, co-running clients may still go down with
    it: that is what gpuos measures).
    """
    ctx.exit(inject_cmd(kind, delay=delay, device=device, after_iterations=after_iterations,
                        json_out=json_out))


if __name__ == "__main__":  # python -m gpuos.faults.inject
    inject(prog_name="gpuos faults inject")
