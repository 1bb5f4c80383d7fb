"""`gpuos trace`: tracing gpuos.ko with eBPF (bcc)."""

from __future__ import annotations

import json
import os
import time

import click

from ..errors import NoSuchProcess, NotPermitted, NotTracked
from ..intercept import ring as R
from ..kernel.trace import FaultReport, FaultTracer, format_log2_hist
from .output import json_option, table


@click.group()
def trace() -> None:
    """Trace GPU work: kernel launches inside a process (libgpuos), faults in gpuos.ko (eBPF).

    `trace launches` reads the launch ring of a process started by `gpuos run`;
    `trace pause` and `trace resume` stop and restart its recording.
    `trace faults` needs bcc (python3-bpfcc) and root; its programs attach to
    gpuos.ko's tracepoints only, never to kprobes or fentry (which some hosts refuse).
    """


def _print_report(rep: FaultReport, as_json: bool) -> None:
    if as_json:
        click.echo(json.dumps(rep.to_json(), sort_keys=True))
        return
    click.echo(time.strftime("%H:%M:%S", time.localtime(rep.start + rep.seconds)) +
               f"  {rep.faults} fault(s), {rep.decisions} decision(s) in {rep.seconds:.1f} s")
    if rep.clients:
        click.echo(table(["PID", "COMM", "FAULTS", "DEFAULT", "ISOLATE", "KILL-CLIENT"],
                         [[c.pid, c.comm or "?", c.faults, c.decisions.get("default", 0),
                           c.decisions.get("isolate", 0), c.decisions.get("kill-client", 0)]
                          for c in rep.clients]))
    if rep.sources:
        click.echo("decided by: " + ", ".join(f"{k} {n}" for k, n in rep.sources.items()))
    click.echo(format_log2_hist(rep.latency_ns, "decision latency ns"))
    click.echo("")


@trace.command("faults")
@click.option("--interval", type=click.FloatRange(min=0.1), metavar="S",
              help="Print a report every S seconds (counts start again each time) "
                   "[default: one report at the end].")
@click.option("--duration", type=click.FloatRange(min=0, min_open=True), metavar="S",
              help="Stop after S seconds [default: at Ctrl-C].")
@json_option(help="Print each report as one JSON object on its own line (JSON lines).")
def faults_cmd(interval: float | None, duration: float | None, as_json: bool) -> None:
    """Count GPU faults per client process and histogram gpuos's decision latency.

    From the tracepoints gpuos:fault (each fault the driver reported) and
    gpuos:decision (each answer gpuos.ko gave: default, isolate, kill-client,
    with its latency_ns). Prints, per client process, its faults and
    decisions; how many decisions came from a pid's own policy, a cgroup's,
    or none (default); then a log2 histogram of the decision latency in ns. With
    --json each report is one JSON object on its own line. Exit 27 without
    bcc, 20 without gpuos.ko.
    """
    with FaultTracer() as tracer:
        if not as_json:
            what = f"every {interval:g} s" if interval else "at the end"
            until = f"for {duration:g} s" if duration else "until Ctrl-C"
            click.echo(f"Tracing gpuos:fault and gpuos:decision {until}; reports {what}.",
                       err=True)
        now = time.monotonic()
        end = None if duration is None else now + duration
        next_report = None if interval is None else now + interval
        try:
            while end is None or time.monotonic() < end:
                wake = min((t for t in (next_report, end) if t is not None), default=None)
                time.sleep(3600 if wake is None else max(wake - time.monotonic(), 0))
                if next_report is not None and time.monotonic() >= next_report:
                    _print_report(tracer.report(), as_json)
                    next_report += interval
        except KeyboardInterrupt:
            pass
        rep = tracer.report()
        if interval is None or rep.faults or rep.decisions:  # the last, partial interval
            _print_report(rep, as_json)


def _open_ring(pid: int) -> R.Ring:
    return _on_ring(pid, R.Ring.open_pid)


def _on_ring(pid: int, action):
    """action(pid) on the ring of process `pid`, its failures as gpuos errors."""
    try:
        return action(pid)
    except FileNotFoundError:
        raise NoSuchProcess(f"no process {pid}") from None
    except PermissionError:
        raise NotPermitted(f"process {pid} belongs to another user (root may trace it)") from None
    except LookupError:
        raise NotTracked(f"process {pid} has no libgpuos ring: start it with `gpuos run`, "
                         "or it has made no CUDA call yet") from None
    except R.RingError as exc:
        raise NotTracked(f"process {pid}: {exc}") from None


def _describe(rec: dict, name: str | None) -> str:
    t = rec["type"]
    if t == "launch":
        bufs = ", ".join(f"{b['ptr']:#x}" + (f"@{b['param']}" if b["param"] is not None else "")
                         for b in rec["bufs"][:6]) + (" ..." if len(rec["bufs"]) > 6 else "")
        flags = f" [{','.join(rec['flags'])}]" if rec["flags"] else ""
        return (f"launch #{rec['seq']} {name or '?'} grid={'x'.join(map(str, rec['grid']))} "
                f"block={'x'.join(map(str, rec['block']))} stream={rec['stream']:#x}{flags} "
                f"bufs={len(rec['bufs'])}: {bufs}")
    if t == "copy":
        return (f"{rec['kind']} #{rec['seq']} dst={rec['dst']:#x}+{rec['dst_len']} "
                f"src={rec['src']:#x}+{rec['src_len']} stream={rec['stream']:#x}")
    if t in ("alloc", "free"):
        return f"{t} {rec['kind']} {rec['base']:#x}+{rec['size']}"
    if t == "graph":
        return f"graph #{rec['seq']} exec={rec['graph_exec']:#x} kernels={rec['nkernels']} copies={rec['ncopies']}"
    if t == "validate":
        if rec["skipped"]:
            return f"validate #{rec['seq']} skipped ({rec['skip_reason']})"
        return (f"validate #{rec['seq']} {name or rec['op']}: changed {rec['changed_bytes']} B, "
                f"missed {rec['missed_bytes']} B, over-predicted {rec['overpredicted_bytes']} B")
    if t == "status":
        why = f" ({', '.join(rec['incomplete'])})" if rec.get("incomplete") else ""
        return f"tracking {rec['state']}{why}: {rec['reason']}"
    return t


@trace.command("launches")
@click.argument("pid", type=int)
@click.option("--all", "show_all", is_flag=True,
              help="Every record (allocations, copies, graph launches, validation), not only "
                   "kernel launches.")
@click.option("--from-start", is_flag=True,
              help="Begin with the oldest records still in the ring, not with new ones.")
@click.option("--duration", type=click.FloatRange(min=0, min_open=True), metavar="S",
              help="Stop after S seconds [default: when the process exits, or at Ctrl-C].")
@json_option(help="One JSON object per record (JSON lines), as in the launch log.")
def launches_cmd(pid: int, show_all: bool, from_start: bool, duration: float | None,
                 as_json: bool) -> None:
    """Follow the kernel launches of process PID live.

    PID must run with libgpuos (started by `gpuos run`). Each line is one launch:
    kernel name, grid and block, stream, and the buffers predicted from its
    arguments (pointer@parameter). Records appear about a millisecond after
    the launch (libgpuos's recording thread makes them; after a pause in the
    process's GPU work, up to 64 ms). Reading never slows the process: if we fall
    behind, the oldest records are lost and the count is reported at the end.
    Needs the same user as PID, or root. Exit 3: no such process; 4: not
    permitted; 29: PID has no libgpuos ring.
    """
    ring = _open_ring(pid)
    h = ring.header()
    if not h.tracking and not as_json:
        click.echo(f"gpuos: tracking is off in process {pid}: {h.reason}", err=True)
    elif h.incomplete and not as_json:
        click.echo(f"gpuos: the record of process {pid} is incomplete "
                   f"({', '.join(h.incomplete_reasons)})", err=True)
    reader = R.RingReader(ring, from_start=from_start)
    end = None if duration is None else time.monotonic() + duration
    try:
        while True:
            alive = os.path.exists(f"/proc/{pid}")
            for rtype, flags, ts, tid, body in reader.poll():
                if not show_all and rtype not in (R.LAUNCH, R.STATUS):  # a status: always
                    continue
                rec = R.decode(rtype, flags, ts, tid, body)
                fn = ring.function(rec["func"]) if rec.get("func") is not None else None
                name = fn.name if fn else None
                if as_json:
                    click.echo(json.dumps(dict(rec, pid=pid, name=name), separators=(",", ":")))
                else:
                    click.echo(f"{(ts - h.start_mono_ns) / 1e9:12.6f} {_describe(rec, name)}")
            if not alive or (end is not None and time.monotonic() >= end):
                break
            time.sleep(0.05)
    except KeyboardInterrupt:
        pass
    finally:
        lost = reader.stats.skipped_slots + reader.stats.torn
        if lost and not as_json:
            click.echo(f"gpuos: {lost} ring slots were overwritten before they were read", err=True)
        ring.close()


def _set_paused(pid: int, paused: bool, as_json: bool) -> None:
    was = _on_ring(pid, lambda p: R.set_ops_paused(p, paused))
    if as_json:
        click.echo(json.dumps({"pid": pid, "ops_paused": paused, "was_paused": was}))
    else:
        state = "paused" if paused else "recorded"
        click.echo(f"process {pid}: operations are {state}" + ("" if was != paused else " (already)"))


@trace.command("pause")
@click.argument("pid", type=int)
@json_option(help="Print {pid, ops_paused, was_paused} as JSON.")
def pause_cmd(pid: int, as_json: bool) -> None:
    """Stop recording the operations of process PID (started by `gpuos run`).

    Kernel launches, copies, memsets and graph launches then go straight to the
    driver: no parameter scan, no record, almost no cost. Allocations are still
    tracked, so `gpuos trace resume` makes the records exact again from the next
    operation on. Consumers of the launch log see a gap meanwhile.

    Needs the same user as PID, or root. Exit 3: no such process; 4: not
    permitted; 29: PID has no libgpuos ring, or runs under --validate (which must
    see every operation).
    """
    _set_paused(pid, True, as_json)


@trace.command("resume")
@click.argument("pid", type=int)
@json_option(help="Print {pid, ops_paused, was_paused} as JSON.")
def resume_cmd(pid: int, as_json: bool) -> None:
    """Record the operations of process PID again after `gpuos trace pause`.

    Exit 3: no such process; 4: not permitted; 29: PID has no libgpuos ring.
    """
    _set_paused(pid, False, as_json)

