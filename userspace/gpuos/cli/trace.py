"""`gpuos trace`: tracing gpuos.ko with eBPF (bcc)."""

from __future__ import annotations

import json
import time

import click

from ..kernel.trace import FaultReport, FaultTracer, format_log2_hist
from .output import json_option, table


@click.group()
def trace() -> None:
    """Trace gpuos.ko with eBPF: faults per client, decision latency.

    Needs bcc (python3-bpfcc) and root.

    The programs attach to gpuos.ko's tracepoints only, never to kprobes or
    fentry (which some hosts refuse).
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
