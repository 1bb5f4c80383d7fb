"""`gpuos faults watch|log`: GPU faults as they happen, and the fault journal."""

from __future__ import annotations

import json
import signal
import time
from datetime import datetime

import click

from ..errors import GpuosError, NoGpu, NotPermitted
from ..faults.inject import inject
from ..faults.journal import FaultJournal
from ..faults.kmsg import KernelLogUnavailable, KmsgGap, open_kernel_log, parse_xid
from ..faults.model import FaultEvent
from ..faults.kmod import SOURCE as SOURCE_KMOD, KmodFaultSource, KmodUnavailable
from ..faults.uvm_tools import TrackerFaultSource
from ..faults.nvml import NvmlSource, NvmlUnavailable
from ..faults.watch import FaultStream, Notice
from ..runtime import Runtime
from .output import json_option

TIME_FORMAT = "%Y-%m-%d %H:%M:%S"


def _when(t: float) -> str:
    return time.strftime(TIME_FORMAT, time.localtime(t)) + f".{int(t * 1000) % 1000:03d}"


def details(ev: FaultEvent) -> str:
    """What the event's line(s) said, in short."""
    parts = []
    chans = ev.extra.get("channels") or ([ev.channel] if ev.channel is not None else [])
    if chans:
        parts.append("channel " + ",".join(f"{c:#x}" for c in chans))
    if ev.mmu is not None:
        m = ev.mmu
        parts.append(f"MMU {m.engine} @ {m.address:#x} {m.fault_type} {m.access_type}")
    for e in ev.extra.get("sm_errors", [])[:4]:
        parts.append(f"SM {e['kind']} GPC {e['gpc']} TPC {e['tpc']} SM {e['sm']}: {e['error']}")
    if len(ev.extra.get("sm_errors", [])) > 4:
        parts.append(f"... {len(ev.extra['sm_errors']) - 4} more SM errors")
    if "esr" in ev.extra:
        parts.append(f"ESR {ev.extra['esr']}")
    if "recovery_action" in ev.extra:
        parts.append(f"recovery action {ev.extra['recovery_action']}")
    if not parts:
        line = parse_xid(ev.text.split("\n", 1)[0]) if ev.source != "nvml" else None
        if line is not None:  # the driver's message after "Xid (...): N, pid=..., name=..., "
            if line.message.rstrip(".").lower() != ev.name.lower():
                parts.append(line.message)
        elif "event_data" in ev.extra:
            parts.append(f"data {ev.extra['event_data']:#x}")
    return "; ".join(p for p in parts if p)


def event_line(ev: FaultEvent) -> str:
    """TIME GPU Xid N CLASS pid/process NAME: details -> action (one line)."""
    gpu = ev.pci or "?"
    what = f"Xid {ev.xid}" if ev.xid is not None else ("gpuos.ko" if ev.source == SOURCE_KMOD else "NVML")
    who = f"pid {ev.pid}" if ev.pid is not None else "pid ?"
    if ev.process:
        who += f" ({ev.process})"
    d = details(ev)
    return (f"{_when(ev.time)}  {gpu}  {what}  {ev.fault_class.value}  {who}  "
            f"{ev.name}{': ' + d if d else ''} -> {ev.action}  [{ev.source}]")


def record_line(rec: dict) -> str:
    """A journal record for people: faults as `watch` prints them, others as key=value."""
    if rec.get("type") == "fault":
        try:
            return event_line(FaultEvent.from_json(rec))
        except (TypeError, ValueError, KeyError):
            pass
    t = rec.get("time")
    when = _when(t) if isinstance(t, (int, float)) else "?"
    if rec.get("type") == "kmsg-gap":
        return f"{when}  {KmsgGap(rec.get('first'), rec.get('last')).describe()}"
    rest = " ".join(f"{k}={json.dumps(v) if not isinstance(v, str) else v}"
                    for k, v in sorted(rec.items()) if k not in ("time", "type", "v"))
    return f"{when}  {rec.get('type', '?')}  {rest}".rstrip()


@click.group("faults")
def faults() -> None:
    """GPU faults: watch them as they happen, read the fault journal.

    Faults come from the kernel log (the driver's `NVRM: Xid` lines: Xid, GPU,
    pid, process, channel, MMU fault details) and from NVML (Xid critical error
    events and NVML's other error events: ECC, poison, GPU unavailable, recovery
    action); a fault both report becomes one event. Each event is classified by
    its Xid: memory (MMU faults the patched driver can contain), sm, copy,
    channel, device (drain or reset the GPU), info, unknown. The table, the
    event's JSON and the journal are in docs/faults.md.
    """


@faults.command("watch")
@json_option(help="Print each event as one JSON object on its own line (JSON lines).")
@click.option("--from-start", is_flag=True,
              help="Begin with the oldest record the kernel log still holds (default: "
                   "only what happens from now on).")
@click.option("--duration", type=click.FloatRange(min=0, min_open=True), metavar="S",
              help="Stop after S seconds [default: at Ctrl-C or SIGTERM].")
@click.option("--no-nvml", is_flag=True, help="Do not use NVML (kernel log only).")
@click.option("--no-kmsg", is_flag=True, help="Do not read the kernel log (NVML only).")
@click.option("--no-trackers", is_flag=True,
              help="Do not put UVM fault trackers on the CUDA processes (as root they name the "
                   "process whose address space took a fatal memory fault, under MPS too).")
@click.option("--no-kmod", is_flag=True,
              help="Do not listen to gpuos.ko's fault reports (the patched driver's).")
@click.option("--no-journal", is_flag=True,
              help="Do not append the events to the fault journal.")
@click.option("--file", "log_file", type=click.Path(dir_okay=False), metavar="FILE",
              help="Read the kernel log from FILE instead (records as /dev/kmsg gives them, "
                   "or dmesg/journalctl text), without NVML, and stop at its end.")
@click.option("--window", type=click.FloatRange(min=0), default=2.0, show_default=True,
              metavar="S", help="How long an NVML event waits for the kernel-log line of the "
                                "same GPU and Xid (and a kernel-log event absorbs NVML's later "
                                "report of it).")
@click.pass_obj
def watch_cmd(rt: Runtime, as_json: bool, from_start: bool, duration: float | None,
              no_nvml: bool, no_kmsg: bool, no_trackers: bool, no_kmod: bool, no_journal: bool,
              log_file: str | None, window: float) -> None:
    """Print GPU faults as they happen and keep them in the fault journal.

    \b
    Each line: TIME GPU Xid N CLASS pid P (PROCESS) NAME: DETAILS -> ACTION [SOURCE]
      GPU      the PCI bus id the driver prints (domain:bus:device)
      CLASS    memory, sm, copy, channel, device, info or unknown (docs/faults.md)
      DETAILS  channel(s); MMU engine, address, fault and access type; SM errors
               (GPC, TPC, SM); ESR; the recovery action Xid 154 names
      ACTION   what gpuos does and what recovering takes
      SOURCE   kmsg, nvml, or kmsg+nvml when both reported it; gpuos.ko; uvm-tracker
    NVML events that are not Xids show "NVML" in place of "Xid N".

    As root, with the stock driver, UVM fault trackers on every CUDA process (its
    /dev/nvidia-uvm address space, through /dev/nvidia-uvm-tools) report each
    fatal memory fault once more, as Xid 31 [uvm-tracker], with the pid of the
    process whose address space took it: the faulter, under MPS too, where the
    Xid line may name another client (measured on an H100). SM exceptions
    (Xid 13, 43) do not reach UVM and are not reported so.

    With the patched driver and gpuos.ko loaded, each client's fatal MMU fault is
    also reported before the driver acts on it: "gpuos.ko" in place of "Xid N",
    with the pid of the process that faulted (under MPS the Xid 31 line names
    another client, or the server), its VEID and gpuos.ko's decision. Without
    gpuos.ko nothing is said about it.

    Lines of one fault (Xid 13 prints one per SM, then the ESR) make one event.
    An NVML event and a kernel-log line of the same GPU and Xid within --window
    seconds make one event; the kernel log's goes out at once, never held back.
    Unknown Xids are printed (class unknown), never dropped. With --json each event is one JSON object (JSON lines). Every event
    is also appended to the fault journal ($GPUOS_HOME/faults, `gpuos faults
    log`) unless --no-journal. When the kernel overwrote records before they
    were read, "gpuos: the kernel log overflowed: missed N records" goes to
    stderr (and to the journal).

    Reading /dev/kmsg needs root (CAP_SYSLOG) when kernel.dmesg_restrict is 1;
    where /dev/kmsg cannot be opened `dmesg -r` is polled every second. Without
    NVML (no driver) it says so once and watches the kernel log alone. Exit 4
    when no source can be read for lack of rights (1 for other reasons), 16
    when NVML is the only source asked for and it is unavailable.
    """
    if no_kmsg and (no_nvml or log_file):
        raise click.UsageError("nothing to watch: --no-kmsg leaves only NVML"
                               + (", and --no-nvml turns it off" if no_nvml else
                                  ", which --file does not use"))
    say = (lambda text: click.echo(f"gpuos: {text}", err=True))
    kernel_log = None
    kmsg_error: KernelLogUnavailable | None = None
    if not no_kmsg:
        try:
            kernel_log = open_kernel_log(from_start=from_start or bool(log_file), path=log_file)
        except KernelLogUnavailable as exc:
            kmsg_error = exc
            if log_file:
                raise (NotPermitted if exc.permission else GpuosError)(exc.message) from None
    nvml = None
    nvml_error: str | None = None
    if not no_nvml and not log_file:
        try:
            nvml = NvmlSource()
        except NvmlUnavailable as exc:
            nvml_error = str(exc)
    if kernel_log is None and nvml is None:
        if kmsg_error is None:  # --no-kmsg
            raise NoGpu(f"{nvml_error}: nothing to watch (--no-kmsg)")
        why = kmsg_error.message + (f"; {nvml_error}" if nvml_error else "; NVML not used (--no-nvml)")
        raise NotPermitted(why) if kmsg_error.permission else GpuosError(why)
    if nvml_error:
        say(f"{nvml_error}: watching the kernel log only")
    if kmsg_error is not None:
        say(f"{kmsg_error.message}: watching NVML events only")
    if kernel_log is not None and kernel_log.fileno() is None:
        say(f"/dev/kmsg cannot be opened: polling `{kernel_log.name}` every second")
    kmod = None
    if not no_kmod and not log_file:
        try:
            kmod = KmodFaultSource()
        except KmodUnavailable:
            pass  # the stock driver: nothing would come from it

    journal = None if no_journal else FaultJournal(rt.paths.faults)
    journal_failed = False

    def keep(record: dict) -> None:
        nonlocal journal_failed
        if journal is None or journal_failed:
            return
        try:
            journal.append(record)
        except OSError as exc:
            journal_failed = True
            say(f"cannot write the fault journal in {journal.dir} ({exc.strerror or exc}): "
                "events are not kept from now on (--no-journal to not try)")

    def emit(items) -> None:
        for item in items:
            if isinstance(item, FaultEvent):
                rec = {"type": "fault", **item.to_json()}
                click.echo(json.dumps(rec, sort_keys=True) if as_json else event_line(item))
                keep(rec)
            elif isinstance(item, KmsgGap):
                say(item.describe())
                keep({"type": "kmsg-gap", **item.to_json()})
            elif isinstance(item, Notice):
                say(item.text)

    stop = False

    def on_term(signum, frame) -> None:
        nonlocal stop
        stop = True

    old_term = signal.signal(signal.SIGTERM, on_term)
    trackers = None
    if not no_trackers and not log_file:
        try:
            trackers = TrackerFaultSource()
        except (FileNotFoundError, PermissionError):
            pass  # no nvidia-uvm, or not root: nothing to say, as for gpuos.ko
        except OSError as exc:
            say(f"no UVM fault trackers: {exc}")
    stream = FaultStream(kernel_log, nvml, window=window,
                         threaded=[s for s in (kmod, trackers) if s is not None])
    end = None if duration is None else time.monotonic() + duration
    try:
        try:
            while not stop and not stream.exhausted:
                left = None if end is None else end - time.monotonic()
                if left is not None and left <= 0:
                    break
                emit(stream.poll(0.5 if left is None else min(0.5, left)))
            emit(stream.drain())
        except KeyboardInterrupt:
            emit(stream.drain())
    except BrokenPipeError:  # e.g. piped into head
        pass
    finally:
        signal.signal(signal.SIGTERM, old_term)
        stream.close()


def _parse_since(value: str | None) -> float | None:
    if value is None:
        return None
    text = value.strip()
    if text.endswith(("Z", "z")):
        text = text[:-1] + "+00:00"
    try:
        return datetime.fromisoformat(text).timestamp()  # naive: local time
    except ValueError:
        raise click.BadParameter(f"{value!r} is not an ISO 8601 date or time "
                                 "(e.g. 2026-11-21 or 2026-11-21T10:00:00)",
                                 param_hint="--since") from None


@faults.command("log")
@json_option(help="Print each record as one JSON object on its own line (JSON lines).")
@click.option("--limit", type=click.IntRange(min=1), metavar="N",
              help="Only the last N records.")
@click.option("--since", metavar="ISO",
              help="Only records from this time on: an ISO 8601 date or time, local time "
                   "unless it names its zone (2026-11-21, 2026-11-21T10:00:00Z).")
@click.pass_obj
def log_cmd(rt: Runtime, as_json: bool, limit: int | None, since: str | None) -> None:
    """Print the fault journal, oldest first.

    The journal ($GPUOS_HOME/faults/faults.jsonl and faults.jsonl.1, at most 1 MiB
    each, the oldest records dropped first) keeps what `gpuos faults watch`
    saw: faults (printed as `watch` prints them) and kernel-log overflows; the
    MPS supervisor records its incidents there too (printed as key=value).
    With --json each record is printed as stored: one JSON object per line.
    Lines torn by a crash are skipped (their count goes to stderr).
    """
    journal = FaultJournal(rt.paths.faults)
    try:
        records = journal.read(since=_parse_since(since), limit=limit)
    except PermissionError as exc:
        raise NotPermitted(f"cannot read the fault journal in {journal.dir}: "
                           f"{exc.strerror or exc}") from None
    try:
        for rec in records:
            click.echo(json.dumps(rec, sort_keys=True) if as_json else record_line(rec))
    except BrokenPipeError:
        return
    if journal.skipped:
        click.echo(f"gpuos: skipped {journal.skipped} torn or unreadable line(s)", err=True)
    if journal.newer:
        click.echo(f"gpuos: skipped {journal.newer} record(s) of a journal format this gpuos "
                   "does not know (a newer gpuos wrote them)", err=True)
    if not records and not as_json:
        click.echo("no fault recorded" + (" since then" if since else ""), err=True)


faults.add_command(inject)
