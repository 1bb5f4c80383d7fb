"""The fault stream: kernel log, NVML and gpuos.ko in, classified and joined FaultEvents out.

    kernel log (KmsgReader | DmesgPoller) --records--> XidAssembler --\
                                                                     Joiner --> events
    NVML (NvmlSource, its own thread)     --events--------------------/
    gpuos.ko (KmodFaultSource, its thread) --events: passed through, never joined--/
    UVM fault trackers (uvm_tools.TrackerFaultSource, its thread) --the same--------/

`gpuos faults watch` drives it; so can any other consumer (the MPS supervisor).
poll() waits at most `timeout` seconds for something to happen (the kernel log's
descriptor, or a byte the NVML thread writes to a pipe) and returns what is ready:
FaultEvents, KmsgGaps (the kernel log overflowed) and Notices (a source stopped).
drain() returns what is still held back (lines waiting for continuations, events
waiting for their partner) at the end.
"""

from __future__ import annotations

import os
import queue
import select
import time
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence, Union

from .join import Joiner
from .kmsg import KmsgGap, XidAssembler
from .model import FaultEvent
from .nvml import NvmlSource


@dataclass
class Notice:
    """Something about the sources the user should hear once (e.g. NVML stopped)."""
    text: str


Item = Union[FaultEvent, KmsgGap, Notice]


class ThreadedSource(Protocol):
    """A source that reports FaultEvents from a thread of its own."""

    error: str | None

    def start(self, callback: Callable[[FaultEvent], None]) -> None: ...
    def stop(self) -> None: ...


class FaultStream:
    def __init__(self, kernel_log=None, nvml: NvmlSource | None = None, *, window: float = 2.0,
                 settle: float = 0.25, clock: Callable[[], float] = time.monotonic,
                 boot_time: float | None = None, threaded: Sequence[ThreadedSource] = ()):
        """threaded: sources that report from a thread of their own (gpuos.ko's reports,
        UVM's fault trackers): start(callback), error, stop()."""
        if kernel_log is None and nvml is None:
            raise ValueError("a fault stream needs the kernel log or NVML")
        self.kernel_log, self.nvml, self.threaded, self.clock = kernel_log, nvml, list(threaded), clock
        self.assembler = XidAssembler(settle=settle, clock=clock, boot_time=boot_time)
        self.joiner = Joiner(window=window, clock=clock, kmsg=kernel_log is not None,
                             nvml=nvml is not None,
                             pci_to_uuid=nvml.pci_to_uuid if nvml is not None else None)
        self._queue: queue.SimpleQueue[FaultEvent] = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._nvml_error_told = False
        self._errors_told: set[int] = set()
        if nvml is not None:
            nvml.start(self._from_thread)
        for src in self.threaded:
            src.start(self._from_thread)

    def _from_thread(self, ev: FaultEvent) -> None:  # the NVML thread or a threaded source's
        self._queue.put(ev)
        try:
            os.write(self._wake_w, b"!")
        except (BlockingIOError, OSError):
            pass  # the pipe is full: poll() is awake anyway

    @property
    def exhausted(self) -> bool:
        """A file given as the kernel log was read to its end, and nothing else runs."""
        return self.nvml is None and bool(getattr(self.kernel_log, "exhausted", False))

    def fds(self) -> list[int]:
        """Readable when poll may have something: the kernel log's fd (where it has one)
        and the wakeup of the threaded sources (NVML's among them)."""
        klog_fd = self.kernel_log.fileno() if self.kernel_log is not None else None
        return [self._wake_r] + ([klog_fd] if klog_fd is not None else [])

    def poll(self, timeout: float) -> list[Item]:
        fds = self.fds()
        if self.kernel_log is not None and self.kernel_log.fileno() is None:
            timeout = min(timeout, 0.2)  # DmesgPoller: it keeps its own interval
        if self._queue.empty() and timeout > 0 and not self.exhausted:
            try:
                select.select(fds, [], [], timeout)
            except InterruptedError:
                pass
        try:
            os.read(self._wake_r, 4096)
        except BlockingIOError:
            pass
        out: list[Item] = []
        if self.kernel_log is not None:
            for rec in self.kernel_log.read():
                if isinstance(rec, KmsgGap):  # no line continues across it: close what is open
                    for ev in self.assembler.drain():
                        out += self.joiner.add(ev)
                    out.append(rec)
                    continue
                for ev in self.assembler.feed(rec):
                    out += self.joiner.add(ev)
        while True:
            try:
                ev = self._queue.get_nowait()
            except queue.Empty:
                break
            out += self.joiner.add(ev)
        for ev in self.assembler.flush():
            out += self.joiner.add(ev)
        out += self.joiner.flush()
        for i, src in enumerate(self.threaded):
            if src.error and i not in self._errors_told:
                self._errors_told.add(i)
                out.append(Notice(f"{src.error}; its fault reports stopped"))
        if self.nvml is not None and self.nvml.error and not self._nvml_error_told:
            self._nvml_error_told = True
            out.append(Notice(f"{self.nvml.error}; NVML events stopped"
                              + (", the kernel log goes on" if self.kernel_log is not None else "")))
        return out

    def drain(self) -> list[Item]:
        out: list[Item] = []
        for ev in self.assembler.drain():
            out += self.joiner.add(ev)
        while True:
            try:
                out += self.joiner.add(self._queue.get_nowait())
            except queue.Empty:
                break
        out += self.joiner.drain()
        return out

    def close(self) -> None:
        for src in self.threaded:
            src.stop()
        if self.nvml is not None:
            self.nvml.stop()
        if self.kernel_log is not None:
            self.kernel_log.close()
        if self.nvml is not None and self.nvml.running:
            return  # its thread is stuck in NVML: leave it the pipe rather than a reused fd
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass

    def __enter__(self) -> "FaultStream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
