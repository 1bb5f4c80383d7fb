"""Joining the kernel log's and NVML's reports of one fault into one event.

The driver reports an Xid twice: a line in the kernel log (pid, process, channel, MMU
details) and an NVML Xid event (the GPU's UUID).  Reports of the same GPU (PCI bus id;
NVML's device gives it) and the same Xid that arrive within `window` seconds of each
other are one fault, and it is emitted once: as the kernel log's event.

A kernel-log event is emitted as soon as it arrives, never held back for NVML: a
supervisor acts on it (measured on an H100 under MPS: NVML's events came up to 4 s after
the kernel's line, so waiting for them delayed detection by the whole window).  NVML
events already waiting for it are merged into it (source "kmsg+nvml", NVML's UUID,
extra["nvml_events"] counting them); the ones that come later within `window` are
absorbed silently.  A kernel-log event that merged n lines (extra["lines"]) stands for up
to n NVML events, since the driver posts one per line.  An NVML event waits up to
`window` seconds for its kernel-log line (which says more) and is emitted alone if none
comes.  With only one source running nothing waits.  Arrival times come from `clock`, so
tests drive it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from .kmsg import normalize_pci
from .model import FaultEvent


@dataclass(eq=False)  # compared by identity
class _Pending:
    event: FaultEvent
    at: float
    matched: int = 0
    capacity: int = 1


class Joiner:
    def __init__(self, window: float = 2.0, clock: Callable[[], float] = time.monotonic,
                 kmsg: bool = True, nvml: bool = True, pci_to_uuid: dict[str, str] | None = None):
        self.window, self.clock = window, clock
        self.both = kmsg and nvml
        self.pci_to_uuid = {normalize_pci(k): v for k, v in (pci_to_uuid or {}).items()}
        self._kmsg: list[_Pending] = []
        self._nvml: list[_Pending] = []

    @staticmethod
    def _key(ev: FaultEvent) -> tuple[str, int | None]:
        return normalize_pci(ev.pci), ev.xid

    def add(self, ev: FaultEvent) -> list[FaultEvent]:
        """Take one event; return the events ready now (in order)."""
        if ev.gpu_uuid is None:
            ev.gpu_uuid = self.pci_to_uuid.get(normalize_pci(ev.pci))
        if not self.both or ev.xid is None or ev.source not in ("kmsg", "nvml"):
            return [ev]
        now = self.clock()
        out: list[FaultEvent] = []
        key = self._key(ev)
        if ev.source == "kmsg":
            p = _Pending(ev, now, capacity=max(1, int(ev.extra.get("lines", 1))))
            for n in [n for n in self._nvml if self._key(n.event) == key and now - n.at <= self.window]:
                if p.matched >= p.capacity:
                    break
                self._nvml.remove(n)
                self._merge(p, n.event)
            if p.matched < p.capacity:
                self._kmsg.append(p)  # emitted: kept only to absorb NVML's later reports of it
            out.append(ev)
        else:
            for k in self._kmsg:
                if self._key(k.event) == key and k.matched < k.capacity and now - k.at <= self.window:
                    k.matched += 1  # its kernel-log event is out already
                    if k.matched >= k.capacity:
                        self._kmsg.remove(k)
                    break
            else:
                self._nvml.append(_Pending(ev, now))
        return out

    def flush(self) -> list[FaultEvent]:
        """NVML events that waited `window` seconds for a kernel-log line, oldest first."""
        now = self.clock()
        self._kmsg = [p for p in self._kmsg if now - p.at <= self.window]
        due = [p for p in self._nvml if now - p.at > self.window]
        self._nvml = [p for p in self._nvml if now - p.at <= self.window]
        return [p.event for p in due]

    def drain(self) -> list[FaultEvent]:
        """Every waiting NVML event, oldest first (at the end of a watch)."""
        due, self._kmsg, self._nvml = self._nvml, [], []
        return [p.event for p in due]

    @property
    def pending(self) -> int:
        """NVML events waiting for their kernel-log line."""
        return len(self._nvml)

    @staticmethod
    def _merge(into: _Pending, nvml_ev: FaultEvent) -> None:
        ev = into.event
        into.matched += 1
        ev.source = "kmsg+nvml"
        ev.gpu_uuid = ev.gpu_uuid or nvml_ev.gpu_uuid
        ev.extra["nvml_events"] = into.matched
        for k in ("gpu_instance", "compute_instance"):
            if k in nvml_ev.extra and k not in ev.extra:
                ev.extra[k] = nvml_ev.extra[k]
