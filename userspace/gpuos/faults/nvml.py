"""NVML as a source of GPU faults: Xid critical errors and NVML's other error events.

Each GPU is registered (nvmlDeviceRegisterEvents) for the error event types it
supports (nvmlDeviceGetSupportedEventTypes) among FAULT_EVENT_TYPES; a thread waits
on the event set (nvmlEventSetWait_v2, with a timeout so that it can stop) and hands
each event, as a FaultEvent with source "nvml", to a callback.  NVML's event data
carries the Xid and the GPU, never the process: pid and process come from the kernel
log's line when the two are joined (join.py).  Clock, P-state and power-source
events are not faults and are not registered.

Without NVML (no driver, no libnvidia-ml) NvmlSource raises NvmlUnavailable; the
watch then runs on the kernel log alone.
"""

from __future__ import annotations

import ctypes
import threading
import time
from typing import Any, Callable

from .kmsg import normalize_pci
from .model import FaultClass, FaultEvent
from .xid import ACT_DEVICE, ACT_DEVICE_LATER, ACT_INFO, RECOVERY_ACTIONS, XidInfo, classify

# nvmlEventType* (nvml.h); the values are NVML's ABI, the names pynvml's.
XID_CRITICAL_ERROR = 0x0008
SINGLE_BIT_ECC = 0x0001
DOUBLE_BIT_ECC = 0x0002
SBE_STORM = 0x0200
DRAM_RETIREMENT_EVENT = 0x0400
DRAM_RETIREMENT_FAILURE = 0x0800
NON_FATAL_POISON = 0x1000
FATAL_POISON = 0x2000
GPU_UNAVAILABLE = 0x4000
GPU_RECOVERY_ACTION = 0x8000

NVML_EVENTS: dict[int, XidInfo] = {
    SINGLE_BIT_ECC: XidInfo(FaultClass.INFO, "single-bit ECC error",
                            "NVML: a corrected (single-bit) ECC error", ACT_INFO,
                            "nvmlEventTypeSingleBitEccError"),
    DOUBLE_BIT_ECC: XidInfo(FaultClass.DEVICE, "double-bit ECC error",
                            "NVML: an uncorrectable (double-bit) ECC error (the kernel log "
                            "usually has Xid 48 or 94/95 with it)", ACT_DEVICE,
                            "nvmlEventTypeDoubleBitEccError"),
    SBE_STORM: XidInfo(FaultClass.INFO, "single-bit ECC error storm",
                       "NVML: a storm of corrected ECC errors", "reported; watch for it repeating",
                       "nvmlEventTypeSingleBitEccErrorStorm"),
    DRAM_RETIREMENT_EVENT: XidInfo(FaultClass.INFO, "DRAM retirement event",
                                   "NVML: memory was retired or remapped (cf. Xid 63)",
                                   "reported; reset the GPU at the next convenient time",
                                   "nvmlEventTypeDramRetirementEvent"),
    DRAM_RETIREMENT_FAILURE: XidInfo(FaultClass.DEVICE, "DRAM retirement failure",
                                     "NVML: retiring or remapping memory failed (cf. Xid 64)",
                                     ACT_DEVICE, "nvmlEventTypeDramRetirementFailure"),
    NON_FATAL_POISON: XidInfo(FaultClass.DEVICE, "non-fatal poison error",
                              "NVML: poisoned data was consumed and contained", ACT_DEVICE_LATER,
                              "nvmlEventTypeNonFatalPoisonError"),
    FATAL_POISON: XidInfo(FaultClass.DEVICE, "fatal poison error",
                          "NVML: poisoned data could not be contained", ACT_DEVICE,
                          "nvmlEventTypeFatalPoisonError"),
    GPU_UNAVAILABLE: XidInfo(FaultClass.DEVICE, "GPU unavailable",
                             "NVML: the GPU became unavailable", ACT_DEVICE,
                             "nvmlEventTypeGpuUnavailableError"),
    GPU_RECOVERY_ACTION: XidInfo(FaultClass.DEVICE, "GPU recovery action",
                                 "NVML: the recovery action the GPU needs changed (cf. Xid 154)",
                                 "follow the recovery action it names (None: nothing)",
                                 "nvmlEventTypeGpuRecoveryAction"),
}

FAULT_EVENT_TYPES = XID_CRITICAL_ERROR
for _t in NVML_EVENTS:
    FAULT_EVENT_TYPES |= _t

_ANY_INSTANCE = 0xFFFFFFFF


class NvmlUnavailable(Exception):
    """NVML cannot be used here (no library, no driver, no GPU, no error events)."""


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _handle_key(handle: Any) -> Any:
    """Something hashable that is equal for two copies of one device handle."""
    try:
        return ctypes.cast(handle, ctypes.c_void_p).value
    except (TypeError, ctypes.ArgumentError):
        return id(handle) if not isinstance(handle, (int, str, bytes, tuple)) else handle


class NvmlSource:
    """NVML's error events of every GPU, as FaultEvents, from a thread.

    `nvml` is the pynvml module (a fake in tests); `wall` stamps the events.
    """

    def __init__(self, nvml: Any = None, wait_ms: int = 200,
                 wall: Callable[[], float] = time.time):
        if nvml is None:
            try:
                import pynvml as nvml  # type: ignore[import-not-found]
            except ImportError as exc:
                raise NvmlUnavailable(f"nvidia-ml-py is not installed ({exc})") from None
        self.nv, self.wait_ms, self.wall = nvml, wait_ms, wall
        self.pci_to_uuid: dict[str, str] = {}
        self.devices: dict[Any, tuple[str, str]] = {}   # handle key -> (pci, uuid)
        self.registered: dict[str, int] = {}            # pci -> event mask
        self.error: str | None = None                   # why the thread stopped, if it did
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._set = None
        try:
            nvml.nvmlInit()
        except Exception as exc:  # NVMLError_LibraryNotFound, _DriverNotLoaded, ...
            raise NvmlUnavailable(f"NVML unavailable: {exc}") from None
        try:
            self._setup()
        except NvmlUnavailable:
            self._shutdown()
            raise
        except Exception as exc:
            self._shutdown()
            raise NvmlUnavailable(f"NVML events unavailable: {exc}") from None

    def _setup(self) -> None:
        nv = self.nv
        count = nv.nvmlDeviceGetCount()
        if count == 0:
            raise NvmlUnavailable("NVML sees no GPU")
        self._set = nv.nvmlEventSetCreate()
        for i in range(count):
            h = nv.nvmlDeviceGetHandleByIndex(i)
            uuid = _text(nv.nvmlDeviceGetUUID(h))
            pci = normalize_pci(_text(nv.nvmlDeviceGetPciInfo(h).busId))
            self.pci_to_uuid[pci] = uuid
            self.devices[_handle_key(h)] = (pci, uuid)
            try:
                supported = nv.nvmlDeviceGetSupportedEventTypes(h)
            except nv.NVMLError:
                supported = 0
            mask = supported & FAULT_EVENT_TYPES
            if mask:
                nv.nvmlDeviceRegisterEvents(h, mask, self._set)
                self.registered[pci] = mask
        if not self.registered:
            raise NvmlUnavailable("no GPU offers NVML error events")

    # -- events
    def wait_one(self) -> FaultEvent | None:
        """One event, or None when none came within wait_ms."""
        nv = self.nv
        try:
            data = nv.nvmlEventSetWait_v2(self._set, self.wait_ms)
        except nv.NVMLError as exc:
            if getattr(exc, "value", None) == getattr(nv, "NVML_ERROR_TIMEOUT", 10):
                return None
            raise
        return self.to_event(data)

    def to_event(self, data: Any) -> FaultEvent:
        pci, uuid = self.devices.get(_handle_key(data.device), ("", None))
        etype, edata = int(data.eventType), int(data.eventData)
        extra: dict = {"nvml_event_type": etype}
        gi = getattr(data, "gpuInstanceId", _ANY_INSTANCE)
        ci = getattr(data, "computeInstanceId", _ANY_INSTANCE)
        if gi not in (_ANY_INSTANCE, None):
            extra["gpu_instance"] = gi
        if ci not in (_ANY_INSTANCE, None):
            extra["compute_instance"] = ci
        if etype == XID_CRITICAL_ERROR:
            ev = FaultEvent(xid=edata, pci=pci, time=self.wall(), source="nvml",
                            fault_class=FaultClass.UNKNOWN, action="", gpu_uuid=uuid,
                            text=f"NVML Xid critical error: Xid {edata}", extra=extra)
            return classify(ev)
        info = NVML_EVENTS.get(etype)
        extra["event_data"] = edata
        if info is None:
            info = XidInfo(FaultClass.UNKNOWN, f"NVML event {etype:#x}",
                           "an NVML event type gpuos does not know", "reported; no automatic action")
        ev = FaultEvent(xid=None, pci=pci, time=self.wall(), source="nvml",
                        fault_class=info.fault_class, action=info.action, gpu_uuid=uuid,
                        text=f"NVML {info.mnemonic or hex(etype)}: data {edata:#x}",
                        extra=extra, name=info.name)
        if etype == GPU_RECOVERY_ACTION:
            ev.extra["recovery_action"] = RECOVERY_ACTIONS.get(edata, f"{edata:#x}")
            if edata == 0:
                ev.fault_class, ev.action = FaultClass.INFO, ACT_INFO
        return ev

    # -- the thread
    def start(self, sink: Callable[[FaultEvent], None]) -> None:
        def loop() -> None:
            while not self._stop.is_set():
                try:
                    ev = self.wait_one()
                except Exception as exc:  # GPU lost, driver unloaded, ...
                    self.error = f"NVML event wait failed: {exc}"
                    return
                if ev is not None:
                    sink(ev)
        self._thread = threading.Thread(target=loop, name="gpuos-nvml-events", daemon=True)
        self._thread.start()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=max(2.0, 3 * self.wait_ms / 1000))
        self._shutdown()

    def _shutdown(self) -> None:
        nv = self.nv
        if self._set is not None and (self._thread is None or not self._thread.is_alive()):
            try:
                nv.nvmlEventSetFree(self._set)
            except Exception:
                pass
            self._set = None
        try:
            nv.nvmlShutdown()
        except Exception:
            pass
