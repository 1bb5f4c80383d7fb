"""What gpuos.ko talks about, as dataclasses: clients, policies, ranges, info, events.

Values of the header's enums are kept as their IntEnum members (or a plain int
for a value this version does not know); ``to_json()`` gives the names the CLI
prints.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .uapi import (DEST_CPU, Counter, Decision, EventType, FaultAccess, FaultPolicy,
                   FaultType, caps_names, enum_name)


def as_enum(enum: type, value: int) -> Any:
    """value as a member of enum, or the plain int if this version does not know it."""
    try:
        return enum(value)
    except ValueError:
        return int(value)


@dataclass(frozen=True)
class Client:
    """A policy's client: a process (pid) or a cgroup v2 (its id, the directory's inode).

    The protocol wants exactly one of the two, > 0; this class does not check, so
    that tests can send what the module must refuse.
    """
    pid: int | None = None
    cgroup: int | None = None

    def describe(self) -> str:
        parts = ([f"pid {self.pid}"] if self.pid is not None else []) + \
                ([f"cgroup {self.cgroup}"] if self.cgroup is not None else [])
        return " and ".join(parts) or "no client"

    def to_json(self) -> dict[str, int | None]:
        return {"pid": self.pid, "cgroup": self.cgroup}


@dataclass(frozen=True)
class Policy:
    client: Client
    policy: FaultPolicy | int

    def to_json(self) -> dict[str, Any]:
        return {"client": self.client.to_json(), "policy": enum_name(FaultPolicy, self.policy)}


@dataclass(frozen=True)
class Range:
    """One range of a migration batch (struct gpuos_range's inputs)."""
    base: int
    len: int
    dest: int = DEST_CPU
    prio: int = 0
    flags: int = 0


@dataclass(frozen=True)
class SubmitResult:
    batch_id: int
    statuses: list[int]  # per range: 0 when accepted


@dataclass(frozen=True)
class KmodInfo:
    """GPUOS_CMD_GET_INFO's reply."""
    genl_version: int
    abi_version: int
    module_version: str
    driver_name: str | None  # None: no driver registered
    driver_caps: int
    event_seq: int  # sequence number of the last event
    counters: dict[str, int]  # GPUOS_CTR_FAULTS -> "faults", ...

    @property
    def caps(self) -> list[str]:
        return caps_names(self.driver_caps)

    def to_json(self) -> dict[str, Any]:
        return {"genl_version": self.genl_version, "abi_version": self.abi_version,
                "module_version": self.module_version,
                "driver": None if self.driver_name is None else
                {"name": self.driver_name, "caps": self.caps, "caps_mask": self.driver_caps},
                "event_seq": self.event_seq, "counters": dict(self.counters)}


def counter_name(ctr: int) -> str:
    try:
        return Counter(ctr).name.lower()
    except ValueError:
        return f"counter_{ctr}"


@dataclass(frozen=True)
class Fault:
    """GPUOS_A_FAULT of a FAULT or CLIENT_ISOLATED event."""
    pid: int | None
    cgroup: int | None
    as_id: int | None
    veid: int | None
    addr: int | None
    access: FaultAccess | int | None
    type: FaultType | int | None
    gpu: int | None
    decision: Decision | int | None

    def to_json(self) -> dict[str, Any]:
        return {"pid": self.pid, "cgroup": self.cgroup, "as_id": self.as_id, "veid": self.veid,
                "addr": self.addr,
                "access": None if self.access is None else enum_name(FaultAccess, self.access),
                "type": None if self.type is None else enum_name(FaultType, self.type),
                "gpu": self.gpu,
                "decision": None if self.decision is None else enum_name(Decision, self.decision)}


@dataclass(frozen=True)
class FaultBatch:
    """GPUOS_A_FAULT of a FAULT_BATCH event: one client's serviced faults in one fault
    batch of one GPU, as the driver summarized them (a rate-limited sample)."""
    pid: int | None
    cgroup: int | None
    as_id: int | None
    gpu: int | None
    batch_id: int | None  # the driver's fault batch number on that GPU
    faults: int | None  # distinct faults
    instances: int | None  # counting the duplicates the hardware merged
    fatal: int | None
    throttled: int | None
    skipped: int | None  # batches of that GPU not reported since the previous report
    by_access: dict[str, int]  # "read" / "write" / "atomic" / "prefetch" -> faults
    addr_min: int | None
    addr_max: int | None
    addrs: list[int]  # the first distinct pages, ascending

    def to_json(self) -> dict[str, Any]:
        return {"pid": self.pid, "cgroup": self.cgroup, "as_id": self.as_id, "gpu": self.gpu,
                "batch_id": self.batch_id, "faults": self.faults, "instances": self.instances,
                "fatal": self.fatal, "throttled": self.throttled, "skipped": self.skipped,
                "by_access": dict(self.by_access), "addr_min": self.addr_min,
                "addr_max": self.addr_max, "addrs": list(self.addrs)}


@dataclass(frozen=True)
class Gap:
    """Events first..last (inclusive) were generated but never reached this listener."""
    first: int
    last: int

    @property
    def count(self) -> int:
        return self.last - self.first + 1

    def describe(self) -> str:
        return f"missed {self.count} event{'s' if self.count != 1 else ''} " \
               f"(seq {self.first}..{self.last})"


@dataclass
class Event:
    """One GPUOS_CMD_EVENT message; fields not carried by its type are None."""
    seq: int
    time_ns: int
    type: EventType | int
    fault: Fault | None = None
    fault_batch: FaultBatch | None = None
    batch_id: int | None = None
    as_id: int | None = None
    statuses: list[int] | None = None  # MIGRATION_DONE: per range, 0 or -errno
    driver_name: str | None = None
    policy: Policy | None = None
    gap: Gap | None = field(default=None, compare=False)  # events missed just before this one

    @property
    def type_name(self) -> str:
        return enum_name(EventType, self.type)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"seq": self.seq, "time_ns": self.time_ns, "type": self.type_name}
        if self.fault is not None:
            out["fault"] = self.fault.to_json()
        if self.fault_batch is not None:
            out["fault_batch"] = self.fault_batch.to_json()
        for key in ("batch_id", "as_id", "statuses", "driver_name"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        if self.policy is not None:
            out.update(self.policy.to_json())
        return out


class GapDetector:
    """Finds missed events from their sequence numbers.

    Every event takes the next number, sent or not, so a jump means the listener
    missed events (its socket overflowed, or it joined late).  ``last`` is the
    last number known before listening (GET_INFO's event_seq), or None to start
    at the first event seen.  Numbers at or below the last one seen (an event
    that raced the GET_INFO) are not gaps.
    """

    def __init__(self, last: int | None = None):
        self.last = last
        self.missed = 0

    def feed(self, seq: int) -> Gap | None:
        gap = None
        if self.last is not None and seq > self.last + 1:
            gap = Gap(self.last + 1, seq - 1)
            self.missed += gap.count
        if self.last is None or seq > self.last:
            self.last = seq
        return gap
