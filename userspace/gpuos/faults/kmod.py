"""gpuos.ko as a source of GPU faults: the fault reports of the patched driver.

With the gpuos patches applied, nvidia-uvm reports each client's first fatal replayable
fault of a fault batch to gpuos.ko before it cancels it (patches/0003): the process
whose address space faulted (the fault's VEID selects it), the VEID, the address, access
and fault type, and gpuos.ko's decision.  The kernel log's Xid 31 cannot say as much:
under MPS its pid is whichever client the driver associated with the server's shared
channel (measured: a co-running victim, docs/mps.md).  KmodFaultSource listens to
gpuos.ko's FAULT events in a thread of its own and hands each on as a FaultEvent with
source "gpuos.ko" and the faulting pid.  With the stock driver gpuos.ko reports nothing.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

from .. import procs
from ..errors import GpuosError
from ..kernel import connect
from ..kernel.model import Event
from ..kernel.uapi import Decision, EventType, FaultAccess, FaultType, enum_name
from .model import FaultClass, FaultEvent, MmuFault

SOURCE = "gpuos.ko"
NAME = "GPU memory fault (reported through gpuos.ko)"
ACTIONS = {
    Decision.DEFAULT: "no policy for this client: the driver cancels the fault as it would "
                      "without gpuos (its context is torn down; MPS: every client)",
    Decision.ISOLATE: "isolated: the driver contained the client's fault, the other clients run on",
    Decision.KILL_CLIENT: "gpuos.ko killed the faulting client, the other clients run on",
}


class KmodUnavailable(Exception):
    """gpuos.ko is not loaded (or cannot be listened to)."""


def fault_event(ev: Event, now_wall: float, now_mono_ns: int) -> FaultEvent | None:
    """The FaultEvent of a gpuos.ko FAULT event, or None for any other event."""
    if ev.type != EventType.FAULT or ev.fault is None:
        return None
    f = ev.fault
    decision = f.decision if f.decision is not None else Decision.DEFAULT
    mmu = None
    if f.addr is not None:
        mmu = MmuFault(engine="" if f.veid is None else f"VEID {f.veid}", address=f.addr,
                       fault_type=enum_name(FaultType, f.type) if f.type is not None else "",
                       access_type=enum_name(FaultAccess, f.access) if f.access is not None else "")
    extra: dict[str, Any] = {"veid": f.veid, "as_id": f.as_id, "uvm_gpu": f.gpu, "cgroup": f.cgroup,
                             "decision": enum_name(Decision, decision), "kmod_seq": ev.seq}
    return FaultEvent(xid=None, pci="", time=now_wall - (now_mono_ns - ev.time_ns) / 1e9,
                      source=SOURCE, fault_class=FaultClass.MEMORY,
                      action=ACTIONS.get(decision, ACTIONS[Decision.DEFAULT]), pid=f.pid,
                      process=None if f.pid is None else procs.comm(f.pid), mmu=mmu, extra=extra, name=NAME)


class KmodFaultSource:
    """gpuos.ko's fault reports as FaultEvents, from a thread (like NvmlSource)."""

    def __init__(self) -> None:
        try:
            self._nl = connect()
        except GpuosError as exc:  # KmodNotLoaded, no pyroute2, no netlink
            raise KmodUnavailable(str(exc)) from None
        try:
            self._sub = self._nl.subscribe()
        except GpuosError as exc:
            self._nl.close()
            raise KmodUnavailable(str(exc)) from None
        self.error: str | None = None  # why the thread stopped, if it did
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, callback: Callable[[FaultEvent], None]) -> None:
        self._thread = threading.Thread(target=self._run, args=(callback,), name="gpuos-kmod-faults",
                                        daemon=True)
        self._thread.start()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _run(self, callback: Callable[[FaultEvent], None]) -> None:
        try:
            while not self._stop.is_set():
                ev = self._sub.next(timeout=0.2)
                if ev is None:
                    continue
                fe = fault_event(ev, time.time(), time.monotonic_ns())
                if fe is not None:
                    callback(fe)
        except GpuosError as exc:  # unloaded, or the socket failed
            self.error = f"gpuos.ko: {exc}"

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        self._sub.close()
        self._nl.close()
