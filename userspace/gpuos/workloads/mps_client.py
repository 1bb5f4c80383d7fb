"""A small CUDA client that says when it makes progress: for MPS fault benchmarks and tests.

    python -m gpuos.workloads.mps_client --mode infer|train --heartbeat FILE [--size N]

A torch loop on the GPU: ``infer`` runs an MLP forward on fresh random inputs (a serving
loop), ``train`` trains a small MLP with SGD.  After every iteration (synchronized, so
the GPU really did the work) FILE is replaced atomically by one line
``<unix time> <iteration> <pid>``: a harness sees when the client last made progress,
and a restarted client by its pid changing and its iteration starting again at 1.

With --checkpoint FILE it resumes from FILE at its start (weights, optimizer state and
iteration count) where FILE exists, and with --checkpoint-every S saves them there every S
seconds (written aside and renamed): an application that keeps its own progress, whose
heartbeat's iteration then goes on from the checkpoint's in a new run.

With --hold-file FILE it stops after its first iteration (its context, weights and
first forward done, as a warm standby would be), writes FILE.ready and goes on only
once FILE exists.

Any CUDA error (a co-runner's fault under MPS poisons this client's context) exits 3
after one line on stderr; other failures exit 1; SIGTERM/SIGINT exit 0.  It stops by
itself after --max-seconds.  GPU memory: a few MiB of weights and activations at the
default size (well under 1 GiB even at --size 4096), plus the CUDA context.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from typing import Callable

EXIT_CUDA = 3
PHASED = 2  # --phases: the first iterations of a process whose phases are written down


def read_heartbeat(path: str | os.PathLike) -> tuple[float, int, int] | None:
    """A client's last heartbeat: (unix time, iteration, pid), or None before its first."""
    try:
        with open(path) as f:
            t, it, pid = f.read().split()[:3]
        return float(t), int(it), int(pid)
    except (OSError, ValueError):
        return None


def _beat(path: str, tmp: str, iteration: int, when: float) -> None:
    """Write the heartbeat: WHEN is taken before the file's I/O, which can wait (on an H200
    host, 15-50 ms for the directory while other clients' renames discarded blocks)."""
    with open(tmp, "w") as f:
        f.write(f"{when:.6f} {iteration} {os.getpid()}\n")
    os.replace(tmp, path)


def make_model(torch, dev, mode: str, size: int):
    """The client's MLP (made on the CPU, copied in) and, to train it, its optimizer."""
    model = torch.nn.Sequential(
        torch.nn.Linear(size, size), torch.nn.ReLU(),
        torch.nn.Linear(size, size), torch.nn.ReLU(),
        torch.nn.Linear(size, 16)).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3) if mode == "train" else None
    if opt is None:
        model.eval()
    return model, opt


NOOP_PTX = b""".version 6.0
.target sm_52
.address_size 64
.visible .entry gpuos_noop()
{
	ret;
}
\0"""


def new_module_runner() -> Callable[[], None]:
    """A call that loads NOOP_PTX as a new module, launches its kernel, waits for it and
    unloads the module (the context current on this thread: torch's)."""
    from cuda.bindings import driver as cu  # type: ignore[import-not-found]

    def check(result):
        err, rest = result[0], result[1:]
        if err != cu.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"CUDA error: {getattr(err, 'name', err)}")
        return rest[0] if rest else None

    def run() -> None:
        mod = check(cu.cuModuleLoadData(NOOP_PTX))
        try:
            fn = check(cu.cuModuleGetFunction(mod, b"gpuos_noop"))
            check(cu.cuLaunchKernel(fn, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0))
            check(cu.cuCtxSynchronize())
        finally:
            cu.cuModuleUnload(mod)
    return run


def forward(model, x, mark: Callable[[str], None] | None):
    """model(x); with mark, layer by layer, mark("layerI") after each (the first one's
    matmul is the process's first cuBLAS call: its handle, its kernels)."""
    if mark is None:
        return model(x)
    for i, layer in enumerate(model):
        x = layer(x)
        mark(f"layer{i}")
    return x


def iteration(torch, dev, model, opt, size: int, batch: int,
              mark: Callable[[str], None] | None = None) -> None:
    """One iteration on fresh random inputs, synchronized: the GPU did the work.  mark(phase)
    after each phase's calls ("inputs", each layer's "layerI", "forward", "backward", "step")."""
    note = mark or (lambda phase: None)
    x = torch.randn(batch, size, device=dev)
    note("inputs")
    if opt is not None:
        y = torch.randn(batch, 16, device=dev)
        loss = torch.nn.functional.mse_loss(forward(model, x, mark), y)
        note("forward")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        note("backward")
        opt.step()
        note("step")
    else:
        with torch.inference_mode():
            forward(model, x, mark).sum()
        note("forward")
    torch.cuda.synchronize()


def save_checkpoint(torch, path: str, model, opt, iteration: int) -> None:
    """The model's and optimizer's state and the iteration, written aside and renamed."""
    tmp = f"{path}.{os.getpid()}.tmp"
    torch.save({"iteration": iteration, "model": model.state_dict(),
                "opt": opt.state_dict() if opt is not None else None}, tmp)
    os.replace(tmp, path)


def load_checkpoint(torch, dev, path: str, model, opt) -> int:
    """Resume from save_checkpoint's file: the iteration it was written after."""
    state = torch.load(path, map_location=dev)
    model.load_state_dict(state["model"])
    if opt is not None and state.get("opt") is not None:
        opt.load_state_dict(state["opt"])
    return int(state["iteration"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", choices=("infer", "train"), required=True)
    ap.add_argument("--heartbeat", required=True, metavar="FILE")
    ap.add_argument("--size", type=int, default=1024, help="Width of the MLP [1024].")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--sleep", type=float, default=0.0, metavar="S",
                    help="Pause between iterations (a serving loop's idle time) [0].")
    ap.add_argument("--hold-file", metavar="FILE",
                    help="After the first iteration, write FILE.ready and wait until FILE exists.")
    ap.add_argument("--beats", metavar="FILE",
                    help="Also append each iteration's end (unix time) to FILE, one per line.")
    ap.add_argument("--fresh-memory", action="store_true",
                    help="Give the caching allocator's memory back after each iteration: every "
                         "iteration allocates from the driver (cuMemAlloc).")
    ap.add_argument("--copy-in", action="store_true",
                    help="Each iteration also copies a batch of inputs in from the host.")
    ap.add_argument("--new-module", action="store_true",
                    help="Each iteration also loads a module of its own afresh (a one-kernel PTX), "
                         "runs its kernel once and unloads it: a first launch's code load every "
                         "iteration (cuda-python's driver API).")
    ap.add_argument("--phases", metavar="FILE",
                    help="Append 'pid iteration phase unix-time' to FILE after each phase of this "
                         "process's first PHASED iterations, the GPU synchronized first (where a "
                         "first iteration's time goes; a standby copy writes its own lines).")
    ap.add_argument("--seed", type=int, default=None,
                    help="Seed of the weights and inputs [a random one]: with a seed, every process of "
                         "the command starts with the same weights, as a server loading a model file "
                         "does (what a warm standby may share with its client).")
    ap.add_argument("--checkpoint", metavar="FILE",
                    help="Resume from FILE at the start where it exists (weights, optimizer state, "
                         "iteration); with --checkpoint-every, save there.")
    ap.add_argument("--checkpoint-every", type=float, default=0.0, metavar="S",
                    help="Save the checkpoint every S seconds of iterations (aside, then renamed) [0: never].")
    ap.add_argument("--max-seconds", type=float, default=3600.0,
                    help="Exit 0 after this long, whatever happens [3600].")
    a = ap.parse_args(argv)

    stop = False

    def on_signal(signum, frame):  # noqa: ARG001
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    path = os.path.abspath(a.heartbeat)
    tmp = f"{path}.{os.getpid()}.tmp"
    deadline = time.monotonic() + a.max_seconds
    beats = open(a.beats, "a", buffering=1) if a.beats else None  # noqa: SIM115 - the whole run
    phases = open(a.phases, "a", buffering=1) if a.phases else None  # noqa: SIM115 - the whole run

    import torch

    try:
        dev = torch.device("cuda")
        torch.manual_seed(a.seed if a.seed is not None else int.from_bytes(os.urandom(4), "little"))
        model, opt = make_model(torch, dev, a.mode, a.size)
        run_new_module = new_module_runner() if a.new_module else None
        it = 0
        if a.checkpoint and os.path.exists(a.checkpoint):
            it = load_checkpoint(torch, dev, a.checkpoint, model, opt)
            print(f"mps_client: pid {os.getpid()} resumed from iteration {it}", flush=True)
        saved_at = time.monotonic()

        def mark(phase: str) -> None:
            torch.cuda.synchronize()
            phases.write(f"{os.getpid()} {it + 1} {phase} {time.time():.6f}\n")

        while not stop and time.monotonic() < deadline:
            iteration(torch, dev, model, opt, a.size, a.batch,
                      mark if phases is not None and it < PHASED else None)
            if a.copy_in:
                torch.randn(a.batch, a.size).to(dev)
                torch.cuda.synchronize()
            if a.new_module:
                run_new_module()
            it += 1
            if a.fresh_memory:
                torch.cuda.empty_cache()
            done = time.time()
            _beat(path, tmp, it, done)
            if beats is not None:
                beats.write(f"{done:.6f}\n")
            if a.checkpoint and a.checkpoint_every and time.monotonic() - saved_at >= a.checkpoint_every:
                save_checkpoint(torch, a.checkpoint, model, opt, it)
                saved_at = time.monotonic()
            if it == 1 and a.hold_file:
                with open(a.hold_file + ".ready", "w") as f:
                    f.write(f"{time.time():.6f}\n")
                while not os.path.exists(a.hold_file) and not stop:
                    time.sleep(0.001)
            if a.sleep:
                time.sleep(a.sleep)
    except Exception as exc:  # noqa: BLE001 - torch raises RuntimeError subclasses for CUDA errors
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        cuda = "cuda" in text.lower() or "accelerator" in type(exc).__name__.lower()
        print(f"mps_client: pid {os.getpid()}: {'CUDA error' if cuda else 'error'}: {text}",
              file=sys.stderr, flush=True)
        try:
            os.unlink(tmp)
        except OSError:
            pass
        # A poisoned context can make interpreter teardown hang or fail: leave at once.
        os._exit(EXIT_CUDA if cuda else 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
