"""`gpuos events`: gpuos.ko's events as they happen."""

from __future__ import annotations

import json
import time

import click

from ..errors import Timeout
from ..kernel import connect
from ..kernel.model import Event
from ..kernel.uapi import enum_name, FaultPolicy
from .output import json_option


def event_line(ev: Event) -> str:
    """One event for people: SEQ TIME TYPE key=value..."""
    parts = [str(ev.seq), f"{ev.time_ns / 1e9:.6f}", ev.type_name]
    if ev.fault is not None:
        f = ev.fault.to_json()
        parts += [f"{k}={_hex(k, v)}" for k, v in f.items() if v is not None]
    if ev.fault_batch is not None:
        fb = ev.fault_batch.to_json()
        fb["fault_batch"] = fb.pop("batch_id")
        keys = ("pid", "cgroup", "as_id", "gpu", "fault_batch", "faults", "instances", "fatal",
                "throttled", "skipped")
        parts += [f"{k}={_hex(k, fb[k])}" for k in keys if fb[k] is not None]
        parts += [f"{k}={v}" for k, v in fb["by_access"].items()]
        parts += [f"{k}={_hex(k, fb[k])}" for k in ("addr_min", "addr_max") if fb[k] is not None]
        parts.append("addrs=" + ",".join(f"{a:#x}" for a in fb["addrs"]))
    if ev.batch_id is not None:
        parts.append(f"batch={ev.batch_id}")
    if ev.as_id is not None:
        parts.append(f"as_id={ev.as_id:#x}")
    if ev.statuses is not None:
        parts.append("status=" + ",".join(str(s) for s in ev.statuses))
    if ev.driver_name is not None:
        parts.append(f"driver={ev.driver_name}")
    if ev.policy is not None:
        c = ev.policy.client
        parts += ([f"pid={c.pid}"] if c.pid is not None else []) + \
                 ([f"cgroup={c.cgroup}"] if c.cgroup is not None else [])
        parts.append(f"policy={enum_name(FaultPolicy, ev.policy.policy)}")
    return " ".join(parts)


def _hex(key: str, value: object) -> object:
    return f"{value:#x}" if key in ("addr", "as_id", "addr_min", "addr_max") and \
        isinstance(value, int) else value


@click.command("events")
@click.option("--count", type=click.IntRange(min=1), metavar="N",
              help="Stop after N events.")
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), metavar="S",
              help="Stop after S seconds; with --count, fail (exit 28) if fewer than N "
                   "events came by then.")
@json_option(help="Print each event as one JSON object on its own line (JSON lines).")
def events(count: int | None, timeout: float | None, as_json: bool) -> None:
    """Print gpuos.ko's events as they happen, one per line.

    Runs until Ctrl-C, --count or --timeout; exits 20 if gpuos.ko is unloaded
    meanwhile.

    \b
    Each line: SEQ TIME TYPE then key=value pairs, TIME being CLOCK_MONOTONIC
    seconds. TYPE is one of:
      fault, client-isolated   pid cgroup as_id veid addr access type gpu decision
      fault-batch              pid cgroup as_id gpu fault_batch faults instances
                               fatal throttled skipped read write atomic prefetch
                               addr_min addr_max addrs (a rate-limited sample of
                               one client's serviced faults in one fault batch)
      migration-done           batch as_id status (per range: 0 or -errno)
      driver-registered, driver-unregistered   driver
      policy-set, policy-deleted               pid or cgroup, policy

    With --json each line is one JSON object (JSON lines). Every event has the
    next sequence number; when some never reached gpuos (its socket
    overflowed), a line "gpuos: missed N events (seq A..B)" goes to stderr.
    Needs CAP_SYS_ADMIN: events name other users' processes and addresses.
    """
    seen = 0
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        with connect() as nl, nl.subscribe() as sub:
            while count is None or seen < count:
                left = None if deadline is None else deadline - time.monotonic()
                ev = sub.next(timeout=left) if left is None or left > 0 else None
                if ev is None:
                    if count is not None:
                        raise Timeout(f"{seen} of {count} event(s) within {timeout:g} s")
                    break
                if ev.gap is not None:
                    click.echo(f"gpuos: {ev.gap.describe()}", err=True)
                click.echo(json.dumps(ev.to_json(), sort_keys=True) if as_json else event_line(ev))
                seen += 1
    except KeyboardInterrupt:
        pass
    except BrokenPipeError:  # e.g. piped into head
        pass
