"""`gpuos mps`: NVIDIA's MPS for one GPU, supervised: started, watched, recovered after faults."""

from __future__ import annotations

import os
import shlex
import sys
import time
from pathlib import Path

import click

from .. import procs
from ..errors import (Busy, GpuosError, MpsFailed, MpsForeign, MpsNotReady, MpsNotRunning,
                      NotPermitted, Timeout)
from ..mps.checkpoint import absolute as checkpoint_path
from ..mps.control import MpsCommandError, MpsControl, find_mps_binaries, foreign_daemons
from ..mps.gpu import (ComputeMode, GpuRef, MpsDirs, all_dirs, find_nvidia_smi,
                       process_memory, resolve_gpu)
from ..mps.launch import output_path
from ..mps.standby import memory_still_shared, preload_report
from ..mps.state import POLICIES, TRACKER_SOURCE, Machine, Settings, State
from ..mps.store import (EventLog, SavedState, StateStore, SupervisorLock, boot_id,
                          describe_event, supervisor_pid)
from ..mps.supervisor import Options, Supervisor, request, spawn_supervisor
from ..runtime import Runtime
from .output import emit_json, human_bytes, json_option, table

FINAL_CLIENT_STATES = ("exited", "failed", "not-recovered", "gave-up", "stopped", "cancelled",
                       "hooked")

MPS_EXIT_CODES = """\b
Exit codes (all of `gpuos --help` apply):
   0 success                    28 timed out waiting (stop, recover)
   1 other error                35 MPS binaries missing
   2 bad usage                  36 an MPS daemon gpuos did not start serves the GPU
   4 not permitted              37 no gpuos MPS supervisor (running) for the GPU
  16 no such GPU                38 the GPU or its server refuses clients
  18 busy (stop: processes      39 the supervisor failed (`gpuos mps recover`)
     gpuos did not start use the server)
"""

gpu_option = click.option(
    "--gpu", "gpu_spec", metavar="N|UUID",
    help="The GPU: its index (as nvidia-smi numbers them) or UUID [default: the only GPU with a "
         "gpuos MPS supervisor; for start, GPU 0].")


def _known(rt: Runtime) -> list[tuple[GpuRef, MpsDirs, SavedState]]:
    out = []
    for d in all_dirs(rt.paths):
        try:
            saved = StateStore(d).load()
        except GpuosError:
            continue
        if saved is not None:
            out.append((GpuRef.from_dict(saved.gpu), d, saved))
    return out


def _target(rt: Runtime, spec: str | None) -> tuple[GpuRef, MpsDirs, SavedState]:
    """The GPU a command is about, which must have MPS state (a supervisor, running or not)."""
    known = _known(rt)
    if spec is None:
        if len(known) == 1:
            return known[0]
        if not known:
            raise MpsNotRunning("no gpuos MPS supervisor on this host (start one: gpuos mps start)")
        raise click.UsageError("several GPUs have a gpuos MPS supervisor: give --gpu ("
                               + ", ".join(g.key for g, _, _ in known) + ")")
    for g, d, s in known:
        if g.matches(spec):
            return g, d, s
    gpu = resolve_gpu(spec)
    dirs = MpsDirs.for_gpu(rt.paths, gpu)
    saved = StateStore(dirs).load()
    if saved is None:
        raise MpsNotRunning(f"no gpuos MPS supervisor for {gpu.describe()} (gpuos mps start --gpu {spec})")
    return gpu, dirs, saved


def _machine(saved: SavedState) -> Machine:
    return Machine.from_snapshot(saved.machine)


def _wait(dirs: MpsDirs, done, timeout: float, proc=None, what: str = "the supervisor"):
    """Poll the state file until done(saved, sup_pid) is true; the last SavedState."""
    deadline = time.monotonic() + timeout
    store = StateStore(dirs)
    while True:
        saved = store.load()
        pid = supervisor_pid(dirs)
        if saved is not None and done(saved, pid):
            return saved
        if proc is not None and proc.poll() is not None and pid is None:
            saved = store.load()
            if saved is not None and done(saved, pid):
                return saved
            tail = ""
            try:
                tail = dirs.supervisor_log.read_text().strip().splitlines()[-1]
            except (OSError, IndexError):
                pass
            raise MpsFailed(f"{what} exited (status {proc.returncode}): {tail or 'see ' + str(dirs.supervisor_log)}")
        if time.monotonic() > deadline:
            raise Timeout(f"{what} did not get there in {timeout:g} s (state "
                          f"{saved.machine['state'] if saved else '?'}); see {dirs.events}")
        time.sleep(0.05)


def _written_by(saved: SavedState, proc) -> bool:
    """The state file was written by the supervisor process proc (not by its predecessor)."""
    return bool(saved.supervisor) and saved.supervisor.get("pid") == proc.pid


def _env_lines(dirs: MpsDirs, gpu: GpuRef) -> list[str]:
    lines = [f"export CUDA_MPS_PIPE_DIRECTORY={shlex.quote(str(dirs.pipe))}",
             f"export CUDA_MPS_LOG_DIRECTORY={shlex.quote(str(dirs.log))}"]
    if gpu.uuid:
        lines.append(f"export CUDA_VISIBLE_DEVICES={gpu.uuid}")
    return lines


def _describe_failure(m: Machine) -> GpuosError:
    text = m.failure or "the supervisor failed"
    if "did not start serves" in text or "gpuos did not start" in text:
        return MpsForeign(text)
    return MpsFailed(text + "; `gpuos mps recover` tries again")


@click.group()
def mps() -> None:
    """NVIDIA MPS for one GPU, supervised by gpuos.

    MPS (the Multi-Process Service) lets the CUDA processes of one user share a GPU
    concurrently through one server process.  On the stock driver one client's fatal
    GPU fault takes every client of that server down, and the server accepts no new
    client until all of them have exited.

    gpuos runs MPS's control daemon for one GPU with its own pipe and log directories
    ($GPUOS_HOME/mps/GPU/pipe, .../log), supervises it, and recovers from such faults:
    it notices the fault (kernel log, NVML, a server that died or reports FAULT), waits
    for every client of the server to exit (killing those that do not), makes sure a
    server accepts clients again, then recovers each victim by its policy: run its
    command again (restart), run a recovery hook (hook), or nothing (none).  Every step
    is an event in $GPUOS_HOME/mps/GPU/events.jsonl and the fault journal.

    A victim restarts from its beginning, or from its own application checkpoint
    through a hook: the driver's checkpoint API refuses MPS clients, so no GPU state
    survives the fault (docs/mps.md says exactly what is lost).

    \b
    Typical use:
      sudo gpuos mps start --gpu 0
      gpuos mps run --policy restart -- python3 train.py
      gpuos mps status; gpuos mps clients
      sudo gpuos mps stop
    """


# -- start ---------------------------------------------------------------------------------

@mps.command("start", epilog=MPS_EXIT_CODES)
@gpu_option
@click.option("--exclusive", is_flag=True,
              help="Set the GPU's compute mode to EXCLUSIVE_PROCESS (nvidia-smi -c), so that only "
                   "MPS uses it; the previous mode is recorded and `gpuos mps stop` restores it. "
                   "Without this flag the compute mode is never changed.")
@click.option("--foreground", is_flag=True,
              help="Supervise in this process (for systemd and the like), printing every event on "
                   "stderr, until `gpuos mps stop`, SIGTERM or Ctrl-C stops MPS.")
@click.option("--policy", type=click.Choice(POLICIES), default=None,
              help="Default recovery policy of clients that set none [default: restart].")
@click.option("--hook", metavar="CMD", default=None,
              help="Default recovery hook (a shell command) for policy hook.")
@click.option("--spare-server", is_flag=True,
              help="Run a second MPS control daemon on the GPU, the spare: standbys (policy "
                   "standby) are its clients, warm (context made, weights in, waiting at their "
                   "first kernel launch), and take over the moment a fault hits the active server; "
                   "then the two swap roles. Costs each standby's GPU memory and a second MPS "
                   "server. Set when a supervisor starts afresh; a resumed one keeps its setting.")
@click.option("--end-faulted-server/--keep-faulted-server", default=None,
              help="On a fault, kill the faulted MPS server at once (SIGKILL), so that the driver "
                   "tears its context down now, not when the last of its clients has exited; "
                   "its clients' next CUDA calls fail, even one the fault would have spared. "
                   "Experimental [default: keep].")
@click.option("--hold-victims", type=click.FloatRange(0, 60), default=None, metavar="S",
              help="With --spare-server: on a fault, stop every victim whose warm standby waits "
                   "(SIGSTOP; not the faulter a fault tracker named), release their standbys at "
                   "once, and kill the stopped victims (SIGKILL) S seconds later, so "
                   "that the driver's teardown of their contexts does not hold up the standbys' "
                   "first work. 0: off. Experimental [default: 0].")
@click.option("--share-standby-memory/--no-share-standby-memory", default=None,
              help="With --spare-server: each warm standby maps the GPU memory its client made "
                   "before its first launch (weights) where it holds the same content, instead of "
                   "a second copy, and keeps its own in host memory, put back where the client "
                   "writes (while it waits, or at a take-over). Experimental [default: off].")
@click.option("--standby-refresh", type=click.FloatRange(1, 86400), default=None, metavar="S",
              help="A standby of a client that names its checkpoint (`gpuos mps run --checkpoint`) "
                   "is replaced by one started from a newer checkpoint once it is S seconds old (the "
                   "old one kept until the new one waits): a standby resumes from the checkpoint "
                   "there was at its own start [default: 30].")
@click.option("--fault-feed", "feeds", multiple=True, type=click.Path(dir_okay=False),
              metavar="FILE",
              help="Also follow FILE for fault events: JSON lines as `gpuos faults watch --json` "
                   "writes them. Repeatable.")
@click.option("--no-kmsg", is_flag=True, help="Do not read the kernel log for Xid lines.")
@click.option("--no-nvml", is_flag=True, help="Do not listen to NVML error events.")
@click.option("--no-fault-trackers", is_flag=True,
              help="Do not put UVM fault trackers on the clients' address spaces. As root they "
                   "name the client whose GPU work took a fatal memory fault (Xid 31), which the "
                   "Xid line may not; a client that causes --max-faults faults is not restarted.")
@click.option("--drain-grace", type=click.FloatRange(0, 3600), default=None, metavar="S",
              help="Seconds the victims of a fault get to exit on their own before SIGTERM, then "
                   "as long again (--kill-grace) before SIGKILL [default: 10].")
@click.option("--kill-grace", type=click.FloatRange(0.1, 3600), default=None, metavar="S",
              help="Seconds from SIGTERM to SIGKILL, and at `gpuos mps stop` [default: 5].")
@click.option("--restart-attempts", type=click.IntRange(1, 1000), default=None, metavar="N",
              help="Tries to get a server that accepts clients after a fault, with exponential "
                   "backoff from 0.5 s up to 30 s, before the supervisor fails [default: 8].")
@click.option("--max-restarts", type=click.IntRange(0, 1000000), default=None, metavar="N",
              help="Times one client is recovered (restart or hook) before gpuos gives up on it "
                   "[default: 3].")
@click.option("--max-faults", type=click.IntRange(1, 1000000), default=None, metavar="N",
              help="A client that the fault trackers name as the faulter N times is not recovered "
                   "again [default: 2].")
@click.option("--hook-timeout", type=click.FloatRange(0.1, 86400), default=None, metavar="S",
              help="Seconds a recovery hook may run before it is killed [default: 300].")
@click.option("--poll", type=click.FloatRange(0.02, 10), default=None, metavar="S",
              help="Seconds between the supervisor's checks [default: 0.25]; 0.02 while a "
                   "process it follows is under 10 s old and has no fault tracker yet.")
@click.option("--timeout", type=click.FloatRange(1, 3600), default=60, show_default=True,
              metavar="S", help="Seconds to wait for the supervisor to be up.")
@json_option
@click.pass_obj
def start_cmd(rt: Runtime, gpu_spec, exclusive, foreground, policy, hook, spare_server,
              end_faulted_server, hold_victims, share_standby_memory, standby_refresh, feeds,
              no_kmsg, no_nvml,
              no_fault_trackers, drain_grace, kill_grace, restart_attempts, max_restarts, max_faults,
              hook_timeout, poll,
              timeout, as_json) -> None:
    """Start MPS on one GPU under a gpuos supervisor.

    Starts `nvidia-cuda-mps-control -d` with CUDA_MPS_PIPE_DIRECTORY and
    CUDA_MPS_LOG_DIRECTORY under $GPUOS_HOME/mps/GPU/ and CUDA_VISIBLE_DEVICES set
    to the GPU, and a supervisor process (detached, unless --foreground) that
    watches it and recovers its clients after a fault.  Clients started with
    `gpuos mps run` can be recovered; any other CUDA process of the same user that
    sets the printed CUDA_MPS_PIPE_DIRECTORY uses this MPS too, but is only
    reported, not restarted.

    Refuses (exit 36) when an MPS control daemon gpuos did not start runs and serves
    this GPU (or its environment cannot be read), and (exit 38) when the GPU's
    compute mode is Prohibited.  Changes the compute mode only with --exclusive,
    and says so.

    If a previous supervisor of this GPU was killed, this resumes its work: clients
    still running are adopted, an interrupted recovery is finished (see `gpuos mps
    recover`).  If one runs already, says so and exits 0.
    """
    binaries = find_mps_binaries()
    gpu = None
    if gpu_spec is None:
        known = _known(rt)
        if len(known) == 1:
            gpu = known[0][0]
    if gpu is None:
        gpu = resolve_gpu(gpu_spec)
    dirs = MpsDirs.for_gpu(rt.paths, gpu)
    store = StateStore(dirs)
    running = supervisor_pid(dirs)
    if running is not None:
        saved = store.load()
        state = saved.machine["state"] if saved else "?"
        if as_json:
            emit_json({"ok": True, "already_running": True, "gpu": gpu, "supervisor_pid": running,
                       "state": state, "pipe_dir": dirs.pipe})
        else:
            click.echo(f"MPS on {gpu.describe()} is already supervised by gpuos (pid {running}, "
                       f"{state})")
        return
    notes: list[str] = []
    dirs.root.mkdir(parents=True, exist_ok=True)  # the rest is the supervisor's
    lock = SupervisorLock(dirs)
    if not lock.try_acquire():
        raise Busy(f"a gpuos MPS supervisor is starting for {gpu.describe()}")
    try:
        saved = store.load()
        if saved is not None and saved.boot_id and saved.boot_id != boot_id():
            old = _machine(saved)
            lost = [c.id for c in old.clients.values() if c.state in ("running", "victim", "starting")]
            dest = store.archive("previous-boot")
            notes.append(f"the state of a supervisor from before the last boot was moved to {dest}"
                         + (f"; its clients {', '.join(lost)} are not restarted" if lost else ""))
            EventLog(dirs.events).append({"time": time.time(), "gpu": gpu.key, "event": "previous-boot",
                                          "state": old.state.value, "incident": None,
                                          "archived": str(dest), "clients_lost": lost})
            saved = None
        fresh = saved is None
        if len(str(dirs.pipe.absolute())) > 70:
            notes.append(f"the pipe directory's path is {len(str(dirs.pipe.absolute()))} bytes long: "
                         "MPS's sockets in it must fit in 108; if the daemon fails, use a shorter "
                         "GPUOS_HOME")
        spare = spare_server if fresh else _machine(saved).settings.spare_server
        if not fresh and spare_server and not spare:
            notes.append("--spare-server ignored: the supervisor resumed keeps its setting "
                         "(stop it first to change it)")
        if share_standby_memory and not spare:
            raise click.UsageError("--share-standby-memory needs --spare-server: only warm standbys "
                                   "share their clients' memory")
        if hold_victims and not spare:
            raise click.UsageError("--hold-victims needs --spare-server: victims are held only "
                                   "while warm standbys on the spare take their place")
        pipes = [dirs.pipe_of(s) for s in ((0, 1) if spare else (None,))]
        ours = {MpsControl(binaries, p, p, gpu.visible).daemon_pid() for p in pipes} - {None}
        foreign = foreign_daemons(pipes, ours, gpu, binaries)
        if foreign:
            raise MpsForeign(f"an MPS control daemon gpuos did not start serves {gpu.describe()}: "
                             + "; ".join(foreign) + ". Stop it (echo quit | nvidia-cuda-mps-control, "
                             "with its CUDA_MPS_PIPE_DIRECTORY) or let it be; nothing was changed")
        cm = ComputeMode(find_nvidia_smi())
        mode = cm.query(gpu)
        compute = (saved.compute_mode if saved is not None and saved.compute_mode
                   and not saved.compute_mode.get("restored") else None)
        if mode and mode.lower().startswith("prohibited") and not exclusive:
            raise MpsNotReady(f"{gpu.describe()} is in compute mode Prohibited: it accepts no CUDA "
                              "context, so no MPS server; gpuos changes the mode only when asked "
                              "(--exclusive)")
        changed_now = False
        if exclusive and compute is None:
            if mode and mode.lower() == "exclusive_process":
                notes.append("compute mode already Exclusive_Process: unchanged")
            else:
                cm.set(gpu, "EXCLUSIVE_PROCESS")
                compute = {"previous": mode or "Default", "set": "Exclusive_Process",
                           "at": time.time()}
                changed_now = True
                notes.append(f"compute mode changed: {mode or 'unknown'} -> Exclusive_Process "
                             "(`gpuos mps stop` restores it)")
        if fresh:
            settings = Settings(spare_server=spare_server)
            machine = Machine(gpu.key, settings)
            options = Options()
        else:
            machine = _machine(saved)
            settings = machine.settings
            options = Options.from_dict(saved.options)
        for name, value in (("drain_grace", drain_grace), ("kill_grace", kill_grace),
                            ("restart_attempts", restart_attempts), ("max_restarts", max_restarts),
                            ("max_faults", max_faults),
                            ("hook_timeout", hook_timeout), ("default_policy", policy),
                            ("default_hook", hook), ("end_faulted_server", end_faulted_server),
                            ("hold_victims", hold_victims), ("standby_refresh", standby_refresh),
                            ("share_standby_memory", share_standby_memory)):
            if value is not None:
                setattr(settings, name, value)
        if kill_grace is not None:
            settings.stop_grace = kill_grace * 2
        if feeds:
            options.feeds = [str(Path(f).absolute()) for f in feeds]
        options.kmsg, options.nvml = not no_kmsg, not no_nvml
        options.trackers = not no_fault_trackers
        if poll is not None:
            options.poll = poll
            options.mps_poll = max(poll, min(0.5, 2 * poll))
        was = machine.state.value
        saved = SavedState(gpu=gpu.to_dict(), machine=machine.snapshot(), boot_id=boot_id(),
                           compute_mode=compute, options=_opts(options),
                           supervisor=saved.supervisor if saved else None)
        store.save(saved)
    except BaseException:
        lock.release()
        raise
    lock.release()
    resumed = None if fresh else was
    if foreground:
        say = (lambda s: None) if as_json else (lambda s: click.echo(s, err=True))
        for n in notes:
            say(f"gpuos: {n}")
        if resumed:
            say(f"gpuos: resuming the supervisor's work (it was {resumed})")
        say(f"gpuos: MPS on {gpu.describe()}: " + "; ".join(_env_lines(dirs, gpu)))
        code = Supervisor(rt.paths, dirs, say=say).run(fresh=fresh)
        final = store.load()
        if as_json:
            emit_json({"ok": code == 0, "gpu": gpu, "state": final.machine["state"] if final else None,
                       "failure": final.machine.get("failure") if final else None, "notes": notes})
        if code != 0 and final is not None:
            m = _machine(final)
            raise _describe_failure(m)
        return
    proc = spawn_supervisor(dirs, fresh)
    try:
        saved = _wait(dirs, lambda s, pid: _written_by(s, proc) and s.machine["state"] != "starting"
                      and (pid is not None or s.machine["state"] in ("failed", "stopped")),
                      timeout, proc)
    except BaseException:
        if changed_now:
            _undo_compute(cm, gpu, compute, notes)
            for n in notes:
                click.echo(f"gpuos: {n}", err=True)
        raise
    m = _machine(saved)
    if m.state is State.FAILED:
        if changed_now:
            _undo_compute(cm, gpu, compute, notes)
            saved.compute_mode = None
            store.save(saved)
        for n in notes:
            click.echo(f"gpuos: {n}", err=True)
        raise _describe_failure(m)
    info = {"ok": True, "already_running": False, "gpu": gpu, "supervisor_pid": supervisor_pid(dirs),
            "state": m.state.value, "resumed": resumed, "daemon_pid": m.daemon_pid,
            "pipe_dir": dirs.pipe, "log_dir": dirs.log, "compute_mode": saved.compute_mode,
            "compute_mode_now": cm.query(gpu), "notes": notes,
            "incident": m.incident.summary() if m.incident else None,
            "env": {"CUDA_MPS_PIPE_DIRECTORY": str(dirs.pipe),
                    "CUDA_MPS_LOG_DIRECTORY": str(dirs.log),
                    **({"CUDA_VISIBLE_DEVICES": gpu.uuid} if gpu.uuid else {})}}
    if as_json:
        emit_json(info)
        return
    for n in notes:
        click.echo(f"gpuos: {n}", err=True)
    click.echo(f"MPS on {gpu.describe()}: control daemon pid {m.daemon_pid}, supervisor pid "
               f"{info['supervisor_pid']}" + (f" (resumed; it was {resumed})" if resumed else ""))
    if not exclusive:
        click.echo(f"compute mode: {info['compute_mode_now'] or 'unknown (no nvidia-smi)'} (unchanged)")
    if m.incident is not None:
        click.echo(f"recovering: incident {m.incident.id} ({m.incident.cause}), {m.state.value}")
    click.echo("clients: gpuos mps run -- CMD (recoverable), or any CUDA program with:")
    for line in _env_lines(dirs, gpu):
        click.echo(f"  {line}")


def _opts(o: Options) -> dict:
    from dataclasses import asdict
    return asdict(o)


def _undo_compute(cm: ComputeMode, gpu: GpuRef, compute: dict, notes: list[str]) -> None:
    try:
        cm.set(gpu, compute["previous"])
        notes.append(f"compute mode restored to {compute['previous']}")
    except GpuosError as exc:
        notes.append(f"could not restore the compute mode to {compute['previous']}: {exc.message}")


# -- stop ----------------------------------------------------------------------------------

@mps.command("stop", epilog=MPS_EXIT_CODES)
@gpu_option
@click.option("--grace", type=click.FloatRange(0, 3600), default=None, metavar="S",
              help="Seconds clients get to exit after SIGTERM before SIGKILL [default: the "
                   "supervisor's, 10].")
@click.option("--force", is_flag=True,
              help="Stop even while CUDA processes gpuos did not start are connected (they lose "
                   "their MPS server).")
@click.option("--timeout", type=click.FloatRange(1, 3600), default=120, show_default=True,
              metavar="S", help="Seconds to wait for everything to stop.")
@json_option
@click.pass_obj
def stop_cmd(rt: Runtime, gpu_spec, grace, force, timeout, as_json) -> None:
    """Stop MPS on a GPU: its clients, its daemon and server, its supervisor.

    Clients started by `gpuos mps run` get SIGTERM (their whole process group), then
    SIGKILL after --grace; then the control daemon is told to quit (`quit`), and
    killed if it does not.  A compute mode set by `start --exclusive` is restored.
    Refuses (exit 18) while processes gpuos did not start are connected to the
    server, unless --force.  Works also when the supervisor was killed.  Stopping
    what is stopped says so and exits 0.
    """
    gpu, dirs, saved = _target(rt, gpu_spec)
    pid = supervisor_pid(dirs)
    m = _machine(saved)
    ctl = None
    try:
        ctl = MpsControl(find_mps_binaries(), dirs.pipe, dirs.log, gpu.visible)
    except GpuosError:
        pass
    daemon = ctl.daemon_pid() if ctl else None
    if pid is None and m.state is State.STOPPED and daemon is None:
        if as_json:
            emit_json({"ok": True, "gpu": gpu, "state": "stopped", "already_stopped": True})
        else:
            click.echo(f"MPS on {gpu.describe()} is not running")
        return
    if not force and ctl is not None and daemon is not None:
        managed = {p for c in m.clients.values() for p in (c.pid, c.standby_pid) if p}
        others: list[int] = []
        try:
            for s in ctl.server_list():
                others += [p for p in ctl.client_list(s) if p not in managed and procs.alive(p)]
        except MpsCommandError:
            pass
        if others:
            raise Busy(f"processes gpuos did not start use this MPS server (pids "
                       f"{', '.join(map(str, sorted(others)))}): stop them, or use --force; "
                       "nothing was stopped")
    if pid is not None:
        request(dirs, {"op": "stop", "grace": grace})
        deadline = time.monotonic() + timeout
        saved = _wait(dirs, lambda s, p: p is None, timeout, what="stopping MPS")
        # The supervisor lets go of its lock before its interpreter exits (seen in CI:
        # still alive just after): "stopped" means the process is gone too.
        while procs.alive(pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        if procs.alive(pid):
            raise Timeout(f"the supervisor (pid {pid}) let go of its lock but did not exit "
                          f"in {timeout:g} s")
    else:
        say = (lambda s: None) if as_json else (lambda s: click.echo(s, err=True))
        Supervisor(rt.paths, dirs, say=say).run(stop=True if grace is None else grace)
        saved = StateStore(dirs).load()
    m = _machine(saved)
    cm = saved.compute_mode or {}
    stopped = [c.id for c in m.clients.values() if c.state == "stopped"]
    if as_json:
        emit_json({"ok": m.state is State.STOPPED, "gpu": gpu, "state": m.state.value,
                   "clients_stopped": stopped, "compute_mode": cm or None})
    else:
        click.echo(f"MPS on {gpu.describe()}: {m.state.value}"
                   + (f"; clients stopped: {', '.join(stopped)}" if stopped else ""))
        if cm.get("restored"):
            click.echo(f"compute mode restored: {cm['set']} -> {cm['restored']}")
        elif cm.get("restore_error"):
            click.echo(f"compute mode NOT restored ({cm['restore_error']}); it is {cm['set']}, "
                       f"it was {cm['previous']}")
    if m.state is not State.STOPPED:
        raise MpsFailed(f"MPS on {gpu.describe()} did not stop: {m.state.value}")


# -- status ----------------------------------------------------------------------------------

def _status_of(gpu: GpuRef, dirs: MpsDirs, saved: SavedState, events: int) -> dict:
    m = _machine(saved)
    pid = supervisor_pid(dirs)
    daemon_alive = bool(m.daemon_pid) and procs.alive(m.daemon_pid)
    server_alive = bool(m.server_pid) and procs.alive(m.server_pid)
    counts: dict[str, int] = {}
    for c in m.clients.values():
        counts[c.state] = counts.get(c.state, 0) + 1
    unfinished = pid is None and m.state not in (State.STOPPED,)
    return {
        "gpu": gpu, "state": m.state.value, "supervisor_pid": pid,
        "supervisor_running": pid is not None,
        "unfinished": unfinished,
        "daemon_pid": m.daemon_pid, "daemon_alive": daemon_alive,
        "server_pid": m.server_pid, "server_alive": server_alive, "server_status": m.server_status,
        "spare": None if m.slot is None else {
            "state": m.spare, "slot": 1 - m.slot, "daemon_pid": m.spare_daemon_pid,
            "server_pid": m.spare_server_pid, "pipe_dir": dirs.pipe_of(1 - m.slot),
            "hold_victims": m.settings.hold_victims, "end_faulted_server": m.settings.end_faulted_server,
            "share_standby_memory": m.settings.share_standby_memory},
        "pipe_dir": dirs.pipe, "log_dir": dirs.log, "events_file": dirs.events,
        "default_policy": m.settings.default_policy, "default_hook": m.settings.default_hook,
        "standby_refresh": m.settings.standby_refresh,
        "clients": counts, "unmanaged_clients": m.unmanaged,
        "incident": m.incident.summary() if m.incident else None,
        "incidents": m.history[-5:], "failure": m.failure,
        "compute_mode": saved.compute_mode,
        "events": EventLog(dirs.events).read(last=events) if events else [],
        "updated": saved.updated,
    }


def lost_text(v: dict) -> str:
    """A victim's work lost, for people: ", 12.3 s of work lost (since its checkpoint)"."""
    if v.get("lost_s") is None:
        return ""
    since = "since its checkpoint" if v.get("resumes_from") == "checkpoint" else "its whole run"
    return f", {v['lost_s']:.1f} s of work lost ({since})"


def _victims_line(inc: dict) -> str:
    parts = []
    for v in inc["victims"]:
        who = v["client"] or f"pid {v['pid']}"
        role = {"named": " (named by the fault)", "faulter": " (the faulter)"}.get(v["role"], "")
        parts.append(f"{who}{role}: {v['recovery']}{lost_text(v)}")
    # A faulter a tracker named that is no victim: a client gpuos did not start, found by
    # its environment before the server's client list showed it.
    victims = {v["pid"] for v in inc["victims"]}
    for pid in dict.fromkeys(f.get("pid") for f in inc.get("faults", []) if f.get("source") == TRACKER_SOURCE):
        if pid is not None and pid not in victims:
            parts.append(f"pid {pid} (the faulter, not started by gpuos mps run)")
    return "; ".join(parts) or "none"


@mps.command("status", epilog=MPS_EXIT_CODES)
@gpu_option
@click.option("--events", "n_events", type=click.IntRange(0, 10000), default=10, show_default=True,
              metavar="N", help="How many of the latest events to show.")
@json_option
@click.pass_obj
def status_cmd(rt: Runtime, gpu_spec, n_events, as_json) -> None:
    """The supervisor's state, its MPS daemon and server, clients, incidents, events.

    Reads the supervisor's state file, so it works also when the supervisor is not
    running: then it says what the last one left unfinished (`gpuos mps recover`
    finishes it).  Without --gpu, every GPU with a gpuos MPS supervisor.
    """
    if gpu_spec is None:
        targets = _known(rt)
    else:
        targets = [_target(rt, gpu_spec)]
    rows = [_status_of(g, d, s, n_events) for g, d, s in targets]
    if as_json:
        emit_json({"ok": True, "gpus": rows})
        return
    if not rows:
        click.echo("no gpuos MPS supervisor on this host")
        return
    for st in rows:
        g = st["gpu"]
        sup = (f"supervisor pid {st['supervisor_pid']}" if st["supervisor_running"]
               else "supervisor NOT running")
        click.echo(f"{g.describe()}: {st['state']}; {sup}")
        if st["unfinished"] and st["state"] == "failed":
            click.echo("  unfinished: the supervisor gave up; `gpuos mps recover` tries again")
        elif st["unfinished"]:
            click.echo(f"  unfinished: the supervisor died while {st['state']}; "
                       "`gpuos mps recover` (or `gpuos mps start`) resumes it")
        if st["failure"]:
            click.echo(f"  failure: {st['failure']}")
        click.echo(f"  control daemon: {st['daemon_pid'] or '-'}"
                   f"{'' if st['daemon_alive'] or not st['daemon_pid'] else ' (gone)'}; server: "
                   f"{st['server_pid'] or '-'}{' ' + st['server_status'] if st['server_status'] else ''}"
                   f"{'' if st['server_alive'] or not st['server_pid'] else ' (gone)'}")
        if st["spare"]:
            sp = st["spare"]
            on_fault = ([f"victims held {sp['hold_victims']:g} s"] if sp["hold_victims"] else []) + (
                ["the faulted server killed"] if sp["end_faulted_server"] else [])
            click.echo(f"  spare server (slot {sp['slot']}, warm standbys): {sp['state']}; control "
                       f"daemon {sp['daemon_pid'] or '-'}; server {sp['server_pid'] or '-'}"
                       + (f"; on a fault: {', '.join(on_fault)}" if on_fault else ""))
        click.echo(f"  pipe directory: {st['pipe_dir']}")
        cm = st["compute_mode"]
        if cm and cm.get("set") and not cm.get("restored"):
            click.echo(f"  compute mode: {cm['set']} (set by gpuos; was {cm['previous']})")
        clients = ", ".join(f"{n} {s}" for s, n in sorted(st["clients"].items())) or "none"
        click.echo(f"  clients: {clients}; default policy {st['default_policy']}"
                   + (f" (hook: {st['default_hook']})" if st["default_hook"] else ""))
        if st["unmanaged_clients"]:
            click.echo(f"  other clients (not started by gpuos): "
                       f"{', '.join(map(str, st['unmanaged_clients']))}")
        inc = st["incident"]
        if inc:
            click.echo(f"  incident {inc['id']} ({inc['cause']}, Xid "
                       f"{','.join(str(f['xid']) for f in inc['faults']) or '-'}): {_victims_line(inc)}")
        for h in st["incidents"]:
            xids = ",".join(str(f["xid"]) for f in h["faults"]) or "-"
            dur = (h["closed"] - h["opened"]) if h.get("closed") else 0
            click.echo(f"  incident {h['id']}: {h['cause']} (Xid {xids}) -> {h['outcome']} in "
                       f"{dur:.1f} s; {_victims_line(h)}")
        for ev in st["events"]:
            click.echo(f"  {describe_event(ev)}"[:200])


# -- clients ---------------------------------------------------------------------------------

@mps.command("clients", epilog=MPS_EXIT_CODES)
@gpu_option
@json_option
@click.pass_obj
def clients_cmd(rt: Runtime, gpu_spec, as_json) -> None:
    """The clients of a GPU's MPS: pid, command, GPU memory, state.

    Clients started by `gpuos mps run` are listed with their id, policy and the
    times they were recovered; processes connected to the MPS server that gpuos did
    not start (get_client_list) are listed as "other".  GPU memory comes from NVML
    ("-" where it cannot say).
    """
    gpu, dirs, saved = _target(rt, gpu_spec)
    m = _machine(saved)
    live: list[int] = []
    note = None
    if m.daemon_pid and procs.alive(m.daemon_pid):
        try:
            ctl = MpsControl(find_mps_binaries(), dirs.pipe, dirs.log, gpu.visible)
            for s in ctl.server_list():
                live += ctl.client_list(s)
        except (GpuosError, MpsCommandError) as exc:
            note = f"the MPS daemon could not be asked for its clients: {getattr(exc, 'message', exc)}"
    mem = process_memory(gpu)
    rows = []
    managed = set()
    for c in m.clients.values():
        policy, hook = m.policy_of(c)
        alive = bool(c.pid) and procs.alive(c.pid)
        if c.pid:
            managed.add(c.pid)
        standby = c.standby_pid if c.standby_pid and procs.alive(c.standby_pid) else None
        rows.append({"id": c.id, "pid": c.pid, "state": c.state, "alive": alive,
                     "connected": c.pid in live, "policy": policy, "hook": hook,
                     "standby_pid": standby, "standby_warm": c.standby_warm,
                     "standby_preload": preload_report(dirs, c.id, standby)
                     if standby and c.standby_warm else None,
                     "restarts": c.restarts, "exit_status": c.exit_status,
                     "gpu_memory": mem.get(c.pid) if mem is not None and c.pid else None,
                     "standby_gpu_memory": mem.get(standby) if mem is not None and standby else None,
                     "command": c.cmd, "cwd": c.cwd, "uid": c.uid,
                     "output": str(output_path(dirs, c)), "checkpoint": c.checkpoint,
                     "checkpoint_at": c.checkpoint_at,
                     "standby_state_at": c.standby_state_at if standby else None,
                     "standby_replacement_pid": c.next_standby_pid
                     if c.next_standby_pid and procs.alive(c.next_standby_pid) else None})
    for p in sorted(set(live) - managed):
        try:
            cmd = procs.cmdline(p)
        except GpuosError:
            cmd = []
        rows.append({"id": None, "pid": p, "state": "other", "alive": procs.alive(p),
                     "connected": True, "policy": None, "hook": None, "standby_pid": None,
                     "standby_warm": False, "standby_preload": None,
                     "restarts": 0,
                     "exit_status": None, "gpu_memory": mem.get(p) if mem is not None else None,
                     "standby_gpu_memory": None, "command": cmd, "cwd": None, "uid": None, "output": None, "checkpoint": None,
                     "checkpoint_at": None, "standby_state_at": None, "standby_replacement_pid": None})
    if as_json:
        emit_json({"ok": True, "gpu": gpu, "server_pid": m.server_pid, "clients": rows,
                   "note": note})
        return
    if note:
        click.echo(f"gpuos: {note}", err=True)
    click.echo(table(["ID", "PID", "STATE", "POLICY", "STANDBY", "RESTARTS", "GPU MEM", "COMMAND"],
                     [[r["id"] or "-", r["pid"] if r["pid"] and r["alive"] else "-", r["state"],
                       r["policy"] or "-",
                       _standby_cell(r) if r["standby_pid"] else "-",
                       r["restarts"], human_bytes(r["gpu_memory"]) if r["gpu_memory"] is not None
                       else "-", shlex.join(r["command"])[:80]] for r in rows]))


def _standby_cell(row: dict) -> str:
    """"PID (cold)", "PID (warm)", or with what a warm one loaded ahead so far."""
    pre = row["standby_preload"]
    if not row["standby_warm"]:
        return f"{row['standby_pid']} (cold)"
    if not pre:
        return f"{row['standby_pid']} (warm)"
    warm = pre.get("cublas_warm_up")
    shared = pre.get("memory_shared") or {}
    return (f"{row['standby_pid']} (warm, {pre.get('loaded', 0)}/{pre.get('names', 0)} kernels ahead"
            + (f", cuBLAS started in {warm['seconds']:.2f} s" if warm else "")
            + (f", {human_bytes(memory_still_shared(shared))} of its client's memory shared"
               if shared and memory_still_shared(shared) else "")
            + ")")


# -- run -------------------------------------------------------------------------------------

@mps.command("run", epilog=MPS_EXIT_CODES,
             context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@gpu_option
@click.option("--policy", type=click.Choice(POLICIES), default=None,
              help="What to do when a fault takes this client down: restart (run CMD again, same "
                   "directory and environment), standby (keep a second copy of CMD waiting at its "
                   "first cuInit, its start-up done, and let it go on instead), hook (run --hook), "
                   "none [default: the supervisor's, restart].")
@click.option("--hook", metavar="CMD", default=None,
              help="Recovery hook for policy hook: a shell command, run as you in CMD's directory "
                   "with GPUOS_MPS_VICTIM_PID, GPUOS_MPS_VICTIM_CMD, GPUOS_MPS_VICTIM_CWD, "
                   "GPUOS_MPS_VICTIM_EXIT, GPUOS_MPS_INCIDENT, GPUOS_MPS_FAULT_XIDS, GPUOS_MPS_CLIENT "
                   "and the MPS variables set; e.g. one that resumes CMD from its own checkpoint.")
@click.option("--max-restarts", type=click.IntRange(0, 1000000), default=None, metavar="N",
              help="Recover this client at most N times [default: the supervisor's, 3].")
@click.option("--max-faults", type=click.IntRange(1, 1000000), default=None, metavar="N",
              help="Do not recover this client once the fault trackers have named it as the faulter "
                   "N times [default: the supervisor's, 2].")
@click.option("--output", type=click.Path(dir_okay=False), default=None, metavar="FILE",
              help="Append CMD's stdout and stderr (every run of it) to FILE, opened as you "
                   "[default: $GPUOS_HOME/mps/GPU/output/ID.log].")
@click.option("--checkpoint", metavar="PATH", default=None,
              help="Where CMD writes its own checkpoints and resumes from at its start: a file, "
                   "a directory (its entries) or a glob; the newest of your files there counts. "
                   "Each incident then says how much work the fault cost CMD, and under policy "
                   "standby a standby older than a newer checkpoint is started again from it.")
@click.option("--wait", is_flag=True,
              help="Follow CMD's output and wait until it is done for good (recoveries included); "
                   "exit with its status (128+N for signal N).")
@json_option
@click.argument("cmd", nargs=-1, required=True, type=click.UNPROCESSED)
@click.pass_obj
def run_mps_cmd(rt: Runtime, gpu_spec, policy, hook, max_restarts, max_faults, output, checkpoint, wait,
                as_json, cmd) -> None:
    """Run CMD as a client of the GPU's MPS, under the supervisor.

    \b
    gpuos mps run [OPTIONS] -- CMD [ARGS]...

    The supervisor starts CMD (as you, in this directory, with this environment
    plus CUDA_MPS_PIPE_DIRECTORY and CUDA_MPS_LOG_DIRECTORY of its daemon) and
    records how, so that it can run it again after a fault.  Prints the client's id
    and pid and returns, unless --wait.  While a fault is being recovered, new
    clients wait until the server is back.
    """
    gpu, dirs, saved = _target(rt, gpu_spec)
    m = _machine(saved)
    if supervisor_pid(dirs) is None:
        raise MpsNotRunning(f"the gpuos MPS supervisor of {gpu.describe()} is not running "
                            f"(it was {m.state.value}): gpuos mps start" +
                            ("" if m.state is State.STOPPED else " or gpuos mps recover"))
    eff = policy or m.settings.default_policy
    if eff == "hook" and not (hook or m.settings.default_hook):
        raise click.UsageError("--policy hook needs --hook CMD (no default hook is set)")
    if hook and eff != "hook":
        raise click.UsageError(f"--hook is used by policy hook only (the policy is {eff})")
    if output:
        try:  # as you: the supervisor will write there in your name
            os.close(os.open(output, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o640))
        except OSError as exc:
            raise GpuosError(f"--output {output}: {exc.strerror}") from None
    env = {k: v for k, v in os.environ.items()}
    reply = request(dirs, {"op": "run", "cmd": list(cmd), "cwd": os.getcwd(), "env": env,
                           "policy": policy, "hook": hook, "max_restarts": max_restarts,
                           "max_faults": max_faults,
                           "output": str(Path(output).absolute()) if output else None,
                           "checkpoint": checkpoint_path(checkpoint, os.getcwd()) if checkpoint else None})
    cid = reply["client"]
    if not wait:
        if as_json:
            emit_json({"ok": True, "gpu": gpu, **{k: v for k, v in reply.items() if k != "ok"}})
        else:
            state = f"pid {reply['pid']}" if reply.get("pid") else reply.get("state")
            click.echo(f"client {cid}: {state}, policy {reply['policy']}; output: {reply['output']}")
        return
    out_path = Path(reply["output"])
    pos = 0
    last = None
    while True:
        if not as_json:
            try:
                with open(out_path, "rb") as f:
                    f.seek(pos)
                    data = f.read()
                if data:
                    pos += len(data)
                    sys.stdout.buffer.write(data)
                    sys.stdout.flush()
            except (FileNotFoundError, PermissionError):
                pass
        saved = StateStore(dirs).load()
        c = _machine(saved).clients.get(cid) if saved else None
        if c is not None and c.state in FINAL_CLIENT_STATES:
            last = c
            break
        if supervisor_pid(dirs) is None:
            raise MpsNotRunning(f"the supervisor stopped while client {cid} ran "
                                f"(it is {c.state if c else '?'})")
        time.sleep(0.1)
    status = last.exit_status
    code = 1 if status is None else (128 - status if status < 0 else status)
    if as_json:
        emit_json({"ok": code == 0, "gpu": gpu, "client": cid, "state": last.state,
                   "exit_status": status, "restarts": last.restarts, "output": str(out_path)})
    if last.state not in ("exited", "hooked"):
        click.echo(f"gpuos: client {cid} {last.state} (exit status {status}, recovered "
                   f"{last.restarts} times)", err=True)
    sys.exit(code if last.state != "hooked" else 0)


# -- policy ----------------------------------------------------------------------------------

@mps.group("policy")
def policy_grp() -> None:
    """Recovery policies: what the supervisor does for a client a fault took down.

    \b
    restart  run the client's command again (same directory, environment, user);
             it starts from its beginning: nothing of its GPU or CPU state survives
    hook     run a recovery command (--hook) instead, e.g. one that resumes the job
             from its own application checkpoint
    none     record it and do nothing

    Each client has its own (set by `gpuos mps run --policy`) or the supervisor's
    default.  A client is recovered at most --max-restarts times, and not after the
    fault trackers have named it as the faulter --max-faults times.
    """


@policy_grp.command("get", epilog=MPS_EXIT_CODES)
@gpu_option
@click.option("--client", "client_id", metavar="ID", help="A client's id (gpuos mps clients).")
@json_option
@click.pass_obj
def policy_get(rt: Runtime, gpu_spec, client_id, as_json) -> None:
    """Show the default policy, or a client's."""
    gpu, dirs, saved = _target(rt, gpu_spec)
    m = _machine(saved)
    if client_id is None:
        data = {"client": None, "policy": m.settings.default_policy, "hook": m.settings.default_hook,
                "max_restarts": m.settings.max_restarts, "max_faults": m.settings.max_faults}
    else:
        c = m.clients.get(client_id)
        if c is None:
            raise GpuosError(f"no client {client_id} on {gpu.describe()} (gpuos mps clients)")
        policy, hook = m.policy_of(c)
        data = {"client": c.id, "policy": policy, "hook": hook, "own": c.policy is not None,
                "max_restarts": c.max_restarts if c.max_restarts is not None
                else m.settings.max_restarts, "restarts": c.restarts,
                "max_faults": c.max_faults if c.max_faults is not None else m.settings.max_faults,
                "faults": c.faults}
    if as_json:
        emit_json({"ok": True, "gpu": gpu, **data})
        return
    who = f"client {client_id}" if client_id else "default"
    click.echo(f"{who}: {data['policy']}" + (f" (hook: {data['hook']})" if data["hook"] else "")
               + f"; at most {data['max_restarts']} recoveries; none after {data['max_faults']} "
                 f"faults it caused")


@policy_grp.command("set", epilog=MPS_EXIT_CODES)
@gpu_option
@click.option("--client", "client_id", metavar="ID",
              help="A client's id; without it the default policy is set.")
@click.option("--hook", metavar="CMD", help="The recovery command, for policy hook.")
@click.argument("policy", type=click.Choice(POLICIES))
@json_option
@click.pass_obj
def policy_set(rt: Runtime, gpu_spec, client_id, hook, policy, as_json) -> None:
    """Set the default policy, or a client's, to POLICY (restart, standby, hook, none).

    Takes effect at the next fault.  With the supervisor running it is asked to
    make the change; otherwise the state file is changed.
    """
    gpu, dirs, saved = _target(rt, gpu_spec)
    m = _machine(saved)
    if client_id is not None and client_id not in m.clients:
        raise GpuosError(f"no client {client_id} on {gpu.describe()} (gpuos mps clients)")
    has_hook = hook or (m.clients[client_id].hook if client_id else None) or m.settings.default_hook
    if policy == "hook" and not has_hook:
        raise click.UsageError("policy hook needs --hook CMD")
    if supervisor_pid(dirs) is not None:
        request(dirs, {"op": "policy", "client": client_id, "policy": policy, "hook": hook})
    else:
        lock = SupervisorLock(dirs)
        if not lock.try_acquire():
            raise Busy("the supervisor is starting; try again")
        try:
            if os.geteuid() not in (0, os.stat(dirs.state).st_uid):
                raise NotPermitted(f"{dirs.state} is not yours")
            store = StateStore(dirs)
            saved = store.load()
            m = _machine(saved)
            if client_id is None:
                m.settings.default_policy = policy
                if hook is not None:
                    m.settings.default_hook = hook
            else:
                m.clients[client_id].policy = policy
                if hook is not None:
                    m.clients[client_id].hook = hook
            saved.machine = m.snapshot()
            store.save(saved)
            EventLog(dirs.events).append({"time": time.time(), "gpu": m.gpu, "event": "policy-set",
                                          "state": m.state.value, "incident": None,
                                          "client": client_id, "policy": policy, "hook": hook})
        finally:
            lock.release()
    if as_json:
        emit_json({"ok": True, "gpu": gpu, "client": client_id, "policy": policy, "hook": hook})
    else:
        click.echo(f"{'client ' + client_id if client_id else 'default'}: {policy}"
                   + (f" (hook: {hook})" if hook else ""))


# -- recover ---------------------------------------------------------------------------------

@mps.command("recover", epilog=MPS_EXIT_CODES)
@gpu_option
@click.option("--timeout", type=click.FloatRange(1, 86400), default=600, show_default=True,
              metavar="S", help="Seconds to wait for the recovery to finish.")
@json_option
@click.pass_obj
def recover_cmd(rt: Runtime, gpu_spec, timeout, as_json) -> None:
    """Finish what a killed or failed MPS supervisor left undone.

    The supervisor writes its state before every step.  If it was killed (or
    failed: no server came back after a fault), this starts a new one that
    resumes from that state: clients it had started are found again (by pid and
    start time, or by the token in their environment), so none is started twice;
    an interrupted recovery goes on from the step it had reached; a hook that was
    running when it died is not run again but reported as unknown.  Waits until
    the recovery is over and reports each victim's outcome.  With a supervisor
    running, only reports.
    """
    gpu, dirs, saved = _target(rt, gpu_spec)
    pid = supervisor_pid(dirs)
    m = _machine(saved)
    if pid is not None or m.state is State.STOPPED:
        data = {"ok": True, "gpu": gpu, "resumed": False, "supervisor_pid": pid,
                "state": m.state.value, "incident": m.incident.summary() if m.incident else None,
                "incidents": m.history[-1:]}
        if as_json:
            emit_json(data)
        elif pid is not None:
            click.echo(f"the supervisor of {gpu.describe()} runs (pid {pid}, {m.state.value}): "
                       "nothing to recover" + (f"; incident {m.incident.id} in progress"
                                               if m.incident else ""))
        else:
            click.echo(f"MPS on {gpu.describe()} is stopped: nothing to recover")
        return
    if saved.boot_id and saved.boot_id != boot_id():
        raise GpuosError(f"the MPS state of {gpu.describe()} is from before the last boot: its "
                         "processes are gone; `gpuos mps start` starts afresh (and archives it)")
    find_mps_binaries()
    was = m.state.value
    incident = m.incident.id if m.incident else None
    proc = spawn_supervisor(dirs, fresh=False)

    def done(s: SavedState, p: int | None) -> bool:
        if not _written_by(s, proc):
            return False
        st = s.machine["state"]
        if st in ("failed", "stopped"):
            return p is None or st == "stopped"
        return p is not None and st == "running" and s.machine.get("incident") is None
    try:
        saved = _wait(dirs, done, timeout, proc, what="the resumed supervisor")
    except Timeout:
        saved = StateStore(dirs).load()
        m = _machine(saved)
        raise Timeout(f"the resumed supervisor is still {m.state.value} after {timeout:g} s; "
                      "it goes on: gpuos mps status") from None
    m = _machine(saved)
    last = next((h for h in reversed(m.history) if h["id"] == incident), None) if incident else None
    data = {"ok": m.state is State.RUNNING, "gpu": gpu, "resumed": True, "was": was,
            "supervisor_pid": supervisor_pid(dirs), "state": m.state.value, "incident": last,
            "failure": m.failure}
    if as_json:
        emit_json(data)
    else:
        click.echo(f"resumed the supervisor of {gpu.describe()} (it was {was}); now {m.state.value}")
        if last:
            click.echo(f"incident {last['id']}: {last['outcome']}; {_victims_line(last)}")
    if m.state is State.FAILED:
        if not as_json:
            click.echo(f"gpuos: {m.failure}", err=True)
        sys.exit(MpsFailed.exit_code)
