"""GPU fault events: what `gpuos faults watch` prints and the MPS supervisor acts on.

An event comes from the kernel log (an `NVRM: Xid` line), from NVML (an Xid critical
error event, or another NVML error event), or from both joined into one; with the
patched driver also from gpuos.ko (a client's fatal MMU fault, naming that client).  Its class
says what gpuos can do about it (docs/faults.md has the table, keyed by Xid).
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field
from typing import Any


class FaultClass(str, enum.Enum):
    """What kind of fault, by what it takes to recover (docs/faults.md)."""

    MEMORY = "memory"      # MMU fault of one context: the driver patch can contain it
    SM = "sm"              # SM / graphics exception (illegal instruction, trap, assert)
    COPY = "copy"          # copy-engine fault
    CHANNEL = "channel"    # a channel or context torn down (e.g. after another fault)
    DEVICE = "device"      # the whole GPU: ECC, fallen off the bus, GSP; drain or reset
    INFO = "info"          # reported, needs nothing (e.g. preemptive cleanup notices)
    UNKNOWN = "unknown"    # an Xid we have no entry for: reported, never dropped


@dataclass
class MmuFault:
    """The MMU fault details of an Xid 31 line."""

    engine: str            # e.g. "GRAPHICS GPC1 GPCCLIENT_T1_11", "CE3"
    address: int           # the faulting virtual address
    fault_type: str        # e.g. "FAULT_PDE"
    access_type: str       # e.g. "ACCESS_TYPE_VIRT_WRITE"


@dataclass
class FaultEvent:
    xid: int | None                # None: an NVML event that is not an Xid (`name` says which)
    pci: str                       # the GPU's PCI bus id as the driver prints it ("0000:00:06")
    time: float                    # seconds since the epoch: when the kernel logged it (kmsg,
                                   # from the boot time) or UVM recorded it (uvm-tracker,
                                   # CLOCK_MONOTONIC_RAW), else when gpuos received it
    source: str                    # "kmsg", "nvml", "kmsg+nvml" or "gpuos.ko" (faults/kmod.py)
    fault_class: FaultClass
    action: str                    # what gpuos does for this class (docs/faults.md)
    pid: int | None = None
    process: str | None = None
    channel: int | None = None
    mmu: MmuFault | None = None
    text: str = ""                 # the raw line(s) (kmsg) or NVML's event data
    gpu_uuid: str | None = None
    seq: int | None = None         # kmsg sequence number, for de-duplication
    extra: dict = field(default_factory=dict)
    name: str = ""                 # short name from the table ("GPU memory page fault")

    def to_json(self) -> dict[str, Any]:
        """The event as JSON (docs/faults.md, "Event JSON")."""
        out = asdict(self)
        out["fault_class"] = self.fault_class.value
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "FaultEvent":
        d = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        try:
            d["fault_class"] = FaultClass(d.get("fault_class"))
        except ValueError:
            d["fault_class"] = FaultClass.UNKNOWN
        if d.get("mmu") is not None:
            d["mmu"] = MmuFault(**d["mmu"])
        return cls(**d)
