"""The `gpuos` command line."""

from __future__ import annotations

import os
import sys

import click

from .. import __version__, procs
from ..config import Paths
from ..errors import GpuosError
from ..runtime import Runtime
from .output import Reporter, emit_json, fail, human_bytes, json_option, table

EXIT_CODES_HELP = """\b
Exit codes:
   0 success                          10 image incomplete or corrupt
   1 other error                      11 image format version unknown
   2 bad usage                        12 no GPU of the image's model, other driver
   3 no such process                  13 not enough free GPU memory
   4 not permitted                    14 a pid the image needs is taken
   5 criu missing or too old          15 restore failed, nothing left restored
   6 driver checkpoint API missing    16 no GPU
   7 GPU lock timed out               17 demo: results differ
   8 checkpoint failed, process runs  18 busy: another gpuos operation
   9 image not found                  19 process left stopped: `gpuos recover`
  20 gpuos.ko not loaded              25 no such policy
  21 gpuos.ko of another version      26 a gpuos.ko limit reached
  22 no GPU driver in gpuos.ko        27 bcc missing (gpuos trace)
  23 GPU driver lacks the operation   28 timed out (gpuos events)
  24 gpuos.ko rejected the request    29 process not tracked by libgpuos
                                      30 libgpuos.so missing
  35 MPS binaries missing             38 GPU or MPS server refuses clients
  36 MPS daemon not started by gpuos  39 MPS supervisor failed: `gpuos mps recover`
  37 no gpuos MPS supervisor for GPU  40 no such group (gpuos mem stats)
"""


# The command groups, each imported when it is run (or help lists it): a command pays for
# its own imports only (gpuos restore's start is part of a restore's time).
LAZY = {"images": "images:images", "kmod": "kmod:kmod", "driver": "driver:driver", "policy": "policy:policy",
        "events": "events:events", "trace": "trace:trace", "run": "run:run_cmd", "mps": "mps:mps",
        "faults": "faults:faults", "mem": "mem:mem"}


class GpuosGroup(click.Group):
    """Turns a GpuosError into a one-line message (or JSON) and its exit code; imports the
    LAZY commands when they are wanted."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *LAZY})

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name in LAZY and name not in self.commands:
            import importlib

            module, attr = LAZY[name].split(":")
            self.add_command(getattr(importlib.import_module(f"{__package__}.{module}"), attr), name)
        return super().get_command(ctx, name)

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except GpuosError as exc:
            fail(exc, bool(ctx.meta.get("gpuos.json")))


@click.group(cls=GpuosGroup, epilog=EXIT_CODES_HELP,
             context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="gpuos")
@click.option("--store", type=click.Path(file_okay=False),
              help="Image store directory [default: $GPUOS_STORE, else $GPUOS_HOME/images; "
                   "GPUOS_HOME defaults to /var/lib/gpuos].")
@click.option("--criu", "criu_path", type=click.Path(dir_okay=False),
              help="The criu binary [default: $GPUOS_CRIU, else criu on PATH, else "
                   "/opt/gpuos/bin/criu].")
@click.pass_context
def cli(ctx: click.Context, store: str | None, criu_path: str | None) -> None:
    """gpuos: OS services for Linux processes that use NVIDIA GPUs.

    Checkpoint a running GPU process to an image and restore it later, on this
    host or another with the same GPU model and driver, without any help from
    the process: GPU state through the CUDA driver's checkpoint API, the rest
    through CRIU. With gpuos.ko and a patched driver: fault policies that
    keep one client's GPU fault from killing the others, events and tracing.
    """
    ctx.obj = Runtime(paths=Paths.from_env(store=store), criu_path=criu_path)


def _recover_first(rt: Runtime, rep: Reporter) -> None:
    """Finish what a killed gpuos left half done, before doing anything new."""
    for act in rt.recover():
        rep.say(f"gpuos: recovered: {act.action}" if act.ok else f"gpuos: recovery failed: {act.action}")


@cli.command("checkpoint", epilog=EXIT_CODES_HELP)
@click.argument("pid", type=int)
@click.option("--image", "-i", metavar="NAME|DIR",
              help="Image name in the store, or a directory path (contains '/') [default: COMM-PID].")
@click.option("--leave-running", is_flag=True,
              help="Keep the process running after the checkpoint (default: it is killed once "
                   "the image is written, so it can be restored).")
@click.option("--lock-timeout", type=click.FloatRange(0.001, 3600), default=10.0, show_default=True,
              help="Seconds to wait for the process's GPU work to drain before giving up.")
@json_option
@click.pass_obj
def checkpoint_cmd(rt: Runtime, pid: int, image: str | None, leave_running: bool,
                   lock_timeout: float, as_json: bool) -> None:
    """Checkpoint process PID and all its descendants into an image.

    Any process works: a session leader or not, with or without a terminal
    (started from a shell, nohup, setsid, systemd, a container or a scheduler).
    CUDA processes in the tree are locked (waiting at most --lock-timeout for
    their GPU work to drain) and their GPU memory is moved to host memory by the
    driver, their own threads held still meanwhile; then criu dumps the whole
    tree. The image is written beside the previous image of that name and
    replaces it in one atomic rename only once it is complete, fsynced and
    checksummed. If anything fails, the processes are put back on their GPUs and
    left running, and the previous image is kept. With --leave-running, a
    process that cannot be resumed on its GPU is left stopped and its image
    published, and the one-line error says how to go on. Needs root.
    """
    rep = Reporter(quiet=as_json)
    _recover_first(rt, rep)
    procs.check_target(pid)  # say "no such process" before anything about criu
    rep.say(f"checkpointing pid {pid}")
    from ..checkpoint import CheckpointRequest, checkpoint

    res = checkpoint(CheckpointRequest(pid=pid, image=image, leave_running=leave_running,
                                       lock_timeout_ms=int(lock_timeout * 1000)),
                     rt.paths.run, rt.store, rt.driver, rt.criu(), rep)
    m = res.manifest
    if as_json:
        emit_json({"ok": True, "image": res.path, "name": m.name, "pids": [p.pid for p in m.processes],
                   "gpu_pids": m.gpu_pids, "size": m.total_size, "timings": res.timings,
                   "stall": res.stall, "left_running": leave_running})
        return
    click.echo(f"image {res.path}: {len(m.processes)} process(es), {len(m.gpu_pids)} on the GPU, "
               f"{human_bytes(m.total_size)}")
    click.echo(table(["phase", "seconds"], [[k, f"{v:.3f}"] for k, v in res.timings.items()]))
    if res.stall is not None:
        click.echo(f"the process was stopped for {res.stall:.3f} s and is running again")


@cli.command("restore", epilog=EXIT_CODES_HELP)
@click.argument("image", metavar="IMAGE")
@click.option("--no-verify", is_flag=True,
              help="Do not check chunks against their names as they are read (an image of format 4 "
                   "or older: skip checking every file's sha256 first).")
@click.option("--eager", is_flag=True,
              help="A process under `gpuos run` goes on only once all its GPU memory is back "
                   "(default: at once, each launch waiting only for the memory it touches).")
@click.option("--prefill/--no-prefill", default=True, show_default=True,
              help="While criu restores, put the GPU memory of processes under `gpuos run` on the "
                   "GPU from gpuos's own CUDA context, where the GPU has room for a second copy; "
                   "the process takes it by device copies once back. --no-prefill: all of it "
                   "streams through the process.")
@click.option("--tty", metavar="PATH",
              help="The terminal to give processes that had one (their own is used if it is "
                   "still there; e.g. --tty $(tty) takes this one).")
@click.option("--gpu", "gpus", metavar="N|UUID|OLD=N", multiple=True,
              help="Restore onto this GPU (index or UUID) instead of the one the image used; "
                   "for an image of several GPUs, OLD_UUID=N once per GPU to move.")
@click.option("--host-memory", type=click.Choice(["eager", "lazy"]), default="eager", show_default=True,
              help="lazy: the processes' host memory comes in as it is first touched, the rest "
                   "behind it (CRIU's lazy pages, served from the chunks; what the driver reads "
                   "comes first); said and done eagerly where the kernel refuses userfaultfd.")
@click.option("--replicas", type=click.IntRange(1, 256), metavar="N",
              help="Start N copies of the image's processes, each in pid, network and mount "
                   "namespaces of its own (as in a container: loopback only), all or none.")
@json_option
@click.pass_obj
def restore_cmd(rt: Runtime, image: str, no_verify: bool, eager: bool, prefill: bool, tty: str | None,
                gpus: tuple[str, ...], host_memory: str, replicas: int | None, as_json: bool) -> None:
    """Restore the processes of IMAGE (a name in the store, or a path).

    Checks first, changing nothing if any fails: the image is complete, a GPU of
    the same model with enough free memory is here
    (the one --gpu names, else the same GPU if present, else another of that
    model: the driver moves the process's memory there), the driver version
    is the same, every pid the image needs is free, and a terminal the processes
    had open is still there (or --tty names one). Then criu restores the tree
    with its original pids, in a session of its own (a shell's job on a terminal
    comes back as a job of the terminal this is run from), its files streamed to it
    from the chunk store, every chunk checked against its name before criu sees it
    (a bad one: nothing is left restored). The driver restores the GPU state; a process under
    `gpuos run` goes on at once while gpuos streams its GPU memory back behind it,
    each launch waiting only for the memory it touches (--eager: once all is back).
    The processes continue where they were checkpointed. Needs root.

    --replicas N starts N copies at once from one read of the image, for a
    scale-out: each copy keeps the image's pids inside a pid namespace of its
    own (its processes have other pids here), has a network of its own with
    loopback only, and ends when its pid 1 is killed. If one copy fails, none
    is left running. A replica cannot be checkpointed yet.

    --host-memory lazy lets the processes run before their host memory is back
    (slower than eager for a process that soon touches most of it, as an
    inference server's first request does; see the README).
    """
    startup = procs.age(os.getpid())  # the interpreter and gpuos's imports, for the report
    rep = Reporter(quiet=as_json)
    _recover_first(rt, rep)
    rt.store.load(rt.store.resolve(image))  # say "no such image" before anything about criu
    from ..restore import restore

    # cuInit goes on beside the checks and CRIU: only the GPU restore needs it
    res = restore(image, rt.paths.run, rt.store, lambda: rt.driver(wait_for_init=False), rt.criu(),
                  verify=not no_verify,
                  observer=rep, tty=tty, gpus=list(gpus), on_demand=not eager, replicas=replicas,
                  lazy_host=host_memory == "lazy", prefill=prefill)
    res.timings["startup"] = startup
    if as_json:
        out = {"ok": True, "pid": res.pid, "timings": res.timings, "gpu_map": res.gpu_map,
               "fills": {str(p): f for p, f in res.fills.items()}, "host_memory": res.host_memory,
               "criu_marks": res.criu_marks, "criu_gaps": res.criu_gaps, "decoders": res.decoders}
        if replicas is not None:
            out["replicas"] = [{"pid": pl.root, "init": pl.init, "pids": {str(k): v for k, v in pl.pids.items()}}
                               for pl in res.placements]
        emit_json(out)
        return
    what = " ".join(res.manifest.processes[0].cmdline)[:80]
    if replicas is None:
        click.echo(f"restored pid {res.pid} ({what})")
    else:
        click.echo(f"restored {len(res.placements)} replicas of {what}: pids "
                   + ", ".join(f"{pl.root} (pid 1 {pl.init})" for pl in res.placements))
    click.echo(table(["phase", "seconds"], [[k, f"{v:.3f}"] for k, v in res.timings.items()]))
    host = res.host_memory
    if host["on_demand"]:
        served = host.get("served", {})
        click.echo(f"host memory on demand: {served.get('pages', 0) * 4096 >> 20} MiB served lazily "
                   f"in {served.get('requests', 0)} requests")
    elif host["why_not"]:
        click.echo(f"host memory restored before the processes ran: {host['why_not']}")
    for pid, f in res.fills.items():
        click.echo(f"pid {pid}: {human_bytes(f.bytes)} of GPU memory back in {f.seconds:.3f} s, "
                   + (f"the process going on after {f.resumed_after:.3f} s" if f.on_demand else "then it went on")
                   + (f"; {f.waited_for_all} calls waited for all of it ({'; '.join(f.why)})"
                      if f.waited_for_all else "")
                   + (f"; {human_bytes(f.prefilled)} of it put on the GPU while criu restored"
                      if f.prefilled else f"; no prefill: {f.prefill_why_not}" if f.prefill_why_not else ""))


@cli.command("recover")
@json_option
@click.pass_obj
def recover_cmd(rt: Runtime, as_json: bool) -> None:
    """Finish or undo operations of a gpuos that was killed.

    Every checkpoint and restore keeps a journal while it runs. For each one
    whose gpuos died: processes left locked or checkpointed on the GPU are
    restored and left running; a checkpoint whose dump had completed is
    published (its process is gone); anything else half-written is deleted.
    Every gpuos command that changes something does this first.
    """
    actions = rt.recover()
    if as_json:
        emit_json({"ok": all(a.ok for a in actions), "actions": actions})
    else:
        for a in actions:
            click.echo(("" if a.ok else "FAILED: ") + a.action)
        if not actions:
            click.echo("nothing to recover")
    if not all(a.ok for a in actions):
        sys.exit(GpuosError.exit_code)


@cli.command("ps")
@json_option
@click.pass_obj
def ps_cmd(rt: Runtime, as_json: bool) -> None:
    """List the GPU processes on this host and their checkpoint state.

    State is the driver's: running, locked (CUDA calls blocked), checkpointed
    (GPU memory moved to host memory), or failed. Processes whose GPU state is
    checkpointed hold no GPU memory and are found through /proc.
    """
    from ..ps import gpu_processes
    rows = gpu_processes(rt.driver())
    if as_json:
        emit_json({"ok": True, "processes": rows})
        return
    if os.geteuid() != 0:
        click.echo("(not root: processes of other users may be missing)", err=True)
    click.echo(table(["PID", "STATE", "GPU MEM", "COMMAND"],
                     [[r.pid, r.state, human_bytes(r.gpu_memory), r.command[:80]] for r in rows]))


@cli.command("demo", epilog=EXIT_CODES_HELP)
@click.option("--steps", type=click.IntRange(30, 100000), default=150, show_default=True,
              help="Training steps.")
@click.option("--keep", is_flag=True, help="Keep the job's logs (their folder is printed).")
@json_option
@click.pass_obj
def demo_cmd(rt: Runtime, steps: int, keep: bool, as_json: bool) -> None:
    """Checkpoint, kill and restore a PyTorch training job; check nothing changed.

    Runs a small bundled training job (CNN + MLP, cuDNN and cuBLAS, a data
    loader thread) once uninterrupted, then again: a third of the way through
    it is checkpointed (and killed), restored from the image, and left to
    finish. Its loss at every step must be bit-identical to the uninterrupted
    run's. Prints the time of every phase. Needs root and a GPU.
    """
    from ..demo import run_demo
    rep = Reporter(quiet=as_json)
    _recover_first(rt, rep)
    report = run_demo(rt, steps=steps, keep=keep, observer=rep, say=rep.say)
    if as_json:
        emit_json({"ok": True, "steps": report.steps, "checkpoint_at_step": report.checkpoint_at_step,
                   "identical": report.identical, "image_size": report.checkpoint.manifest.total_size,
                   "checkpoint_timings": report.checkpoint.timings,
                   "restore_timings": report.restore.timings, "workdir": report.workdir})
        return
    rows = [["checkpoint", k, f"{v:.3f}"] for k, v in report.checkpoint.timings.items()]
    rows += [["restore", k, f"{v:.3f}"] for k, v in report.restore.timings.items()]
    click.echo(table(["", "phase", "seconds"], rows))
    click.echo(f"image: {human_bytes(report.checkpoint.manifest.total_size)}")
    click.echo(f"OK: checkpointed at step {report.checkpoint_at_step} of {report.steps}, killed, "
               f"restored; all {report.steps} losses bit-identical to the uninterrupted run")
    if keep:
        click.echo(f"logs: {report.workdir}")





def main() -> None:
    cli(prog_name="gpuos")
