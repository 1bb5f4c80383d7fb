"""Tracing gpuos.ko's tracepoints with bcc: per-client faults, decision latency.

bcc (Debian's python3-bpfcc) is imported only when a tracer is made; without
it BccUnavailable.  The BPF program is trace_faults.bpf.c beside this file
(package data).  It attaches to the tracepoints gpuos:fault and
gpuos:decision only, never to kprobes or fentry, which some hosts refuse.
"""

from __future__ import annotations

import errno
import os
import time
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from .. import procs
from ..errors import BccUnavailable, GpuosError, KmodNotLoaded, NotPermitted
from .uapi import Decision, enum_name

TRACEFS_ROOTS = (Path("/sys/kernel/tracing"), Path("/sys/kernel/debug/tracing"))
TRACEPOINTS = ("fault", "decision")  # in the system "gpuos"
BPF_SOURCE = "trace_faults.bpf.c"
# The decision tracepoint's `source`: kmod/policy.h's GPUOS_SRC_* (module-internal, not uapi;
# the tracepoint prints the same names).
DECISION_SOURCES = {0: "default", 1: "pid", 2: "cgroup"}


def bpf_text() -> str:
    return resources.files("gpuos.kernel").joinpath(BPF_SOURCE).read_text()


@dataclass(frozen=True)
class Log2Bucket:
    """Values low..high (inclusive) were seen count times."""
    low: int
    high: int
    count: int


def log2_buckets(slots: dict[int, int]) -> list[Log2Bucket]:
    """bcc's bpf_log2l() slots as buckets: slot 0 holds 0, slot i >= 1 holds
    2^(i-1)..2^i-1.  From the lowest to the highest non-empty slot."""
    used = [i for i, c in slots.items() if c]
    if not used:
        return []
    return [Log2Bucket(0 if i == 0 else 1 << (i - 1), 0 if i == 0 else (1 << i) - 1,
                       slots.get(i, 0)) for i in range(min(used), max(used) + 1)]


def format_log2_hist(buckets: list[Log2Bucket], unit: str, width: int = 40) -> str:
    """Like bcc's print_log2_hist."""
    if not buckets:
        return f"     {unit:>19} : count     (none)"
    top = max(b.count for b in buckets) or 1
    lines = [f"     {unit:>19} : count     distribution"]
    for b in buckets:
        stars = round(b.count * width / top) if b.count else 0
        lines.append(f"{b.low:>10} -> {b.high:<10} : {b.count:<8} |{'*' * stars:<{width}}|")
    return "\n".join(lines)


@dataclass
class ClientFaults:
    pid: int
    comm: str | None
    faults: int
    decisions: dict[str, int]  # "default" / "isolate" / "kill-client" -> count


@dataclass
class FaultReport:
    """What the tracepoints saw in one interval."""
    start: float  # time.time()
    seconds: float
    clients: list[ClientFaults]
    latency_ns: list[Log2Bucket]
    faults: int = 0
    decisions: int = 0
    sources: dict[str, int] = field(default_factory=dict)  # "pid" / "cgroup" / "default" -> n

    def to_json(self) -> dict[str, Any]:
        return {"start": self.start, "seconds": round(self.seconds, 6), "faults": self.faults,
                "decisions": self.decisions, "sources": dict(self.sources),
                "clients": [{"pid": c.pid, "comm": c.comm, "faults": c.faults,
                             "decisions": c.decisions} for c in self.clients],
                "latency_ns": [{"low": b.low, "high": b.high, "count": b.count}
                               for b in self.latency_ns]}


def build_report(start: float, seconds: float, faults: dict[int, int],
                 decisions: dict[tuple[int, int], int], slots: dict[int, int],
                 sources: dict[int, int] | None = None) -> FaultReport:
    """A report from the maps' contents (pid -> faults, (pid, decision) -> n,
    log2 slot -> n, source -> n)."""
    pids = set(faults) | {pid for pid, _ in decisions}
    clients = []
    for pid in pids:
        per = {enum_name(Decision, d): n for (p, d), n in sorted(decisions.items()) if p == pid}
        clients.append(ClientFaults(pid=pid, comm=procs.comm(pid), faults=faults.get(pid, 0),
                                    decisions=per))
    clients.sort(key=lambda c: (-c.faults, -sum(c.decisions.values()), c.pid))
    return FaultReport(start=start, seconds=seconds, clients=clients,
                       latency_ns=log2_buckets(slots), faults=sum(faults.values()),
                       decisions=sum(decisions.values()),
                       sources={DECISION_SOURCES.get(k, f"source-{k}"): n
                                for k, n in sorted((sources or {}).items()) if n})


def find_tracepoints() -> Path:
    """The tracefs directory of gpuos's tracepoints; KmodNotLoaded if it has none."""
    for root in TRACEFS_ROOTS:
        events = root / "events"
        if (events / "gpuos").is_dir():
            missing = [tp for tp in TRACEPOINTS if not (events / "gpuos" / tp).is_dir()]
            if missing:
                raise KmodNotLoaded(f"gpuos.ko has no tracepoint{'s' if len(missing) > 1 else ''} "
                                    f"{', '.join('gpuos:' + m for m in missing)} (another "
                                    f"version of the module?)")
            return events / "gpuos"
    if not any((root / "events").is_dir() for root in TRACEFS_ROOTS):
        if os.geteuid() != 0:
            raise NotPermitted("cannot read tracefs (/sys/kernel/tracing): tracing needs root")
        raise GpuosError("tracefs is not mounted: mount -t tracefs nodev /sys/kernel/tracing")
    raise KmodNotLoaded("no gpuos tracepoints in tracefs: gpuos.ko is not loaded")


def import_bcc() -> Any:
    try:
        import bcc  # noqa: PLC0415 - lazily: most gpuos commands never trace
    except ImportError:
        raise BccUnavailable("bcc is not installed (apt-get install python3-bpfcc); "
                             "tracing needs it") from None
    return bcc


class FaultTracer:
    """The BPF program, loaded and attached; ``report()`` reads (and clears) its maps."""

    def __init__(self) -> None:
        bcc = import_bcc()
        find_tracepoints()
        try:
            self._bpf = bcc.BPF(text=bpf_text())
        except Exception as exc:  # bcc raises plain Exceptions (compile, load, attach)
            text = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
            if isinstance(exc, PermissionError) or "not permitted" in str(exc).lower() \
                    or getattr(exc, "errno", None) == errno.EPERM:
                raise NotPermitted(f"loading the BPF program was refused: {text}") from None
            raise GpuosError(f"loading the BPF program failed: {text}") from None
        self._since = time.time()
        self._since_mono = time.monotonic()

    def close(self) -> None:
        self._bpf.cleanup()

    def __enter__(self) -> FaultTracer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def report(self, clear: bool = True) -> FaultReport:
        faults_map, decisions_map, latency_map, sources_map = (
            self._bpf["faults"], self._bpf["decisions"], self._bpf["latency"],
            self._bpf["sources"])
        faults = {k.value: v.value for k, v in faults_map.items()}
        decisions = {(k.pid, k.decision): v.value for k, v in decisions_map.items()}
        slots = {k.value: v.value for k, v in latency_map.items() if v.value}
        sources = {k.value: v.value for k, v in sources_map.items()}
        now = time.monotonic()
        rep = build_report(self._since, now - self._since_mono, faults, decisions, slots,
                           sources)
        if clear:
            for table in (faults_map, decisions_map, latency_map, sources_map):
                table.clear()
            self._since, self._since_mono = time.time(), now
        return rep
